"""Lambda layer family (LambdaNetworks, Bello, ICLR 2021)."""
from .relative_embedding import RelativePositionEmbedding
from .lambda_layer import LambdaLayer, EINSUM_MAX_EMBEDDING_BYTES, EINSUM_MAX_KERNEL_RATIO, KEY_NORMS
from .masked_lambda import MaskedLambdaLayer1d
from .multihead_lambda import MultiHeadLambdaLayer

__all__ = ['RelativePositionEmbedding', 'LambdaLayer', 'MaskedLambdaLayer1d', 'MultiHeadLambdaLayer',
           'EINSUM_MAX_EMBEDDING_BYTES', 'EINSUM_MAX_KERNEL_RATIO', 'KEY_NORMS']
