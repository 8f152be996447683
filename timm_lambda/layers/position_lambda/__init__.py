"""Position lambdas applied to the queries: ``y_n^h = (lambda^p_n)^T q_n^h`` (LambdaNetworks eq. 1-2, section 3.3).

``y_n^h = sum_{u, m} (q_n^h . R[m - n, u]) v_{m, u}`` (``E_nm = R[m - n]``, |u| summed, appendix C.4) in one of the
forms of :data:`POSITION_IMPLS` (docs/lambda_layer.md compares them). This module dispatches: which form
(:func:`choose_impl`), and which execution (:mod:`.execution`).
"""
from typing import List, Optional

from timm.layers import register_notrace_function
from torch import Tensor

from .. import pooling  # a module, not its name: pooling imports .execution from this package
from ..relative_embedding import table_for_input
from .execution import size_independent, use_custom_ops
from .layout import dense, tiled
from .plain_ops import content_term, conv_form, einsum_form, tile

__all__ = ['POSITION_IMPLS', 'position_lambdas', 'content_term', 'choose_impl']

POSITION_IMPLS = ('auto', 'einsum', 'conv', 'dense', 'tiled')


def choose_impl(impl: str, height: int, width: int, table_h: int, table_w: int, global_scope: bool) -> str:
    """The form ``impl`` resolves to for an ``height x width`` input and a ``table_h x table_w`` table (``'auto'``).

    Dense computes ``|n|^2`` (query, context) pairs, tiled ``n_pad x K_h K_w`` (queries padded to whole 8x8 blocks,
    each against its scope: the CPU kernel) at about a quarter of the cost per pair plus a per-query overhead worth
    32 pairs: dense while ``4 |n|^2 <= n_pad (K_h K_w + 32)`` (measured: docs/lambda_layer.md, "The impl='auto'
    rule")."""
    if impl != 'auto':
        return impl
    if global_scope:
        return 'dense'
    if size_independent():
        return 'tiled'
    t = tile()
    padded = ((height + t - 1) // t) * ((width + t - 1) // t) * t * t
    return 'dense' if 4 * (height * width) ** 2 <= padded * (table_h * table_w + 32) else 'tiled'


def position_lambdas(q: Tensor, v: Tensor, table: Tensor, height: int, width: int, impl: str,
                     global_scope: bool, stride: int = 1, count_include_pad: bool = False,
                     table_size: Optional[List[int]] = None, content: Optional[Tensor] = None) -> Tensor:
    """``y_n^h = (lambda^p_n)^T q_n^h`` for every query: ``q [B, h, k, n], v [B, u, V, n] -> [B, h V, H, W]``
    (possibly a strided view); ``table``: the relative embedding ``[k, u, R_h, R_w]``; ``impl``: one of
    :data:`POSITION_IMPLS`. ``stride=2``: the result average-pooled (3x3, stride 2, padding 1; ``count_include_pad``
    as ``nn.AvgPool2d``), ``[B, h V, ceil(H/2), ceil(W/2)]``. ``table_size``: the table's ``[R_h, R_w]`` as Python
    ints (see :func:`block_embedding`). ``content``: a content lambda ``[B, k, V]`` whose term (:func:`content_term`)
    is added: inside the tiled operator's accumulators where it runs at stride 1 (no pass of its own over the
    output), else by :func:`content_term`.
    """
    impl = choose_impl(impl, height, width, table.shape[-2], table.shape[-1], global_scope)
    custom_ops = (impl == 'dense' or impl == 'tiled') and use_custom_ops()
    cut = table_for_input(table, height, width, global_scope)
    pooled = False  # the tiled operator computes a stride-2 layer at the output resolution
    if impl == 'tiled' and custom_ops:
        # at stride 2 the operator's queries are 3x3 patches (9 |k| deep): lambda^c on the pooled queries costs 9x less
        fused = stride == 1
        y = tiled(q, v, cut, height, width, stride, count_include_pad, True, None if global_scope else table_size,
                  content if fused else None)
        if fused:
            return y
        pooled = True
    elif impl == 'tiled':
        # plain ops compute the full map and pool it: the pooled contraction's logits matmul (9 |k| deep, on small
        # per-query GEMMs) costs more in onnxruntime than the 4x larger full-resolution one plus AveragePool
        y = tiled(q, v, cut, height, width, 1, count_include_pad, False, None if global_scope else table_size)
    elif impl == 'dense':
        y = dense(q, v, cut, height, width, not global_scope, custom_ops)
    elif impl == 'einsum' or impl == 'conv':
        y = einsum_form(q, v, cut, height, width, not global_scope) if impl == 'einsum' else \
            conv_form(q, v, cut, height, width)  # [B, h, V, n]
        y = y.reshape(y.shape[0], y.shape[1] * y.shape[2], height, width)
    else:
        raise ValueError("impl must be one of 'auto', 'einsum', 'conv', 'dense', 'tiled', got '" + impl + "'")
    if stride == 2 and not pooled:
        y = pooling.avg_pool_3x3_s2(y, count_include_pad)
    # the contiguous term first: the sum takes its layout (y may be a permuted view), which the reshapes after the
    # layer rely on (a permuted sum made torch.export guard on sizes)
    return y if content is None else content_term(content, q, height, width, stride, count_include_pad) + y


# An FX leaf (its Python size logic runs at call time) for timm's feature extraction; modules that call it also declare
# torch.fx.wrap('position_lambdas') (it patches the caller's global name) so that torch.fx.symbolic_trace works too.
register_notrace_function(position_lambdas)
