"""Deprecated name of :mod:`timm_lambda_mmdet` (the MMDetection plugin of timm-lambda), kept so that configs
with ``custom_imports=dict(imports=['mmdet_plugin'])`` and ``import mmdet_plugin`` keep working."""
import warnings

warnings.warn("the 'mmdet_plugin' package was renamed 'timm_lambda_mmdet'; import that instead",
              DeprecationWarning, stacklevel=2)

from timm_lambda_mmdet import *  # noqa: E402,F401,F403
from timm_lambda_mmdet import __all__  # noqa: E402,F401
