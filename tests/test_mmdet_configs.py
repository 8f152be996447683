"""Table 14 configs: parse, build, forward + loss at a small size."""
import _det  # noqa: F401  (skips this module without the [det] extra)

# isort: split
import os.path as osp

import pytest
import torch
from mmdet.registry import MODELS
from mmdet.structures import DetDataSample
from mmdet.testing import demo_mm_inputs
from mmdet.utils import register_all_modules
from mmengine.config import Config
from mmengine.model import revert_sync_batchnorm

import timm_lambda_mmdet  # noqa: F401
from _mmdet_helpers import CONFIG_DIR, TABLE14
from timm_lambda_mmdet.overrides import small_run_overrides

register_all_modules()


def load(name, size=64):
    cfg = Config.fromfile(osp.join(CONFIG_DIR, name))
    cfg.merge_from_dict(
        small_run_overrides('data/unused', image_size=size, num_classes=4),
        allow_list_keys=True)
    return cfg


def test_schedule_matches_paper_appendix_f3():
    cfg = Config.fromfile(osp.join(CONFIG_DIR, list(TABLE14)[2]))
    # the plugin, and the opt-in to torch's weights_only allow-list for mmengine checkpoints (resume / test)
    assert cfg.custom_imports == dict(imports=['timm_lambda_mmdet', 'timm_lambda_mmdet.runner_checkpoints'],
                                      allow_failed_imports=False)
    assert cfg.train_cfg.max_iters == 130000
    opt = cfg.optim_wrapper.optimizer
    assert (opt.type, opt.lr, opt.momentum, opt.weight_decay) == (
        'SGD', 0.32, 0.9, 4e-5)
    warm, steps = cfg.param_scheduler
    assert warm.type == 'LinearLR' and warm.end == 1000
    assert warm.start_factor <= 1e-3 and not warm.by_epoch
    assert steps.milestones == [117000, 123500, 126750]
    assert steps.gamma == 0.1 and not steps.by_epoch
    assert cfg.auto_scale_lr == dict(enable=True, base_batch_size=256)
    # LSJ: 1024 crop, scale jitter [0.1, 2.0], fixed-size padding
    pipe = cfg.train_dataloader.dataset.pipeline
    assert pipe[2].type == 'RandomResize' and pipe[2].ratio_range == (0.1,
                                                                      2.0)
    assert pipe[2].scale == (1024, 1024)
    assert pipe[3].type == 'RandomCrop' and pipe[3].crop_size == (1024, 1024)
    pad = cfg.model.data_preprocessor.batch_augments[0]
    assert pad.type == 'BatchFixedSizePad' and pad.size == (1024, 1024)
    assert cfg.model.data_preprocessor.pad_size_divisor == 32
    # synchronized BN everywhere, from scratch
    assert cfg.model.backbone.norm_cfg.type == 'SyncBN'
    assert cfg.model.neck.norm_cfg.type == 'SyncBN'
    assert cfg.model.roi_head.bbox_head.norm_cfg.type == 'SyncBN'
    assert cfg.model.roi_head.mask_head.norm_cfg.type == 'SyncBN'
    assert cfg.model.backbone.init_cfg == dict(type='Pretrained', checkpoint=None)  # from scratch
    assert cfg.val_evaluator.metric == ['bbox', 'segm']
    # checks that fail early; no CPU-only convenience in the production config
    assert cfg.custom_hooks == [dict(type='PreflightHook')]
    assert cfg.train_dataloader.dataset.type == 'CheckedCocoDataset'
    assert cfg.test_dataloader.dataset.type == 'CheckedCocoDataset'
    assert 'model_wrapper_cfg' not in cfg
    assert cfg.env_cfg.dist_cfg.backend == 'nccl'


def test_cpu_distributed_override_is_opt_in():
    cfg = Config.fromfile(osp.join(CONFIG_DIR, 'mask-rcnn_lambdaresnet101_fpn_syncbn_lsj-130k_coco_cpu-ddp.py'))
    assert cfg.model_wrapper_cfg.type == 'CPUCompatibleDDP'
    assert cfg.env_cfg.dist_cfg.backend == 'gloo'
    assert 'timm_lambda_mmdet.cpu_distributed' in cfg.custom_imports.imports
    # importing the plugin alone leaves mmengine's process-group set-up untouched
    import subprocess
    import sys
    code = ('import timm_lambda_mmdet\n'
            'from mmengine.dist import utils\n'
            'print(getattr(utils._init_dist_pytorch, "_cpu_ok", False))\n'
            'import timm_lambda_mmdet.cpu_distributed\n'
            'print(getattr(utils._init_dist_pytorch, "_cpu_ok", False))\n')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300).stdout.split()
    assert out == ['False', 'True']


@pytest.mark.parametrize('name', sorted(TABLE14))
def test_amp_variant(name):
    amp = name.replace('_lsj-', '_amp-lsj-')
    cfg = Config.fromfile(osp.join(CONFIG_DIR, amp))
    assert cfg.optim_wrapper.type == 'AmpOptimWrapper'
    assert cfg.optim_wrapper.optimizer.lr == 0.32
    assert cfg.model.backbone.model_name == TABLE14[name]


