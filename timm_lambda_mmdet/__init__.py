"""MMDetection 3.x plugin of timm-lambda (LambdaNetworks, Bello 2021).

Importing it (configs do so through ``custom_imports``) registers:

* ``TimmLambdaResNet`` in mmdet's MODELS: LambdaResNet / ResNet-RS backbones built by timm, c2..c5 for an FPN;
* ``CheckedCocoDataset`` in DATASETS: mmdet's CocoDataset with errors that name the file and the problem;
* ``PreflightHook`` in HOOKS: refuses checkpoints whose keys do not match the model and unwritable outputs;
* ``CPUCompatibleDDP`` in MODEL_WRAPPERS, used only by the opt-in CPU config (``configs/mmdet/
  *_cpu-ddp.py``, which also imports :mod:`timm_lambda_mmdet.cpu_distributed`).

It changes nothing in torch or mmengine beyond those registries. Process-wide changes are opt-in modules a
config lists in ``custom_imports``: :mod:`timm_lambda_mmdet.runner_checkpoints` (torch's ``weights_only``
allow-list for mmengine Runner checkpoints: resume / test with torch >= 2.6; every config of this project
imports it) and :mod:`timm_lambda_mmdet.cpu_distributed` (process groups without an accelerator).
"""
_MISSING = []
for _mod in ('mmengine', 'mmcv', 'mmdet'):
    try:
        __import__(_mod)
    except ImportError as _e:  # noqa: PERF203
        _MISSING.append(f'{_mod} ({_e})')
if _MISSING:
    raise ImportError(
        'timm_lambda_mmdet needs MMDetection 3.x and its dependencies, missing: '
        + ', '.join(_MISSING)
        + '. Install them with: pip install "timm-lambda[det]"')
del _MISSING, _mod

from .backbone import TimmLambdaResNet, norm_layer_from_cfg  # noqa: E402
from .checkpoint_compat import register_safe_globals  # noqa: E402
from .datasets import CheckedCocoDataset  # noqa: E402
from .ddp import CPUCompatibleDDP  # noqa: E402
from .hooks import PreflightHook  # noqa: E402

__all__ = ['TimmLambdaResNet', 'CheckedCocoDataset', 'PreflightHook', 'CPUCompatibleDDP',
           'norm_layer_from_cfg', 'register_safe_globals']
