"""A DistributedDataParallel wrapper that also works on CPU (gloo).

mmengine's Runner wraps the model as
``MMDistributedDataParallel(module, device_ids=[LOCAL_RANK])``. PyTorch
rejects both ``device_ids`` for a CPU module and ``SyncBatchNorm`` layers in
a CPU module ("SyncBatchNorm layers only work with GPU modules"). The
opt-in CPU config (configs/mmdet/*_cpu-ddp.py) names this wrapper in
``model_wrapper_cfg``; on GPUs it *is*
``MMDistributedDataParallel`` with the same arguments, on CPU it drops
``device_ids`` and reverts SyncBN/MMSyncBN to per-process BatchNorm (with a
warning), so that the same configs run under ``torchrun`` on CPU machines. Registering it changes nothing
else; the process-group fix it needs is :mod:`timm_lambda_mmdet.cpu_distributed` (opt-in).
"""
import logging

import torch
from mmengine.logging import print_log
from mmengine.model import MMDistributedDataParallel, revert_sync_batchnorm
from mmengine.registry import MODEL_WRAPPERS


def _has_sync_bn(module):
    types = [torch.nn.SyncBatchNorm]
    try:
        from mmcv.ops import SyncBatchNorm as MMSyncBN
        types.append(MMSyncBN)
    except ImportError:  # pragma: no cover
        pass
    return any(isinstance(m, tuple(types)) for m in module.modules())


@MODEL_WRAPPERS.register_module()
class CPUCompatibleDDP(MMDistributedDataParallel):
    """``MMDistributedDataParallel`` that falls back gracefully on CPU."""

    def __init__(self, module, device_ids=None, **kwargs):
        devices = {p.device.type for p in module.parameters()}
        if devices == {'cpu'}:
            device_ids = None
            if _has_sync_bn(module):
                print_log(
                    'CPUCompatibleDDP: PyTorch SyncBatchNorm needs GPUs; '
                    'reverting SyncBN/MMSyncBN to BatchNorm with '
                    'per-process statistics for this CPU run.',
                    logger='current',
                    level=logging.WARNING)
                module = revert_sync_batchnorm(module)
        super().__init__(module=module, device_ids=device_ids, **kwargs)