def _loss(model, packed):
    data = model.data_preprocessor(packed, True)
    losses = model.loss(data['inputs'], data['data_samples'])
    total = 0
    for k, v in losses.items():
        if 'loss' in k:
            v = sum(v) if isinstance(v, (list, tuple)) else v
            assert torch.isfinite(v).all(), (k, v)
            total = total + v
    return total, losses


@pytest.mark.parametrize('name', list(TABLE14))
def test_build_forward_loss(name):
    cfg = load(name)
    assert cfg.model.backbone.model_name == TABLE14[name]
    torch.manual_seed(0)
    model = revert_sync_batchnorm(MODELS.build(cfg.model))
    model.init_weights()
    model.train()
    packed = demo_mm_inputs(1, [[3, 64, 64]], num_items=[3], num_classes=4,
                            with_mask=True)
    total, _ = _loss(model, packed)
    total.backward()
    assert model.backbone.body['layer4'][0].conv1.weight.grad is not None


def test_images_without_objects_and_odd_sizes():
    """Empty ground truth trains with a finite loss; image sizes that are
    not multiples of 32 are padded by the data preprocessor
    (pad_size_divisor=32) -- the backbone alone refuses them."""
    cfg = load('mask-rcnn_lambdaresnet101_fpn_syncbn_lsj-130k_coco.py')
    cfg.model.backbone.model_name = 'lambdaresnet50'
    cfg.model.data_preprocessor.batch_augments = None  # test-time padding
    torch.manual_seed(0)
    model = revert_sync_batchnorm(MODELS.build(cfg.model))
    model.train()
    packed = demo_mm_inputs(2, [[3, 70, 90], [3, 61, 75]], num_items=[0, 2],
                            num_classes=4, with_mask=True)
    assert len(packed['data_samples'][0].gt_instances) == 0
    data = model.data_preprocessor(packed, True)
    assert tuple(data['inputs'].shape[-2:]) == (96, 96)
    total, losses = _loss(model, packed)
    total.backward()
    # a batch with no object at all
    packed = demo_mm_inputs(1, [[3, 64, 64]], num_items=[0], num_classes=4,
                            with_mask=True)
    total, losses = _loss(model, packed)
    assert float(losses['loss_bbox'].detach()) == 0.0
    total.backward()
    # inference on an odd size
    model.eval()
    packed = demo_mm_inputs(1, [[3, 70, 90]], num_classes=4, with_mask=True)
    with torch.no_grad():
        data = model.data_preprocessor(packed, False)
        res = model.predict(data['inputs'], data['data_samples'])
    assert isinstance(res[0], DetDataSample)
    assert res[0].pred_instances.masks.shape[-2:] == (70, 90)
    with pytest.raises(ValueError, match='pad_size_divisor'):
        model.backbone(torch.zeros(1, 3, 70, 90))


def test_pretrained_backbone_route_merges_from_child_config_and_cfg_options(tmp_path):
    """The README's route: the base config's dict-valued init_cfg (checkpoint=None: from scratch) accepts a child
    config's init_cfg and --cfg-options keys (a None base made both a mmengine TypeError); a string init_cfg is an
    error that names the right spelling."""
    import argparse

    from mmengine.config import DictAction
    base = osp.join(CONFIG_DIR, 'mask-rcnn_lambdaresnet101_fpn_syncbn_lsj-130k_coco.py')
    child = tmp_path / 'child.py'
    child.write_text(f"_base_ = {base!r}\n"
                     "model = dict(backbone=dict(init_cfg=dict(type='Pretrained', checkpoint='w.pth')))\n")
    assert Config.fromfile(str(child)).model.backbone.init_cfg == dict(type='Pretrained', checkpoint='w.pth')
    parser = argparse.ArgumentParser()
    parser.add_argument('--cfg-options', nargs='+', action=DictAction)  # as mmdet's tools/train.py
    for opts, expected in [(['model.backbone.init_cfg.type=Pretrained', 'model.backbone.init_cfg.checkpoint=w.pth'],
                            dict(type='Pretrained', checkpoint='w.pth')),
                           (['model.backbone.init_cfg.checkpoint=w.pth', 'model.backbone.init_cfg.use_ema=False'],
                            dict(type='Pretrained', checkpoint='w.pth', use_ema=False))]:
        cfg = Config.fromfile(base)
        cfg.merge_from_dict(parser.parse_args(['--cfg-options'] + opts).cfg_options)
        assert cfg.model.backbone.init_cfg == expected
    cfg = Config.fromfile(base)
    cfg.merge_from_dict(parser.parse_args(['--cfg-options', 'model.backbone.init_cfg=w.pth']).cfg_options)
    with pytest.raises(ValueError, match=r"init_cfg='w.pth' is a string.*model.backbone.init_cfg.checkpoint=PATH"):
        MODELS.build(dict(cfg.model.backbone, model_name='lambdaresnet50'))
