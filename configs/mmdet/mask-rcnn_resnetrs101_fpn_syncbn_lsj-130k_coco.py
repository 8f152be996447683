# Table 14 row "ResNet-101 + SE": Mask R-CNN FPN, ResNet-101 + SE (timm ResNet-RS-101) backbone,
# trained from scratch at 1024x1024 (LambdaNetworks appendix F.3).
_base_ = './_base_/mask-rcnn_timm-fpn_syncbn_lsj-130k_coco.py'

model = dict(backbone=dict(model_name='resnetrs101'))
