# Mask R-CNN + FPN with a timm backbone (LambdaResNet / ResNet-RS), trained
# as in LambdaNetworks (Bello, ICLR 2021), appendix F.3 "COCO object
# detection" / Table 14: 1024x1024 inputs, scale jitter [0.1, 2.0] with
# random crop and fixed-size padding (LSJ), synchronized batch norm, from
# scratch, 130k steps at batch 256, SGD momentum 0.9, weight decay 4e-5,
# LR warm-up over 1000 steps from 0 to 0.32, /10 at 90%, 95%, 97.5%.
#
# Built on mmdet's large-scale-jitter strong baseline (Mask R-CNN R-50 FPN,
# SyncBN everywhere, 2-conv RPN, 4conv1fc box head, LSJ, COCO bbox+segm
# evaluation). What differs from that baseline:
#   * backbone: TimmLambdaResNet (timm_lambda_mmdet) instead of mmdet's ResNet-50;
#   * schedule: 130k iterations (IterBasedTrainLoop, InfiniteSampler, no
#     RepeatDataset) instead of 100 epochs (RepeatDataset x4, 25 epochs);
#   * LR: 0.32 for total batch 256 (auto_scale_lr enabled, base 256) instead
#     of 0.1 for batch 64; warm-up 1000 iterations from ~0 (start_factor
#     1e-3; mmengine's LinearLR cannot start at exactly 0) instead of 500
#     from 0.067; steps at 117k/123.5k/126.75k iterations instead of epochs
#     22/24;
#   * test images resized to fit 1024x1024 ("1024x1024 inputs") instead of
#     (1333, 800);
#   * heads: PyTorch SyncBN instead of mmcv's MMSyncBN. MMSyncBN was used
#     because torch SyncBN failed on empty RoI batches (pytorch#36530), which
#     torch fixed long ago (empty inputs are masked out of the statistics);
#     MMSyncBN also queries the process group in its constructor, so a model
#     using it cannot even be built without torch.distributed. torch SyncBN
#     can: mmengine reverts it to BatchNorm when not distributed.
#   * dataset: CheckedCocoDataset (= CocoDataset with errors that name the
#     file and the problem: malformed JSON, classes matching no category,
#     nothing left after filtering);
#   * custom_hooks: PreflightHook refuses a checkpoint whose keys do not
#     match the model (load_from, mmdet's tools/test.py) and unwritable
#     output files, before the run.
# CPU-only conveniences (gloo process groups under torchrun, a DDP wrapper
# that drops device_ids) are opt-in: configs/mmdet/*_cpu-ddp.py.
# Same as the baseline: weight decay 4e-5, SGD momentum 0.9, SyncBN in
# backbone, neck and heads, BatchFixedSizePad to 1024.
#
# Without a process group (one process, CPU or GPU) mmengine's Runner reverts
# SyncBN to BatchNorm, so the same config runs on a laptop.
_base_ = 'mmdet::strong_baselines/mask-rcnn_r50_fpn_rpn-2conv_4conv1fc_syncbn-all_lsj-100e_coco.py'  # noqa: E501

# timm_lambda_mmdet registers the backbone, dataset and hook; timm_lambda_mmdet.runner_checkpoints lets torch's
# weights_only loading (torch >= 2.6) accept mmengine Runner checkpoints (tools/train.py --resume, tools/test.py).
custom_imports = dict(
    imports=['timm_lambda_mmdet', 'timm_lambda_mmdet.runner_checkpoints'],
    allow_failed_imports=False)

