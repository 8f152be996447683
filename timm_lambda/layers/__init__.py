"""Lambda layer family (LambdaNetworks, Bello, ICLR 2021)."""
from .attention_augmented import AugmentedConv2d
from .lambda_layer import KEY_NORMS, LambdaLayer
from .masked_lambda import MaskedLambdaLayer1d
from .multihead_lambda import MultiHeadLambdaLayer
from .position_lambda import (
    BACKENDS,
    FORMS,
    get_backend,
    position_lambdas,
    register_backend,
    served_backends,
    set_backend,
)
from .relative_attention import AxialSelfAttention2d, LocalSelfAttention2d, RelPosSelfAttention2d
from .relative_embedding import RelativePositionEmbedding

__all__ = ['RelativePositionEmbedding', 'LambdaLayer', 'MaskedLambdaLayer1d', 'MultiHeadLambdaLayer',
           'FORMS', 'position_lambdas', 'KEY_NORMS', 'BACKENDS', 'set_backend', 'get_backend', 'served_backends',
           'register_backend',
           'AugmentedConv2d', 'RelPosSelfAttention2d', 'AxialSelfAttention2d', 'LocalSelfAttention2d']
