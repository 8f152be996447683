"""Position lambdas applied to the queries: ``y_n^h = (lambda^p_n)^T q_n^h`` (LambdaNetworks eq. 1-2, section 3.3).

With ``lambda^p_n = sum_m E_nm v_m^T`` and ``E_nm = R[m - n]`` (relative embeddings, intra-depth |u| summed),
the output of one query head is::

    y_n^h = sum_{u, m} (q_n^h . R[m - n, u]) v_{m, u}                                        in R^{|v|}

Four implementations over the same table ``R`` (all take ``q [B, h, k, n]``, ``v [B, u, V, n]`` with
``n = H * W`` in row-major order and return ``[B, h, V, n]``):

* ``'einsum'``: the lambda form of Fig. 3: gather ``E [k, u, n, m]``, contract it with the values into
  ``lambda^p [B, n, k, V]``, then apply the queries. The reference; memory grows with ``|n|^2``.
* ``'conv'``: the lambda convolution (section 3.4, appendix C.1): ``lambda^p`` by a 3-D convolution with
  the value depth as an extra axis; never builds ``n x m``. Its CPU backward is slow (conv3d with one
  input channel): kept for comparison.
* ``'dense'``: the attention form: logits ``a_nm = q_n . E_nm`` for all pairs, then ``y = a v``. It costs
  ``|h| (|k| + |v|)`` instead of ``|k| |v|`` per (n, m) pair (3-4x less at |k|=16, |h|=4), all batched GEMMs.
* ``'tiled'``: the attention form on ``T x T`` query blocks, each against its own context window (the block
  plus a halo of the scope radius). Translation equivariance makes the block-to-window embedding matrix
  the same for every block (:func:`tile_embedding`), so every contraction is one dense batched GEMM, in the
  forward and in the backward, and memory grows with ``|n|`` times the window, not ``|n|^2``.

``'auto'`` picks ``'dense'`` for inputs up to a window-sized number of positions (and for global scopes)
and ``'tiled'`` above it (see :func:`choose_impl`). Inside ``torch.jit.trace``, a legacy ONNX export or
``torch.export``, ``'auto'`` always takes the size-independent choice (``'tiled'`` for local scopes,
``'dense'`` for global ones), so the traced graph is right at every input size.
"""
from typing import List

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function

from .relative_embedding import dense_embedding, relative_kernel, tile_embedding

__all__ = ['POSITION_IMPLS', 'position_lambdas', 'choose_impl', 'tile_size', 'tile_window']

POSITION_IMPLS = ('auto', 'einsum', 'conv', 'dense', 'tiled')


def tile_size(kernel_h: int, kernel_w: int) -> int:
    """Query block side T for the tiled form: 8 for scopes of 15 and more, 4 below.

    The window holds (T + K - 1)^2 keys for T^2 queries: the block should be large enough for efficient
    GEMMs (|h| T^2 rows) and small enough that the window is not mostly outside any query's scope.
    """
    return 8 if max(kernel_h, kernel_w) >= 15 else 4


def _size_independent() -> bool:
    """True while a size-specialising tracer records the graph (jit.trace, legacy ONNX, torch.export)."""
    if torch.jit.is_scripting():
        return False
    return torch.jit.is_tracing() or _is_exporting()


@torch.jit.ignore
def _is_exporting() -> bool:
    is_exporting = getattr(getattr(torch, 'compiler', None), 'is_exporting', None)
    return bool(is_exporting()) if is_exporting is not None else False


def choose_impl(impl: str, height: int, width: int, window: int, global_scope: bool) -> str:
    """The implementation ``impl`` resolves to for an ``height x width`` input (the ``'auto'`` rule).

    ``window`` is the number of context positions of one query block of the tiled form (:func:`tile_window`).
    """
    if impl != 'auto':
        return impl
    if global_scope:
        return 'dense'
    if _size_independent():
        return 'tiled'
    # the dense form while the input has no more positions than one block's context window
    return 'dense' if height * width <= window else 'tiled'


def tile_window(kernel_h: int, kernel_w: int) -> int:
    """Context positions of one query block of the tiled form: ``(T + K_h - 1)(T + K_w - 1)``."""
    t = tile_size(kernel_h, kernel_w)
    return (t + kernel_h - 1) * (t + kernel_w - 1)


def _einsum(q: torch.Tensor, v: torch.Tensor, kernel: torch.Tensor, height: int, width: int,
            masked: bool) -> torch.Tensor:
    emb = dense_embedding(kernel, height, width, masked).to(v.dtype)  # [k, u, n, m]
    lambdas = torch.einsum('kunm,buvm->bnkv', [emb, v])  # lambda^p_n (eq. 1)
    return torch.einsum('bhkn,bnkv->bhvn', [q, lambdas.to(q.dtype)])  # (lambda^p_n)^T q_n (eq. 2)


