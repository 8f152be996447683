"""Config overrides that point the Table 14 configs at another COCO-format
dataset and image size, for quick runs (quickstart, tests, smoke tests).

``small_run_overrides(...)`` returns a flat ``{dotted.key: value}`` dict that
works both with ``Config.merge_from_dict(..., allow_list_keys=True)`` and, via
``to_cli_options``, with ``--cfg-options`` of mmdet's ``tools/train.py`` and
``tools/test.py``. The indices (``pipeline.2`` ...) follow the pipelines of
``configs/mmdet/_base_/mask-rcnn_timm-fpn_syncbn_lsj-130k_coco.py``.
"""
import os.path as osp


def small_run_overrides(data_root, image_size=128, max_iters=4,
                        batch_size=1, num_workers=0, train_ann=None,
                        val_ann=None, train_img='train/', val_img='val/',
                        classes=None, num_classes=None,
                        checkpoint_interval=None,
                        filter_empty_gt=True, log_interval=1,
                        light_heads=True, validate=True):
    """Overrides for a short run on a generated dataset (see
    ``tools/make_coco_dataset.py``) at ``image_size`` x ``image_size``."""
    if image_size % 32:
        raise ValueError(f'image_size must be a multiple of 32 (the '
                         f'backbone stride), got {image_size}')
    data_root = osp.join(data_root, '')
    train_ann = train_ann or 'annotations/instances_train.json'
    val_ann = val_ann or 'annotations/instances_val.json'
    size = (image_size, image_size)
    o = {
        'model.data_preprocessor.batch_augments.0.size': size,
        'train_dataloader.dataset.pipeline.2.scale': size,
        'train_dataloader.dataset.pipeline.3.crop_size': size,
        'val_dataloader.dataset.pipeline.1.scale': size,
        'test_dataloader.dataset.pipeline.1.scale': size,
        'train_cfg.max_iters': max_iters,
        'train_cfg.val_interval': max_iters,
        # validate=False: no evaluation at the end of training (use test)
        'train_cfg.val_begin': 1 if validate else max_iters + 1,
        'default_hooks.checkpoint.interval':
        checkpoint_interval or max_iters,
        'default_hooks.logger.interval': log_interval,
        'train_dataloader.dataset.filter_cfg.filter_empty_gt':
        filter_empty_gt,
    }
    for split, ann, img in (('train', train_ann, train_img),
                            ('val', val_ann, val_img),
                            ('test', val_ann, val_img)):
        key = f'{split}_dataloader'
        o[f'{key}.batch_size'] = batch_size if split == 'train' else 1
        o[f'{key}.num_workers'] = num_workers
        o[f'{key}.persistent_workers'] = num_workers > 0
        o[f'{key}.dataset.data_root'] = data_root
        o[f'{key}.dataset.ann_file'] = ann
        o[f'{key}.dataset.data_prefix.img'] = img
        if classes is not None:
            o[f'{key}.dataset.metainfo.classes'] = tuple(classes)
    if light_heads:
        # Fewer proposals / sampled RoIs: the 4conv1fc box head runs on
        # every RoI, and 1000 test proposals take ~20 s per image on a CPU.
        o.update({
            'model.train_cfg.rpn_proposal.nms_pre': 400,
            'model.train_cfg.rpn_proposal.max_per_img': 200,
            'model.train_cfg.rcnn.sampler.num': 64,
            'model.test_cfg.rpn.nms_pre': 200,
            'model.test_cfg.rpn.max_per_img': 100,
            'model.test_cfg.rcnn.max_per_img': 50,
        })
    if num_classes is not None:
        o['model.roi_head.bbox_head.num_classes'] = num_classes
        o['model.roi_head.mask_head.num_classes'] = num_classes
    for split in ('val', 'test'):
        o[f'{split}_evaluator.ann_file'] = osp.join(data_root, val_ann)
    return o


def to_cli_options(overrides):
    """``['key=value', ...]`` for ``--cfg-options`` (mmengine DictAction)."""
    out = []
    for k, v in overrides.items():
        if isinstance(v, tuple):
            if v and isinstance(v[0], str):
                v = '(' + ','.join(str(x) for x in v) + ',)'
            else:
                v = '(' + ','.join(str(x) for x in v) + ')'
        out.append(f'{k}={v}')
    return out
