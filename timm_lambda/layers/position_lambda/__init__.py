"""Position lambdas applied to the queries: ``y_n^h = (lambda^p_n)^T q_n^h`` (LambdaNetworks eq. 1-2, section 3.3).

``y_n^h = sum_{u, m} (q_n^h . R[m - n, u]) v_{m, u}`` (``E_nm = R[m - n]``, |u| summed, appendix C.4) in one of the
forms of :data:`FORMS` (docs/lambda_layer.md compares them), run by the backend that the table of :mod:`.backends`
chooses (:func:`set_backend` overrides it, :func:`served_backends` says which ran). The dense and tiled forms take
their operands here: ``q [B, h, k, n]``, ``v [B, u, V, n]`` into those of :mod:`.plain_ops` or :mod:`.custom_ops` and
the result back to ``[B, h V, H_out, W_out]`` (a strided view where that saves a copy).
"""
import functools
from typing import List, Optional

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function
from torch import Tensor

from .. import pooling  # a module, not its name: pooling imports .execution from this package
from ..relative_embedding import dense_embedding, dense_embedding_cached, table_for_input
from .backends import BACKENDS, FORMS, choose_form, dispatch, get_backend, served_backends, set_backend
from .custom_ops import dense_op, tiled_op
from .execution import contiguous, is_exporting
from .plain_ops import content_term, conv_form, dense_plain, einsum_form, tile, tiled_plain, to_blocks

__all__ = ['POSITION_IMPLS', 'FORMS', 'BACKENDS', 'position_lambdas', 'content_term', 'choose_form',
           'set_backend', 'get_backend', 'served_backends']

POSITION_IMPLS = FORMS  # the layer's ``impl`` argument: a form or 'auto'


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
    impl, custom_ops = dispatch(impl, q, height, width, table.shape[-2], table.shape[-1], global_scope)
    cut = table_for_input(table, height, width, global_scope)
    pooled = False  # the tiled operator computes a stride-2 layer at the output resolution
    if impl == 'tiled' and custom_ops:
        # at stride 2 the operator's queries are 3x3 patches (9 |k| deep): lambda^c on the pooled queries costs 9x less
        fused = stride == 1
        y = _tiled(q, v, cut, height, width, stride, count_include_pad, True, None if global_scope else table_size,
                  content if fused else None)
        if fused:
            return y
        pooled = True
    elif impl == 'tiled':
        # plain ops compute the full map and pool it: the pooled contraction's logits matmul (9 |k| deep, on small
        # per-query GEMMs) costs more in onnxruntime than the 4x larger full-resolution one plus AveragePool
        y = _tiled(q, v, cut, height, width, 1, count_include_pad, False, None if global_scope else table_size)
    elif impl == 'dense':
        y = _dense(q, v, cut, height, width, not global_scope, custom_ops)
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


def _dense(q: Tensor, v: Tensor, table: Tensor, height: int, width: int, masked: bool, custom_ops: bool) -> Tensor:
    """The dense form: ``[B, h V, H, W]``. ``table``: cut to the input (:func:`table_for_input`); ``masked``: a
    local scope (:func:`dense_embedding`)."""
    b, h, k, n = q.shape
    u, dv = v.shape[1], v.shape[2]
    if custom_ops:
        emb = dense_embedding_cached(table, height, width, masked).permute(2, 0, 1, 3)  # [n, k, u, m]
        y = dense_op(q.permute(3, 0, 1, 2).reshape(n, b * h, k), v.transpose(2, 3).reshape(b, u * n, dv),
                     emb.reshape(n, k, u * n), h)
    else:  # the same by copies and views: a reshape of a permuted view makes torch.export guard on n != 1, B != 1
        # (the operator above keeps reshape: its backward saves these views, not copies)
        emb = dense_embedding(table, height, width, masked).permute(2, 0, 1, 3)
        y = dense_plain(contiguous(q.permute(3, 0, 1, 2)).view(n, b * h, k),
                        contiguous(v.transpose(2, 3)).view(b, u * n, dv), contiguous(emb).view(n, k, u * n), h)
    return y.reshape(b, height, width, h * dv).permute(0, 3, 1, 2)


def _pooled_table(table: Tensor) -> Tensor:
    """The nine shifted tables of a 3x3 average pool: ``[9 k, u, K_h + 2, K_w + 2]``, rows ``(dy, dx, k)``,
    ``out[(d, k), u, e] = table[k, u, e - d]`` (zero outside): windows of the table padded by 2 (window ``2 - d``),
    by one pad, one flip and one copy (a launch each: the nine pads and their concatenation were 10, and 18 in the
    backward)."""
    k, u, kh, kw = table.shape[0], table.shape[1], table.shape[2], table.shape[3]
    padded = F.pad(table, [2, 2, 2, 2])  # [k, u, K_h + 4, K_w + 4]
    windows = padded.unfold(2, kh + 2, 1).unfold(3, kw + 2, 1)  # [k, u, 3 (2 - dy), 3 (2 - dx), K_h + 2, K_w + 2]
    return windows.flip([2, 3]).permute(2, 3, 0, 1, 4, 5).reshape(9 * k, u, kh + 2, kw + 2)


def _query_patches(q: Tensor, height: int, width: int) -> Tensor:
    """The 3x3 patches of the queries at the stride-2 output positions: ``q [B, h, k, H W]`` ->
    ``[B, h, 9 k, Ho, Wo]``, channels ``(dy, dx, k)``, patch ``(dy, dx)`` of output ``(oy, ox)`` the query at
    ``(2 oy - 1 + dy, 2 ox - 1 + dx)`` (zero outside the map): one pad, windows as views, one copy."""
    b, h, k = q.shape[0], q.shape[1], q.shape[2]
    ho, wo = (height + 1) // 2, (width + 1) // 2
    qp = F.pad(q.reshape(b, h * k, height, width), [1, 2 * wo - width, 1, 2 * ho - height])
    patches = qp.unfold(2, 3, 2).unfold(3, 3, 2)  # [B, h k, Ho, Wo, 3 (dy), 3 (dx)]
    return patches.reshape(b, h, k, ho, wo, 3, 3).permute(0, 1, 5, 6, 2, 3, 4).reshape(b, h, 9 * k, ho, wo)


