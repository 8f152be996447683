"""The multi-query lambda layer for 2-D inputs (LambdaNetworks, sections 3.1-3.4, appendix C).

For every query position ``n`` the context is summarised into a linear function
(equation 1)::

    lambda_n = sum_m (softmax_m(k)_m + e_nm) v_m^T   = lambda^c + lambda^p_n   in R^{|k| x |v|}

which is applied to ``|h|`` queries (equation 2, section 3.2)::

    y_n = concat_h(lambda_n^T q_n^h)                                          in R^{|h||v|}

Position lambdas use translation-equivariant relative embeddings (section 3.3, see
:mod:`timm_lambda.layers.relative_embedding`) and are computed by one of two implementations
over the same parameters:

* ``'einsum'``: gathers the ``[|k|, |u|, |n|, |m|]`` embedding tensor, zero outside the scope
  (Fig. 3 / Fig. 5). Memory grows with ``|n| |m|`` (not with the batch).
* ``'conv'``: the lambda convolution (section 3.4, appendix C.1), a 3-D convolution that treats
  the value depth as an extra spatial axis; it never materialises the ``n x m`` tensor.

Intra-depth ``|u|`` (appendix C.4, Fig. 8) adds a dimension to keys, embeddings and values that
is summed over when building lambdas.
"""
from typing import Optional, Tuple

import torch
from torch import nn
import torch.nn.functional as F

from .relative_embedding import RelativePositionEmbedding, check_scope

__all__ = ['LambdaLayer', 'EINSUM_MAX_EMBEDDING_BYTES', 'EINSUM_MAX_KERNEL_RATIO', 'normalize_keys', 'KEY_NORMS']

KEY_NORMS = ('softmax', 'l2', 'none')
IMPLS = ('auto', 'einsum', 'conv')

# impl='auto' rule, from tools/benchmark_lambda_layer.py (docs/lambda_layer_benchmark.md): einsum costs
# ~|n|^2 per (k, u, v), the lambda convolution ~|n| * kh * kw (the kernel actually used,
# min(scope, 2H - 1) x min(scope, 2W - 1)); measured CPU crossovers sit at |n| ~ 2-3 kh kw. Use einsum
# while |n| <= EINSUM_MAX_KERNEL_RATIO * kh * kw and the gathered embedding tensor (|k| |u| |n| |m|
# float32 values) stays at or below EINSUM_MAX_EMBEDDING_BYTES (a memory cap); the convolution otherwise.
EINSUM_MAX_KERNEL_RATIO = 2
EINSUM_MAX_EMBEDDING_BYTES = 32 * 2 ** 20


def normalize_keys(keys: torch.Tensor, key_norm: str, dim: int = -1) -> torch.Tensor:
    """Normalise keys over the context positions ``dim`` (Table 11)."""
    if key_norm == 'softmax':
        return keys.softmax(dim=dim)
    if key_norm == 'l2':
        return F.normalize(keys, dim=dim)
    return keys


def _check_int(value, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f'{name} must be an int >= {low}, got {value!r}')
    return value


def _check_choice(value, name: str, choices) -> str:
    if value not in choices:
        raise ValueError(f'{name} must be one of {choices}, got {value!r}')
    return value


