"""The README's main job: train a LambdaResNet Mask R-CNN on generated COCO-format data until it detects.

Steps (:func:`run`):

1. generate a deterministic COCO-format instance-segmentation set (:mod:`_lib.synthetic_coco`:
   four shape classes with polygon masks, crowd regions, images without objects) with separate train and
   held-out val images;
2. train Mask R-CNN + FPN with a LambdaResNet backbone from the paper's Table 14 config
   (``configs/mmdet/mask-rcnn_lambdaresnet101_fpn_syncbn_lsj-130k_coco.py``) scaled down for a CPU:
   the backbone, image size, schedule and heads are overridden (:data:`DEFAULTS` says how and why);
   mmengine logs every few iterations with the ETA;
3. evaluate the saved checkpoint on the held-out images in a fresh Runner (COCO bbox and segm AP from
   pycocotools), draw the predicted boxes and masks of a few of them with mmdet's visualizer and plot the
   training loss, both as PNGs in the work directory.
"""
import glob
import json
import os.path as osp
import time
from typing import Optional

import numpy as np

from timm_lambda_mmdet.overrides import small_run_overrides

from .synthetic_coco import make_coco_dataset

__all__ = ['DEFAULTS', 'CONFIG_NAME', 'build_config', 'run']

CONFIG_NAME = 'mask-rcnn_lambdaresnet101_fpn_syncbn_lsj-130k_coco.py'  # in configs/mmdet/ of the repository

# What the CPU run changes from the Table 14 config, and why (tuned on 2 CPU cores):
DEFAULTS = dict(
    # LambdaResNet-50 layout cut to 2 blocks per stage (the same kind of lambda blocks: c4's last block
    # and every c5 block; 23x23 scope): the paper's 101-layer backbone does ~1 iteration per 10 s here.
    model='lambdaresnet50',
    model_kwargs=dict(layers=(2, 2, 2, 2), lambda_blocks=(None, None, (2,), 'all')),
    # Mask R-CNN's FPN and heads at 64 channels instead of 256, a 2-conv mask head instead of 4: the 4conv1fc box
    # head and the mask head dominate a CPU step at 256 channels (4.6 s -> 1.0 s per step on one core)
    head_channels=64,
    mask_convs=2,
    image_size=128,      # 1024 in the paper; the generated shapes are 10-35 px across at 160 px
    batch_size=4,        # per step; BatchNorm statistics over 4 images
    iters=200,           # ~0.54 s per iteration on 2 idle cores; bbox AP50 0.72 after 150, 0.88 after 300
    lr=0.04,             # SGD, momentum 0.9 (paper's 0.32 is for batch 256)
    warmup_iters=30,
    num_train=160,       # generated images; the val images are generated separately (held out)
    num_val=24,
    seed=0,
)


def build_config(data: dict, work_dir: str, config: str, model: str = DEFAULTS['model'],
                 model_kwargs: Optional[dict] = None, image_size: int = DEFAULTS['image_size'],
                 batch_size: int = DEFAULTS['batch_size'], iters: int = DEFAULTS['iters'],
                 lr: float = DEFAULTS['lr'], warmup_iters: int = DEFAULTS['warmup_iters'],
                 head_channels: int = DEFAULTS['head_channels'], mask_convs: int = DEFAULTS['mask_convs'],
                 seed: int = DEFAULTS['seed'], log_interval: int = 10):
    """The Table 14 config with the CPU-run overrides of :data:`DEFAULTS`."""
    from mmengine.config import Config

    cfg = Config.fromfile(config)
    cfg.merge_from_dict(
        small_run_overrides(osp.dirname(osp.dirname(data['train'])), image_size=image_size, max_iters=iters,
                            batch_size=batch_size, classes=data['classes'], num_classes=len(data['classes']),
                            validate=False, log_interval=log_interval),
        allow_list_keys=True)
    c = head_channels
    cfg.merge_from_dict({
        'model.neck.out_channels': c, 'model.rpn_head.in_channels': c, 'model.rpn_head.feat_channels': c,
        'model.roi_head.bbox_roi_extractor.out_channels': c, 'model.roi_head.mask_roi_extractor.out_channels': c,
        'model.roi_head.bbox_head.in_channels': c, 'model.roi_head.bbox_head.conv_out_channels': c,
        'model.roi_head.mask_head.in_channels': c, 'model.roi_head.mask_head.conv_out_channels': c,
        'model.roi_head.mask_head.num_convs': mask_convs})
    cfg.model.backbone.model_name = model
    cfg.model.backbone.model_kwargs = dict(DEFAULTS['model_kwargs'] if model_kwargs is None else model_kwargs)
    cfg.auto_scale_lr.enable = False
    cfg.optim_wrapper.optimizer.lr = lr
    cfg.optim_wrapper.clip_grad = dict(max_norm=10.0)  # from-scratch BN nets spike in the first steps
    cfg.param_scheduler = [
        dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=max(1, min(warmup_iters, iters))),
        dict(type='MultiStepLR', by_epoch=False, begin=0, end=iters, milestones=[int(iters * 0.8)], gamma=0.1),
    ]
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', by_epoch=False, interval=iters, max_keep_ckpts=1)
    cfg.randomness = dict(seed=seed)
    cfg.work_dir = work_dir
    return cfg


