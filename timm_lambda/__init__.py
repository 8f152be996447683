"""timm-lambda: LambdaNetworks (Bello, ICLR 2021) for timm.

Importing this package registers the LambdaResNet family in timm's model registry
(``timm.create_model('lambdaresnet101')``).
"""
from ._compat import check_versions as _check_versions

_check_versions()  # first: an old torch/timm gets an error naming what to upgrade, not an AttributeError below

from ._env import check as _check_env  # noqa: E402

_check_env()  # a TIMM_LAMBDA_* variable with an invalid value: an error naming it and its values, here

from .layers import LambdaLayer, MaskedLambdaLayer1d, MultiHeadLambdaLayer, RelativePositionEmbedding  # noqa: E402
from .models import LambdaResNet  # noqa: E402

__version__ = '0.1.0'

__all__ = ['LambdaLayer', 'MaskedLambdaLayer1d', 'MultiHeadLambdaLayer', 'RelativePositionEmbedding', 'LambdaResNet',
           'registered_models']


def registered_models():
    """Names of the models this package registers in timm (entry points defined in timm_lambda.models)."""
    import timm
    return sorted(n for n in timm.list_models()
                  if timm.models.model_entrypoint(n).__module__.startswith('timm_lambda.'))
