# Mask R-CNN + FPN on timm's lambda_resnet50ts with timm's published ImageNet-1k weights (lambda_resnet50ts.a1h_in1k),
# run by this package's lambda layer (lambda_resnet50ts_fast: timm's architecture, timm's outputs,
# docs/timm_weights.md). The frame is the base config's (Table 14: 1024x1024 large-scale jitter, SyncBN in neck and
# heads, 130k iterations at batch 256); the backbone differs as an ImageNet-initialised backbone does in mmdet's own
# configs:
#   * init_cfg: timm's checkpoint (the url of timm's pretrained_cfg), its keys mapped on load
#     (checkpoint_filter_timm_lambda_layers); any lambda_resnet50ts checkpoint of timm's (your own fine-tuned one)
#     loads the same way: --cfg-options model.backbone.init_cfg.checkpoint=PATH;
#   * norm_cfg=None: timm's own norm layers (ByobNet's batch norm + activation modules, the lambda layers' query and
#     value batch norms) with their ImageNet statistics, frozen (norm_eval=True), the stem and the first stage
#     frozen (frozen_stages=1), as mmdet's ImageNet-initialised ResNets. An mmcv norm_cfg does not apply to ByobNet,
#     whose norms are fused with their activation.
_base_ = './_base_/mask-rcnn_timm-fpn_syncbn_lsj-130k_coco.py'

model = dict(
    backbone=dict(
        model_name='lambda_resnet50ts_fast',
        norm_cfg=None,
        norm_eval=True,
        frozen_stages=1,
        init_cfg=dict(
            type='Pretrained',
            checkpoint='https://github.com/rwightman/pytorch-image-models/releases/download/v0.1-attn-weights/'
            'lambda_resnet50ts_a1h_256-b87370f7.pth')))