def _loss_curve(work_dir: str, path: str) -> Optional[str]:
    """Plot ``loss`` against the iteration from the scalars mmengine logged during training."""
    files = sorted(glob.glob(osp.join(work_dir, '*', 'vis_data', 'scalars.json')))
    its, losses = [], []
    for f in files:
        with open(f) as fh:
            for line in fh:
                rec = json.loads(line)
                if 'loss' in rec and 'iter' in rec:
                    its.append(rec['iter'])
                    losses.append(rec['loss'])
    if not its:
        return None
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(its, losses, '-o', ms=2)
    ax.set_xlabel('iteration')
    ax.set_ylabel('training loss (sum of Mask R-CNN losses)')
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_predictions(runner, cfg, data: dict, path: str, count: int = 4, score_thr: float = 0.3) -> str:
    """Boxes and masks predicted on ``count`` held-out images, drawn by mmdet's visualizer, as one PNG."""
    import mmcv
    from mmdet.apis import inference_detector
    from mmdet.registry import VISUALIZERS
    from pycocotools.coco import COCO

    model = runner.model.eval()
    model.cfg = cfg
    coco = COCO(data['val'])
    images = coco.loadImgs(sorted(coco.getImgIds()))[:count]
    visualizer = VISUALIZERS.build(dict(type='DetLocalVisualizer', name='quickstart_predictions',
                                        vis_backends=[]))
    visualizer.dataset_meta = dict(classes=data['classes'],
                                   palette=[(220, 40, 40), (40, 200, 40), (40, 60, 220), (220, 200, 30)])
    tiles = []
    img_dir = osp.join(osp.dirname(osp.dirname(data['val'])), 'val')
    for info in images:
        image = mmcv.imread(osp.join(img_dir, info['file_name']), channel_order='rgb')
        result = inference_detector(model, osp.join(img_dir, info['file_name']))
        visualizer.add_datasample(info['file_name'], image, result, draw_gt=False, pred_score_thr=score_thr,
                                  show=False)
        tile = visualizer.get_image()
        tiles.append(mmcv.imresize(tile, (256, 256)))
    grid = np.concatenate(tiles, axis=1)
    mmcv.imwrite(grid[..., ::-1], path)  # RGB -> BGR for imwrite
    return path


def run(config: str, work_dir: str = 'work_dirs/quickstart', **overrides) -> dict:
    """Generate data, train, evaluate the saved checkpoint on held-out images, write the PNGs.

    ``config``: path of the Table 14 config (:data:`CONFIG_NAME` in the repository's configs/mmdet/);
    ``overrides``: any key of :data:`DEFAULTS`. Returns the COCO metrics and the paths written.
    """
    from mmengine.runner import Runner

    import timm_lambda_mmdet  # noqa: F401  (registers the backbone, dataset and hook)

    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f'unknown quickstart options {sorted(unknown)}; accepted: {sorted(DEFAULTS)}')
    opt = dict(DEFAULTS, **overrides)
    t0 = time.time()
    data = make_coco_dataset(osp.join(work_dir, 'data'), num_train=opt['num_train'], num_val=opt['num_val'],
                             image_size=max(opt['image_size'] + 32, 160), seed=opt['seed'])
    print(f"[quickstart] generated {opt['num_train']} training and {opt['num_val']} held-out images: "
          f"{data['train']}, {data['val']}", flush=True)
    if not osp.isfile(config):
        raise FileNotFoundError(f'config {config!r} does not exist (configs/mmdet/{CONFIG_NAME} of the repository)')
    cfg_args = {k: opt[k] for k in ('model', 'model_kwargs', 'image_size', 'batch_size', 'iters', 'lr',
                                    'warmup_iters', 'head_channels', 'mask_convs', 'seed')}
    cfg_args['config'] = config

    cfg = build_config(data, work_dir, **cfg_args)
    cfg.experiment_name = 'quickstart_train'
    Runner.from_cfg(cfg).train()
    ckpt = osp.join(work_dir, f"iter_{opt['iters']}.pth")
    if not osp.isfile(ckpt):
        raise RuntimeError(f'training did not write {ckpt}')
    t_train = time.time() - t0
    print(f"[quickstart] trained {opt['iters']} iterations ({opt['model']}, {opt['image_size']}px) in "
          f'{t_train:.0f}s; checkpoint {ckpt}', flush=True)

    # Evaluate in a fresh Runner that loads the checkpoint from disk (weights_only unpickler; PreflightHook
    # checks its keys against the model).
    cfg = build_config(data, work_dir, **cfg_args)
    cfg.experiment_name = 'quickstart_test'
    cfg.load_from = ckpt
    tester = Runner.from_cfg(cfg)
    metrics = tester.test()
    print('\n[quickstart] COCO metrics on the held-out images, from', ckpt)
    for task in ('bbox', 'segm'):
        keys = ['mAP', 'mAP_50', 'mAP_75', 'mAP_s', 'mAP_m', 'mAP_l']
        print(f'  {task:4s} ' + '  '.join(f"{k}={metrics[f'coco/{task}_{k}']:.3f}" for k in keys))
    out = dict(metrics=metrics, checkpoint=ckpt)
    out['predictions_png'] = _draw_predictions(tester, cfg, data, osp.join(work_dir, 'predictions.png'))
    out['loss_png'] = _loss_curve(work_dir, osp.join(work_dir, 'loss.png'))
    print(f"[quickstart] predictions on held-out images: {out['predictions_png']}")
    if out['loss_png']:
        print(f"[quickstart] training loss curve: {out['loss_png']}")
    print(f'[quickstart] done in {time.time() - t0:.0f}s')
    return out