def _in_image_counts(height: int, width: int, like: Tensor) -> Tensor:
    """``[Ho, Wo]``: the in-image inputs of each stride-2 output's 3x3 window (whole numbers, exact in every dtype), in
    ``like``'s dtype and device: built once a size in eager mode (a dozen small launches fewer a step), in the graph
    where one is recorded."""
    if not torch.jit.is_scripting():
        if not torch.compiler.is_compiling():
            return _in_image_counts_cached(height, width, like.device, like.dtype)
    return _count_in_image(height, width, like.device, like.dtype)


@functools.lru_cache(maxsize=32)
def _in_image_counts_cached(height: int, width: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    with torch.inference_mode(False):  # a later training step saves it for backward (the division's)
        return _count_in_image(height, width, device, dtype)


def _count_in_image(height: int, width: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    ho, wo = (height + 1) // 2, (width + 1) // 2
    oy, ox = torch.arange(ho, device=device), torch.arange(wo, device=device)
    in_rows = 3 - (oy == 0).to(dtype) - (2 * oy + 1 >= height).to(dtype)
    in_cols = 3 - (ox == 0).to(dtype) - (2 * ox + 1 >= width).to(dtype)
    return in_rows[:, None] * in_cols[None, :]


def _tiled(q: Tensor, v: Tensor, table: Tensor, height: int, width: int, stride: int, count_include_pad: bool,
          custom_ops: bool, table_size: Optional[List[int]] = None, content: Optional[Tensor] = None) -> Tensor:
    """The tiled form (:func:`.plain_ops.tiled_plain`): ``[B, h V, H_out, W_out]``. ``table``: cut to the input
    (:func:`table_for_input`); ``table_size``: its ``[K_h, K_w]`` as Python ints where fixed (a local scope).
    ``content``: the content lambda ``[B, k, V]``, applied to the same queries by the custom operator at stride 1;
    the plain ops take none.

    ``stride == 2`` (3x3 average pooling, stride 2, padding 1 after the layer, appendix F.2) is computed at the output
    resolution: pooling is linear, so output ``o``'s logits are the sum of those of inputs ``2 o - 1 .. 2 o + 1``, one
    contraction of the queries' 3x3 patches ``(d, k)`` (:func:`_query_patches`) with the nine shifted tables, 4x
    fewer queries than the full map; the scope of the next output starts two input positions further (``step = 2``).
    The custom operator takes the layer's maps as they are; the plain ops work on query blocks (:func:`to_blocks`).
    """
    b, h, k, n = q.shape
    u, dv = v.shape[1], v.shape[2]
    kh, kw = (table.shape[-2], table.shape[-1]) if table_size is None else (table_size[0], table_size[1])
    step = stride
    ho, wo = (height + step - 1) // step, (width + step - 1) // step
    if stride == 1:
        queries = q.reshape(b, h, k, height, width)
    else:
        queries, table = _query_patches(q, height, width), _pooled_table(table)
        kh, kw = kh + 2, kw + 2  # the pooled table's size
    values = v.reshape(b, u * dv, height, width)
    if custom_ops:
        y = tiled_op(queries, values, table, step, content)
    else:
        assert content is None, 'the plain ops take no content lambda'
        t = tile() // stride  # stride 2: 4x4 output blocks (8x8 inputs)
        blocks_y, blocks_x = (ho + t - 1) // t, (wo + t - 1) // t
        if not torch.jit.is_scripting() and is_exporting():
            # torch.export (2.14) guards on a block count of 1 and would specialise the export to inputs with the same
            # 'one block or more' answer in every layer: at least 2 blocks (the extra one all padding, same results)
            # (torch.sym_max of two ints is unsupported in strict export before torch 2.14: max() for static sizes)
            blocks_y = torch.sym_max(blocks_y, 2) if isinstance(blocks_y, torch.SymInt) else max(blocks_y, 2)
            blocks_x = torch.sym_max(blocks_x, 2) if isinstance(blocks_x, torch.SymInt) else max(blocks_x, 2)
        qb, vp = to_blocks(queries, values, kh, kw, t, step, blocks_y, blocks_x)
        oy, ox = torch.arange(ho, device=q.device), torch.arange(wo, device=q.device)
        y = tiled_plain(qb, vp, table, t, step, blocks_y, blocks_x, None if table_size is None else [kh, kw])
        row = (((oy // t) * blocks_x)[:, None] * (t * t) + (oy % t)[:, None] * t
               + ((ox // t) * (t * t) + ox % t)[None, :])
        # one gather of whole rows, indexed by the 2-D row map (a permute would make torch.export guard on 'one
        # block', a reshape to [.., ho, wo] on ho * wo != 1)
        y = y.reshape(b, blocks_y * blocks_x * t * t, h * dv)[:, row].permute(0, 3, 1, 2)
    if stride == 2:
        # average over the 9 window positions, or over the in-image ones
        y = y / 9 if count_include_pad else y / _in_image_counts(height, width, y)
    return y


# An FX leaf (its Python size logic runs at call time) for timm's feature extraction; modules that call it also declare
# torch.fx.wrap('position_lambdas') (it patches the caller's global name) so that torch.fx.symbolic_trace works too.
register_notrace_function(position_lambdas)
