# Opt-in CPU variant of mask-rcnn_lambdaresnet101_fpn_syncbn_lsj-130k_coco.py for distributed runs on machines
# without an accelerator (torchrun with the gloo backend), e.g. to try a config before a GPU cluster:
#
#   torchrun --nproc-per-node 2 -m timm_lambda_mmdet train THIS_CONFIG --launcher pytorch
#
# To make any other config CPU-capable, set the same three keys in a config that inherits it:
# * timm_lambda_mmdet.cpu_distributed makes mmengine's `--launcher pytorch` initialise the process group
#   without torch.cuda.set_device when no accelerator exists;
# * CPUCompatibleDDP is MMDistributedDataParallel on GPUs; on CPU it drops device_ids and reverts SyncBN to
#   per-process BatchNorm (torch SyncBN needs GPUs);
# * gloo instead of nccl.
_base_ = './mask-rcnn_lambdaresnet101_fpn_syncbn_lsj-130k_coco.py'

custom_imports = dict(
    imports=['timm_lambda_mmdet', 'timm_lambda_mmdet.runner_checkpoints', 'timm_lambda_mmdet.cpu_distributed'],
    allow_failed_imports=False)
model_wrapper_cfg = dict(
    type='CPUCompatibleDDP',
    broadcast_buffers=False,
    find_unused_parameters=False)
env_cfg = dict(dist_cfg=dict(backend='gloo'))
