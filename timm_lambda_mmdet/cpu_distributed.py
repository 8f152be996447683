"""Opt-in: let mmengine's ``--launcher pytorch`` start process groups on machines without an accelerator.

Importing this module (the CPU config ``configs/mmdet/*_cpu-ddp.py`` lists it in ``custom_imports``) replaces
mmengine's private ``mmengine.dist.utils._init_dist_pytorch`` for the whole process
(:func:`enable_cpu_process_groups`); importing ``timm_lambda_mmdet`` alone changes nothing in mmengine.
"""
import torch

__all__ = ['enable_cpu_process_groups']


def _accelerator_available():
    from mmengine.device import is_mlu_available, is_musa_available, is_npu_available
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


enable_cpu_process_groups()