class LambdaLayer(nn.Module):
    """Multi-query lambda layer, a drop-in for a ``k x k`` convolution on NCHW tensors.

    Args:
        dim: input channels |d|.
        dim_out: output channels (default ``dim``); |v| = dim_out / heads.
        dim_k: query/key depth |k| (default 16).
        heads: number of queries |h| (default 4).
        dim_u: intra-depth |u| (default 1, appendix C.4).
        scope: local position scope (odd int or (h, w), default 23 for 23x23) or 'global'.
        max_size: (H, W) of the largest input, required for ``scope='global'``.
        stride: 1, or 2 for 3x3 average pooling with stride 2 after the layer (appendix F.2); padding 1
            as timm's strided 3x3 convs, borders averaged over in-image positions only (as TF 'SAME').
        content: use the content lambda (Table 9).
        position: use the position lambdas (Table 9).
        key_norm: 'softmax' (default), 'l2' or 'none': normalisation of the keys over context
            positions (Table 11).
        qv_norm: batch norm on queries and values (default True, section 3.1 "Normalization").
        impl: 'auto', 'einsum' or 'conv' implementation of the position lambdas.
        pos_embedding: a :class:`RelativePositionEmbedding` to share between layers (Table 4);
            it must have the same |k|, |u| and scope. The first layer given it registers it
            (owns it); later layers reference it without registering, so it is counted and
            saved once. Keep the owning layer in the model.

    Shapes: input ``[B, dim, H, W]``, output ``[B, dim_out, ceil(H/stride), ceil(W/stride)]``.
    """

    def __init__(
            self,
            dim: int,
            dim_out: Optional[int] = None,
            dim_k: int = 16,
            heads: int = 4,
            dim_u: int = 1,
            scope=23,
            max_size: Optional[Tuple[int, int]] = None,
            stride: int = 1,
            content: bool = True,
            position: bool = True,
            key_norm: str = 'softmax',
            qv_norm: bool = True,
            impl: str = 'auto',
            pos_embedding: Optional[RelativePositionEmbedding] = None,
    ):
        super().__init__()
        dim = _check_int(dim, 'dim')
        dim_out = _check_int(dim if dim_out is None else dim_out, 'dim_out')
        self.dim, self.dim_out = dim, dim_out
        self.dim_k = _check_int(dim_k, 'dim_k')
        self.heads = _check_int(heads, 'heads')
        self.dim_u = _check_int(dim_u, 'dim_u')
        if dim_out % heads:
            raise ValueError(f'heads={heads} must divide the output width dim_out={dim_out} '
                             f'(|v| = dim_out / heads)')
        self.dim_v = dim_out // heads
        if stride not in (1, 2):
            raise ValueError(f'stride must be 1 or 2, got {stride!r}')
        self.stride = stride
        if not (content or position):
            raise ValueError('at least one of content and position must be True')
        self.content, self.position = bool(content), bool(position)
        self.key_norm = _check_choice(key_norm, 'key_norm', KEY_NORMS)
        self.impl = _check_choice(impl, 'impl', IMPLS)
        scope = check_scope(scope)

        # One 1x1 projection for queries, keys and values (W_Q, W_K, W_V of Table 1).
        self.qkv = nn.Conv2d(dim, heads * dim_k + dim_k * dim_u + self.dim_v * dim_u, 1, bias=False)
        self.norm_q = nn.BatchNorm2d(heads * dim_k) if qv_norm else nn.Identity()
        self.norm_v = nn.BatchNorm2d(self.dim_v * dim_u) if qv_norm else nn.Identity()

        if not self.position:
            if pos_embedding is not None:
                raise ValueError('pos_embedding was given but position=False')
            self.pos_embedding = None
        elif pos_embedding is not None:
            if not isinstance(pos_embedding, RelativePositionEmbedding):
                raise ValueError('pos_embedding must be a RelativePositionEmbedding')
            if (pos_embedding.dim_k, pos_embedding.dim_u) != (dim_k, dim_u):
                raise ValueError(f'pos_embedding has |k|={pos_embedding.dim_k}, |u|={pos_embedding.dim_u}; '
                                 f'the layer needs |k|={dim_k}, |u|={dim_u}')
            if pos_embedding.scope != scope:
                raise ValueError(f'pos_embedding has scope={pos_embedding.scope}, the layer scope={scope}')
            if getattr(pos_embedding, 'has_owner', False):
                # Already registered by another layer: keep an unregistered reference, so the
                # table appears once in parameters() and state_dict() (safetensors rejects
                # aliased tensors, e.g. in timm's save_for_hf).
                self.pos_embedding = None
                self._shared_embedding = (pos_embedding,)
            else:
                pos_embedding.has_owner = True
                self.pos_embedding = pos_embedding
        else:
            self.pos_embedding = RelativePositionEmbedding(dim_k, dim_u, scope, max_size)
        self.scope = scope
        if not hasattr(self, '_shared_embedding'):
            self._shared_embedding = ()
        self.pool = nn.AvgPool2d(3, 2, padding=1, count_include_pad=False) if stride == 2 else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Appendix F.2: W_K, W_V ~ N(0, d^-1/2); W_Q ~ N(0, (|k| d)^-1/2) (std)."""
        w = self.qkv.weight
        nq = self.heads * self.dim_k
        with torch.no_grad():
            nn.init.normal_(w, std=self.dim ** -0.5)
            nn.init.normal_(w[:nq], std=(self.dim_k * self.dim) ** -0.5)

    @property
    def embedding(self) -> Optional[RelativePositionEmbedding]:
        """The position embedding used by this layer (own or shared), None if position=False."""
        return self.pos_embedding if self.pos_embedding is not None or not self._shared_embedding \
            else self._shared_embedding[0]

    def extra_repr(self) -> str:
        return (f'dim={self.dim}, dim_out={self.dim_out}, dim_k={self.dim_k}, heads={self.heads}, '
                f'dim_u={self.dim_u}, dim_v={self.dim_v}, scope={self.scope}, stride={self.stride}, '
                f'content={self.content}, position={self.position}, key_norm={self.key_norm!r}, impl={self.impl!r}')

    def choose_impl(self, height: int, width: int) -> str:
        """The implementation used for a ``height x width`` input (the 'auto' rule)."""
        if self.impl != 'auto':
            return self.impl
        if not self.position:
            return 'einsum'  # no position lambdas: nothing to choose
        n = height * width
        kh, kw = self.embedding.kernel(height, width).shape[-2:]
        fits = self.dim_k * self.dim_u * n * n * 4 <= EINSUM_MAX_EMBEDDING_BYTES
        return 'einsum' if fits and n <= EINSUM_MAX_KERNEL_RATIO * kh * kw else 'conv'

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.dim:
            raise ValueError(f'LambdaLayer expects x of shape [B, {self.dim}, H, W], got {tuple(x.shape)}')
        B, _, H, W = x.shape
        n = H * W
        k_, u_, v_, h_ = self.dim_k, self.dim_u, self.dim_v, self.heads
        q, k, v = torch.split(self.qkv(x), [h_ * k_, k_ * u_, v_ * u_], dim=1)
        q = self.norm_q(q).reshape(B, h_, k_, n)
        v = self.norm_v(v).reshape(B, u_, v_, n)
        out = None
        if self.content:
            keys = normalize_keys(k.reshape(B, u_, k_, n), self.key_norm)
            content_lambda = torch.einsum('bukm,buvm->bkv', keys, v)  # lambda^c, eq. 1
            out = torch.einsum('bhkn,bkv->bhvn', q, content_lambda)  # eq. 2
        if self.position:
            if self.choose_impl(H, W) == 'einsum':
                emb = self.embedding.dense(H, W)  # [k, u, n, m]
                position_lambdas = torch.einsum('kunm,buvm->bnkv', emb, v)  # lambda^p_n, eq. 1
                pos_out = torch.einsum('bhkn,bnkv->bhvn', q, position_lambdas)
            else:
                kern = self.embedding.kernel(H, W)  # [k, u, kh, kw]
                pad = ((kern.shape[-2] - 1) // 2, (kern.shape[-1] - 1) // 2)
                # lambda convolution: [B, u, v, H, W] * [k, u, 1, kh, kw] -> [B, k, v, H, W]
                position_lambdas = F.conv3d(
                    v.reshape(B, u_, v_, H, W), kern.unsqueeze(2).to(v.dtype), padding=(0,) + pad)
                pos_out = torch.einsum('bhkn,bkvn->bhvn', q, position_lambdas.reshape(B, k_, v_, n))
            out = pos_out if out is None else out + pos_out
        return self.pool(out.reshape(B, h_ * v_, H, W))