def _conv(q: torch.Tensor, v: torch.Tensor, kernel: torch.Tensor, height: int, width: int) -> torch.Tensor:
    b, u, dv, n = v.shape
    k, kh, kw = kernel.shape[0], kernel.shape[-2], kernel.shape[-1]
    # [B, u, V, H, W] * [k, u, 1, kh, kw] -> lambda^p [B, k, V, H, W]; explicit padding: a global kernel's
    # size follows the input, and a tracer records F.pad's amounts but freezes conv3d's padding argument
    vp = F.pad(v.reshape(b, u, dv, height, width), [(kw - 1) // 2, (kw - 1) // 2, (kh - 1) // 2, (kh - 1) // 2])
    lambdas = F.conv3d(vp, kernel.unsqueeze(2).to(v.dtype))
    return torch.einsum('bhkn,bkvn->bhvn', [q, lambdas.reshape(b, k, dv, n).to(q.dtype)])


def _dense(q: torch.Tensor, v: torch.Tensor, kernel: torch.Tensor, height: int, width: int,
           masked: bool) -> torch.Tensor:
    b, h, k, n = q.shape
    u, dv = v.shape[1], v.shape[2]
    emb = dense_embedding(kernel, height, width, masked).to(q.dtype)  # [k, u, n, m]
    logits = torch.einsum('bhkn,kunm->bhnum', [q, emb]).reshape(b, h * n, u * n)
    y = torch.bmm(logits, v.transpose(2, 3).reshape(b, u * n, dv).to(logits.dtype))  # [B, h n, V]
    return y.reshape(b, h, n, dv).transpose(2, 3)


def _tiled(q: torch.Tensor, v: torch.Tensor, kernel: torch.Tensor, height: int, width: int, t: int) -> torch.Tensor:
    b, h, k, n = q.shape
    u, dv = v.shape[1], v.shape[2]
    kh, kw = kernel.shape[-2], kernel.shape[-1]
    ty, tx = (height + t - 1) // t, (width + t - 1) // t  # blocks per axis
    hp, wp = ty * t, tx * t
    mh, mw = t + kh - 1, t + kw - 1  # context window of a block
    emb = tile_embedding(kernel, t).to(q.dtype)  # [k, u, T T, M]
    # queries by block: [B ty tx, T T, h, k]
    qb = F.pad(q.reshape(b, h, k, height, width), [0, wp - width, 0, hp - height])
    qb = qb.reshape(b, h, k, ty, t, tx, t).permute(0, 3, 5, 4, 6, 1, 2).reshape(b * ty * tx, t * t, h, k)
    logits = torch.einsum('tnhk,kunm->thnum', [qb, emb]).reshape(b * ty * tx, h * t * t, u * mh * mw)
    # context windows: [B ty tx, u M, V]
    vp = F.pad(v.reshape(b, u, dv, height, width),
               [(kw - 1) // 2, (kw - 1) // 2 + wp - width, (kh - 1) // 2, (kh - 1) // 2 + hp - height])
    # overlapping windows by index gathers (exportable to ONNX with dynamic sizes, unlike Tensor.unfold)
    rows = (torch.arange(ty, device=v.device)[:, None] * t + torch.arange(mh, device=v.device)).reshape(-1)
    cols = (torch.arange(tx, device=v.device)[:, None] * t + torch.arange(mw, device=v.device)).reshape(-1)
    vw = vp.index_select(3, rows).index_select(4, cols).reshape(b, u, dv, ty, mh, tx, mw)
    vw = vw.permute(0, 3, 5, 1, 4, 6, 2).reshape(b * ty * tx, u * mh * mw, dv).to(logits.dtype)
    y = torch.bmm(logits, vw)  # [B ty tx, h T T, V]
    y = y.reshape(b, ty, tx, h, t, t, dv).permute(0, 3, 6, 1, 4, 2, 5).reshape(b, h, dv, hp, wp)
    return y[:, :, :, :height, :width].reshape(b, h, dv, n)


def position_lambdas(q: torch.Tensor, v: torch.Tensor, table: torch.Tensor, height: int, width: int,
                     impl: str, global_scope: bool, tile: int) -> torch.Tensor:
    """``y_n^h = (lambda^p_n)^T q_n^h`` for every query: ``q [B, h, k, n], v [B, u, V, n] -> [B, h, V, n]``.

    ``table`` is the relative embedding ``[k, u, R_h, R_w]`` (:class:`RelativePositionEmbedding`), ``impl``
    one of :data:`POSITION_IMPLS`, ``tile`` the block side of the tiled form (:func:`tile_size` of the
    table). An FX leaf: its Python size logic runs at call time, not at trace time.
    """
    if global_scope and not torch.jit.is_tracing() and (
            2 * height - 1 > table.shape[-2] or 2 * width - 1 > table.shape[-1]):
        raise ValueError(f'input of {height}x{width} is larger than max_size=({(table.shape[-2] + 1) // 2}, '
                         f'{(table.shape[-1] + 1) // 2}) of the global position embedding; build the layer '
                         f'with a larger max_size (img_size) or use a local scope')
    kernel = relative_kernel(table, height, width, global_scope)
    window = (tile + table.shape[-2] - 1) * (tile + table.shape[-1] - 1)
    impl = choose_impl(impl, height, width, window, global_scope)
    if impl == 'tiled':
        return _tiled(q, v, kernel, height, width, tile)
    if impl == 'dense':
        return _dense(q, v, kernel, height, width, not global_scope)
    if impl == 'conv':
        return _conv(q, v, kernel, height, width)
    if impl == 'einsum':
        return _einsum(q, v, kernel, height, width, not global_scope)
    raise ValueError("impl must be one of 'auto', 'einsum', 'conv', 'dense', 'tiled', got '" + impl + "'")


# An FX leaf for timm's feature extraction; modules that call it also declare torch.fx.wrap('position_lambdas')
# (torch.fx.wrap patches the caller's global name) so that plain torch.fx.symbolic_trace works too.
register_notrace_function(position_lambdas)
