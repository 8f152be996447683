"""Multi-head lambda layer (LambdaNetworks appendix C.3, Fig. 7), for comparison only.

Every head ``h`` has its own keys, values, embeddings and lambdas::

    lambda^h_n = sum_m (softmax_m(k^h)_m + e^h_nm) (v^h_m)^T ,   y_n = concat_h((lambda^h_n)^T q^h_n)

Costs |h| times more than the multi-query layer (Table 6); the paper recommends
:class:`~timm_lambda.layers.LambdaLayer`. Implemented with einsum only (Fig. 7): the per-head
embeddings ``[h, k, n, m]`` are gathered from one relative table of depth ``|h||k|``.
"""
from typing import Callable, Optional, Tuple

import torch
from torch import nn

from .batch_one import reshape_normed
from .checks import check_choice, check_heads, check_input, check_stride, to_int
from .lambda_layer import KEY_NORMS, normalize_keys
from .pooling import downsample_pool
from .projection import Projection
from .relative_embedding import RelativePositionEmbedding, dense_embedding, table_for_input

__all__ = ['MultiHeadLambdaLayer']


class MultiHeadLambdaLayer(nn.Module):
    """Multi-head lambda layer on NCHW tensors. Shapes: ``[B, dim, H, W] -> [B, dim_out, H', W']``.

    Args mirror :class:`~timm_lambda.layers.LambdaLayer` (no intra-depth, einsum only).
    """

    def __init__(self, dim: int, dim_out: Optional[int] = None, dim_k: int = 16, heads: int = 4,
                 scope=23, max_size: Optional[Tuple[int, int]] = None, stride: int = 1,
                 key_norm: str = 'softmax', qv_norm: bool = True,
                 norm_layer: Callable[..., nn.Module] = nn.BatchNorm2d, device=None, dtype=None):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.dim = to_int(dim, 'dim')
        self.dim_out = to_int(self.dim if dim_out is None else dim_out, 'dim_out')
        self.dim_k, self.heads = to_int(dim_k, 'dim_k'), check_heads(heads, self.dim_out)
        stride = check_stride(stride)
        self.dim_v = self.dim_out // self.heads
        self.key_norm = check_choice(key_norm, 'key_norm', KEY_NORMS)
        hk = self.heads * self.dim_k
        self.qkv = Projection(self.dim, 2 * hk + self.dim_out, **dd)
        self.norm_q = norm_layer(hk, **dd) if qv_norm else nn.Identity()
        self.norm_v = norm_layer(self.dim_out, **dd) if qv_norm else nn.Identity()
        self.pos_embedding = RelativePositionEmbedding(hk, 1, scope, max_size, **dd)
        self.global_scope = self.pos_embedding.is_global
        self.pool = downsample_pool(stride)
        with torch.no_grad():
            nn.init.normal_(self.qkv.weight, std=self.dim ** -0.5)
            nn.init.normal_(self.qkv.weight[:hk], std=(self.dim_k * self.dim) ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x, self.dim, 'MultiHeadLambdaLayer')
        B, _, H, W = x.shape
        n, h, k_, v_ = H * W, self.heads, self.dim_k, self.dim_v
        q, k, v = torch.split(self.qkv(x), [h * k_, h * k_, h * v_], dim=1)
        q = reshape_normed(self.norm_q(q), [B, h, k_, n])
        v = reshape_normed(self.norm_v(v), [B, h, v_, n])
        keys = normalize_keys(k.reshape(B, h, k_, n), self.key_norm)
        content_lambda = torch.einsum('bhkm,bhvm->bhkv', keys, v)
        table = table_for_input(self.pos_embedding.weight, H, W, self.global_scope)
        emb = dense_embedding(table, H, W, not self.global_scope).reshape(h, k_, n, n)
        position_lambdas = torch.einsum('hknm,bhvm->bnhkv', emb, v)
        y = torch.einsum('bhkn,bhkv->bhvn', q, content_lambda)
        y = y + torch.einsum('bhkn,bnhkv->bhvn', q, position_lambdas)
        return self.pool(y.reshape(B, h * v_, H, W))
