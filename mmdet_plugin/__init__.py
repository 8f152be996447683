"""MMDetection 3.x plugin for timm-lambda (LambdaNetworks, Bello 2021).

Importing it (configs do so through ``custom_imports``) registers:

* ``TimmLambdaResNet`` in mmdet's MODELS: LambdaResNet / ResNet-RS (with or
  without SE) backbones built by timm, returning c2..c5 for an FPN;
* ``CPUCompatibleDDP`` in mmengine's MODEL_WRAPPERS: DDP that also runs on
  CPU (gloo) processes; mmengine's ``--launcher pytorch`` set-up is made to
  skip ``torch.cuda.set_device`` when no accelerator exists;
* torch ``weights_only`` allow-list entries for mmengine Runner checkpoints
  (resume / test with torch >= 2.6).
"""
_MISSING = []
for _mod in ('mmengine', 'mmcv', 'mmdet'):
    try:
        __import__(_mod)
    except ImportError as _e:  # noqa: PERF203
        _MISSING.append(f'{_mod} ({_e})')
if _MISSING:
    raise ImportError(
        'mmdet_plugin needs MMDetection 3.x and its dependencies, missing: '
        + ', '.join(_MISSING)
        + '. Install them with: pip install "timm-lambda[det]"')
del _MISSING, _mod

from .backbone import TimmLambdaResNet, load_timm_checkpoint  # noqa: E402
from .checkpoint_compat import register_safe_globals  # noqa: E402
from .ddp import CPUCompatibleDDP, enable_cpu_process_groups  # noqa: E402

register_safe_globals()
enable_cpu_process_groups()

__all__ = ['TimmLambdaResNet', 'CPUCompatibleDDP', 'load_timm_checkpoint',
           'register_safe_globals']
