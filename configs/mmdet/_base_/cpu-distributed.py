# Opt-in additions for distributed runs on CPU-only machines (torchrun with
# the gloo backend), e.g. to try a config on a laptop before a GPU cluster:
#
#   _base_ = ['../mask-rcnn_lambdaresnet101_fpn_syncbn_lsj-130k_coco.py',
#             '../_base_/cpu-distributed.py']
#
# * timm_lambda_mmdet.cpu_distributed makes mmengine's `--launcher pytorch`
#   initialise the process group without torch.cuda.set_device when no
#   accelerator exists;
# * CPUCompatibleDDP is MMDistributedDataParallel on GPUs; on CPU it drops
#   device_ids and reverts SyncBN to per-process BatchNorm (torch SyncBN
#   needs GPUs);
# * gloo instead of nccl.
custom_imports = dict(
    imports=['timm_lambda_mmdet', 'timm_lambda_mmdet.cpu_distributed'],
    allow_failed_imports=False)
model_wrapper_cfg = dict(
    type='CPUCompatibleDDP',
    broadcast_buffers=False,
    find_unused_parameters=False)
env_cfg = dict(dist_cfg=dict(backend='gloo'))
