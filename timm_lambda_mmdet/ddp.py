"""A DistributedDataParallel wrapper that also works on CPU (gloo).

mmengine's Runner wraps the model as
``MMDistributedDataParallel(module, device_ids=[LOCAL_RANK])``. PyTorch
rejects both ``device_ids`` for a CPU module and ``SyncBatchNorm`` layers in
a CPU module ("SyncBatchNorm layers only work with GPU modules"). The
opt-in CPU config (configs/mmdet/*_cpu-ddp.py) names this wrapper in
``model_wrapper_cfg``; on GPUs it *is*
``MMDistributedDataParallel`` with the same arguments, on CPU it drops
``device_ids`` and reverts SyncBN/MMSyncBN to per-process BatchNorm (with a
warning), so that the same configs run under ``torchrun`` on CPU machines.
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


def _accelerator_available():
    from mmengine.device import (is_mlu_available, is_musa_available,
                                 is_npu_available)
    return (torch.cuda.is_available() or is_mlu_available()
            or is_npu_available() or is_musa_available())


def enable_cpu_process_groups():
    """Let ``--launcher pytorch`` start on machines without GPUs.

    mmengine 0.10.7's ``_init_dist_pytorch`` calls
    ``torch.cuda.set_device(LOCAL_RANK)`` unconditionally, which raises
    "Found no NVIDIA driver" on a CPU-only machine before the process group
    exists. When no accelerator is present we initialise the process group
    without that call; with any accelerator mmengine's function runs
    unchanged. Idempotent.
    """
    from mmengine.dist import utils as dist_utils
    original = dist_utils._init_dist_pytorch
    if getattr(original, '_cpu_ok', False):
        return

    def _init_dist_pytorch(backend, init_backend='torch', **kwargs):
        if _accelerator_available():
            return original(backend, init_backend=init_backend, **kwargs)
        if backend == 'nccl':
            raise RuntimeError(
                "env_cfg.dist_cfg.backend='nccl' needs CUDA GPUs, and none "
                'is available; on CPU run with --cfg-options '
                'env_cfg.dist_cfg.backend=gloo')
        if init_backend != 'torch':
            raise ValueError(f'init_backend={init_backend!r} is not '
                             'supported on CPU, use "torch"')
        torch.distributed.init_process_group(backend=backend, **kwargs)

    _init_dist_pytorch._cpu_ok = True
    dist_utils._init_dist_pytorch = _init_dist_pytorch
