"""Lambda layer family (LambdaNetworks, Bello, ICLR 2021)."""
from .relative_embedding import RelativePositionEmbedding
from .position_lambda import POSITION_IMPLS, position_lambdas
from .lambda_layer import LambdaLayer, KEY_NORMS
from .masked_lambda import MaskedLambdaLayer1d
from .multihead_lambda import MultiHeadLambdaLayer
from .relative_attention import AxialSelfAttention2d, LocalSelfAttention2d, RelPosSelfAttention2d
from .attention_augmented import AugmentedConv2d

__all__ = ['RelativePositionEmbedding', 'LambdaLayer', 'MaskedLambdaLayer1d', 'MultiHeadLambdaLayer',
           'POSITION_IMPLS', 'position_lambdas', 'KEY_NORMS',
           'AugmentedConv2d', 'RelPosSelfAttention2d', 'AxialSelfAttention2d', 'LocalSelfAttention2d']
