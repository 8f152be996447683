# Mixed-precision (AmpOptimWrapper, dynamic loss scale) variant of
# mask-rcnn_resnetrs101_fpn_syncbn_lsj-130k_coco.py; needs a GPU.
_base_ = './mask-rcnn_resnetrs101_fpn_syncbn_lsj-130k_coco.py'

optim_wrapper = dict(type='AmpOptimWrapper')