image_size = (1024, 1024)
norm_cfg = dict(type='SyncBN', requires_grad=True)
batch_augments = [
    dict(type='BatchFixedSizePad', size=image_size, pad_mask=True)
]
model = dict(
    data_preprocessor=dict(
        # timm's ImageNet statistics (RGB) equal mmdet's defaults.
        mean=[123.675, 116.28, 103.53],
        std=[58.395, 57.12, 57.375],
        bgr_to_rgb=True,
        pad_size_divisor=32,
        batch_augments=batch_augments),
    backbone=dict(
        _delete_=True,
        type='TimmLambdaResNet',  # timm_lambda_mmdet/backbone.py
        model_name='lambdaresnet101',  # set by each model config
        out_indices=(0, 1, 2, 3),  # c2..c5, strides 4/8/16/32
        frozen_stages=-1,
        norm_cfg=norm_cfg,
        norm_eval=False,
        with_cp=False,
        # trained from scratch, as in the paper (checkpoint=None); a timm ImageNet checkpoint:
        # model=dict(backbone=dict(init_cfg=dict(type='Pretrained', checkpoint=PATH))) in a child config,
        # or --cfg-options model.backbone.init_cfg.checkpoint=PATH
        init_cfg=dict(type='Pretrained', checkpoint=None)),
    neck=dict(in_channels=[256, 512, 1024, 2048], norm_cfg=norm_cfg),
    roi_head=dict(
        bbox_head=dict(norm_cfg=norm_cfg), mask_head=dict(norm_cfg=norm_cfg)))

dataset_type = 'CheckedCocoDataset'
data_root = 'data/coco/'
backend_args = None
train_pipeline = [
    dict(type='LoadImageFromFile', backend_args=backend_args),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(
        type='RandomResize',
        scale=image_size,
        ratio_range=(0.1, 2.0),
        keep_ratio=True),
    dict(
        type='RandomCrop',
        crop_type='absolute_range',
        crop_size=image_size,
        recompute_bbox=True,
        allow_negative_crop=True),
    dict(type='FilterAnnotations', min_gt_bbox_wh=(1e-2, 1e-2)),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile', backend_args=backend_args),
    dict(type='Resize', scale=image_size, keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(
        type='PackDetInputs',
        meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape',
                   'scale_factor'))
]
train_dataloader = dict(
    batch_size=2,  # per GPU; total batch = GPUs x 2 (paper: 256)
    num_workers=2,
    persistent_workers=True,
    sampler=dict(_delete_=True, type='InfiniteSampler', shuffle=True),
    dataset=dict(
        _delete_=True,
        type=dataset_type,
        data_root=data_root,
        ann_file='annotations/instances_train2017.json',
        data_prefix=dict(img='train2017/'),
        filter_cfg=dict(filter_empty_gt=True, min_size=32),
        pipeline=train_pipeline,
        backend_args=backend_args))
val_dataloader = dict(
    dataset=dict(
        type=dataset_type,
        data_root=data_root,
        ann_file='annotations/instances_val2017.json',
        data_prefix=dict(img='val2017/'),
        pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(
    type='CocoMetric',
    ann_file=data_root + 'annotations/instances_val2017.json',
    metric=['bbox', 'segm'])
test_evaluator = val_evaluator

max_iters = 130000
train_cfg = dict(
    _delete_=True,
    type='IterBasedTrainLoop',
    max_iters=max_iters,
    val_interval=10000)
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='SGD', lr=0.32, momentum=0.9, weight_decay=4e-5))
param_scheduler = [
    dict(
        type='LinearLR',
        start_factor=1e-3,
        by_epoch=False,
        begin=0,
        end=1000),
    dict(
        type='MultiStepLR',
        begin=0,
        end=max_iters,
        by_epoch=False,
        milestones=[
            int(max_iters * 0.9),
            int(max_iters * 0.95),
            int(max_iters * 0.975)
        ],
        gamma=0.1)
]
default_hooks = dict(
    logger=dict(type='LoggerHook', interval=50),
    checkpoint=dict(
        type='CheckpointHook', by_epoch=False, interval=10000,
        max_keep_ckpts=2))
log_processor = dict(by_epoch=False)

# LR 0.32 is for a total batch of 256 (e.g. 128 GPUs x 2); mmengine scales
# it linearly to the actual total batch.
auto_scale_lr = dict(enable=True, base_batch_size=256)

custom_hooks = [dict(type='PreflightHook')]
