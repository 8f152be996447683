"""Translation-equivariant relative position embeddings (LambdaNetworks, section 3.3).

One table ``R [|k|, |u|, R_h, R_w]`` indexed by the offset ``m - n`` holds every embedding, ``e_nm = R[m - n]``
(footnote 8), so the same parameters serve every input size: offsets ``[-(r//2), r//2]`` for a local ``r x r``
scope (section 3.4; outside it the embeddings are zero), every offset of the largest input for a global scope.
The table is directly the weight of the lambda convolution (appendix C.1). The functions below turn it into the
embeddings an ``H x W`` input uses, in shape arithmetic only, so a trace made at one size serves every size.
"""
from typing import List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .checks import Size2, check_max_size, check_scope, to_int, to_pair
from .size_cache import SizeCache

__all__ = ['RelativePositionEmbedding', 'table_for_input', 'dense_index', 'dense_embedding', 'dense_embedding_cached',
           'block_embedding', 'block_index']


class RelativePositionEmbedding(nn.Module):
    """Relative position embedding table ``R`` shared by every query position: ``[|k|, |u|, R_h, R_w]``.

    Args:
        dim_k: query/key depth |k|.
        dim_u: intra-depth |u| (appendix C.4).
        scope: odd local scope size (int or (h, w)), or 'global'.
        max_size: (H_max, W_max), required for a global scope: the largest feature map the
            table must cover. A larger input raises an error.

    Passing one instance to several lambda layers shares it (Table 4).
    """

    def __init__(self, dim_k: int = 16, dim_u: int = 1, scope=23, max_size=None, device=None, dtype=None):
        super().__init__()
        self.dim_k, self.dim_u = to_int(dim_k, 'dim_k'), to_int(dim_u, 'dim_u')
        self.scope = check_scope(scope)
        self.is_global = self.scope == 'global'
        if self.is_global:
            if max_size is None:
                raise ValueError("max_size=(H, W) is required when scope='global': the table must "
                                 "cover every relative offset of the largest input")
            self.max_size: Optional[Size2] = to_pair(max_size, 'max_size')
            table_size = (2 * self.max_size[0] - 1, 2 * self.max_size[1] - 1)  # offsets [-(H-1), H-1]
        else:
            self.max_size = None
            table_size = self.scope  # offsets [-(r//2), r//2]
        self.weight = nn.Parameter(torch.empty(self.dim_k, self.dim_u, *table_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Appendix F.2: position embeddings ~ N(0, 1).
        nn.init.normal_(self.weight, std=1.0)

    def extra_repr(self) -> str:
        return f'dim_k={self.dim_k}, dim_u={self.dim_u}, scope={self.scope}, table={tuple(self.weight.shape[2:])}'


def table_for_input(table: torch.Tensor, height: int, width: int, global_scope: bool) -> torch.Tensor:
    """The offsets of ``table`` an ``height x width`` input uses: ``[k, u, K_h, K_w]`` (odd sizes).

    A local table is used whole (offsets beyond the input meet zero padding). A global table is cut to offsets
    ``[-(H-1), H-1] x [-(W-1), W-1]`` by an index gather: an input larger than the table raises a ValueError naming
    ``max_size``, or in a traced graph an index error (a global-scope model checks its input first, in traces too:
    ``timm_lambda.models.lambda_resnet.check_input_size``), never a silently shorter context.
    """
    if not global_scope:
        return table
    ch, cw = (table.shape[-2] - 1) // 2, (table.shape[-1] - 1) // 2
    if not torch.jit.is_tracing():
        check_max_size(height, width, ch + 1, cw + 1)
    iy = torch.arange(2 * height - 1, device=table.device) + (ch - height + 1)
    ix = torch.arange(2 * width - 1, device=table.device) + (cw - width + 1)
    return table.index_select(2, iy).index_select(3, ix)


def dense_index(height: int, width: int, table_h: int, table_w: int, masked: bool,
                device: torch.device) -> torch.Tensor:
    """Gather index of :func:`dense_embedding`: ``[n * m]``, entry ``(n, m)`` the flat table position of the offset
    ``m - n`` (the table centred on offset 0), or ``R_h R_w`` (a zero slot) outside the table when ``masked``."""
    ys, xs = torch.arange(height, device=device), torch.arange(width, device=device)
    dy = ys[None, :] - ys[:, None] + (table_h - 1) // 2  # [n_y, m_y]: table row of the offset m - n
    dx = xs[None, :] - xs[:, None] + (table_w - 1) // 2
    index = dy[:, None, :, None] * table_w + dx[None, :, None, :]
    if masked:
        inside = ((dy >= 0) & (dy < table_h))[:, None, :, None] & ((dx >= 0) & (dx < table_w))[None, :, None, :]
        index = torch.where(inside, index, torch.full_like(index, table_h * table_w))
    return index.reshape(-1)


def dense_embedding(table: torch.Tensor, height: int, width: int, masked: bool = True,
                    index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Embeddings for every (query n, context m) pair: ``[k, u, n, m]``, ``n = m = H * W`` (Fig. 3).

    ``E[:, :, n, m] = table[m - n]``. With ``masked`` (a local scope) offsets outside the table get 0 (the
    mask of section 3.4); without (a global table cut by :func:`table_for_input`) every offset is inside.
    Materialises ``|k||u||n|^2`` values: small inputs only. ``index``: :func:`dense_index`, if already built.
    """
    k, u, th, tw = table.shape
    if index is None:
        index = dense_index(height, width, th, tw, masked, table.device)
    flat = table.reshape(k, u, th * tw)
    if masked:
        flat = F.pad(flat, [0, 1])  # slot R_h R_w: zero embedding outside the scope
    return flat.index_select(2, index).reshape(k, u, height * width, height * width)


# The dense form's gather indices kept (int64, (H W)^2 entries each): at most 64 MiB and 16 sizes in all, none of
# more than 2^22 entries (32 MiB, a 45x45 input); block indices (numpy, per tile and table size): at most 16 MiB
DENSE_INDEX_CACHE = SizeCache(max_bytes=64 << 20, max_entries=16)
DENSE_INDEX_MAX_ENTRIES = 1 << 22
BLOCK_INDEX_CACHE = SizeCache(max_bytes=16 << 20, max_entries=16)


def _dense_index_cached(height: int, width: int, table_h: int, table_w: int, masked: bool,
                        device: torch.device) -> torch.Tensor:
    def build():
        with torch.inference_mode(False):  # a later training step may save it for backward
            return dense_index(height, width, table_h, table_w, masked, device)
    return DENSE_INDEX_CACHE.get((height, width, table_h, table_w, masked, device), build)


@torch.jit.unused
def dense_embedding_cached(table: torch.Tensor, height: int, width: int, masked: bool) -> torch.Tensor:
    """:func:`dense_embedding` with its index built once per input size (kept for inputs up to 45x45, 2^22 entries,
    at most 64 MiB and 16 sizes in all: :data:`DENSE_INDEX_CACHE`): for eager runs. Compiled code builds the index
    in its graph (dynamo does not trace into the cache)."""
    return dense_embedding(table, height, width, masked,
                           dense_index_for(height, width, table.shape[2], table.shape[3], masked, table.device))


@torch.jit.unused
def dense_index_for(height: int, width: int, table_h: int, table_w: int, masked: bool, device: torch.device,
                    traced: Optional[bool] = None) -> torch.Tensor:
    """:func:`dense_index`, kept in :data:`DENSE_INDEX_CACHE` where it may be (not traced, at most 2^22 entries).
    ``traced``: whether torch.compile traces the call (None: asked; an operator's computation never is)."""
    if traced is None:
        traced = torch.compiler.is_compiling()
    if not traced and (height * width) ** 2 <= DENSE_INDEX_MAX_ENTRIES:
        return _dense_index_cached(height, width, table_h, table_w, masked, device)
    return dense_index(height, width, table_h, table_w, masked, device)


def block_index(tile: int, step: int, table_h: int, table_w: int, device: torch.device) -> torch.Tensor:
    """Gather index of :func:`block_embedding`: ``[T*T * M_h * M_w]``, entry ``(qy, qx, my, mx)`` the flat table
    position ``(my - step qy, mx - step qx)``, or ``K_h K_w`` (a zero slot) outside the table."""
    mh, mw = step * (tile - 1) + table_h, step * (tile - 1) + table_w
    q = torch.arange(tile, device=device)
    ey = torch.arange(mh, device=device)[None, :] - step * q[:, None]  # [qy, my]: table row
    ex = torch.arange(mw, device=device)[None, :] - step * q[:, None]  # [qx, mx]: table column
    inside = ((ey >= 0) & (ey < table_h))[:, None, :, None] & ((ex >= 0) & (ex < table_w))[None, :, None, :]
    index = torch.where(inside, ey[:, None, :, None] * table_w + ex[None, :, None, :], table_h * table_w)
    return index.reshape(tile * tile * mh * mw)


def _block_index_array(tile: int, step: int, table_h: int, table_w: int) -> np.ndarray:
    """:func:`block_index` as numpy data, never traced or fake (TorchScript, which has no numpy, uses the torch one);
    kept in :data:`BLOCK_INDEX_CACHE`."""
    return BLOCK_INDEX_CACHE.get((tile, step, table_h, table_w),
                                 lambda: _block_index_numpy(tile, step, table_h, table_w))


def _block_index_numpy(tile: int, step: int, table_h: int, table_w: int) -> np.ndarray:
    mh, mw = step * (tile - 1) + table_h, step * (tile - 1) + table_w
    q = np.arange(tile)
    ey = np.arange(mh)[None, :] - step * q[:, None]
    ex = np.arange(mw)[None, :] - step * q[:, None]
    inside = ((ey >= 0) & (ey < table_h))[:, None, :, None] & ((ex >= 0) & (ex < table_w))[None, :, None, :]
    index = np.where(inside, ey[:, None, :, None] * table_w + ex[None, :, None, :], table_h * table_w)
    return index.reshape(-1).astype(np.int64)


@torch.jit.unused
def _block_index_cached(tile: int, step: int, table_h: int, table_w: int, device: torch.device) -> torch.Tensor:
    """:func:`block_index` computed once per table size: a constant of ``jit.trace`` (made with the trace paused:
    private API, torch._C since torch 1.0, no public one), ``torch.export`` and ONNX, which onnxruntime folds at load
    time (in the graph, a ~20 ms gather per layer at 224 px)."""
    tracing = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        return torch.as_tensor(_block_index_array(tile, step, table_h, table_w), device=device)
    finally:
        torch._C._set_tracing_state(tracing)


def block_embedding(table: torch.Tensor, tile: int, step: int = 1,
                    table_size: Optional[List[int]] = None) -> torch.Tensor:
    """Embeddings between the queries of a ``tile x tile`` block and the block's context window, as the
    right-hand side of one matmul: ``[T*T, c, M_h * M_w * u]`` for a table ``[c, u, K_h, K_w]``, with
    ``M = step (T - 1) + K`` (the block plus a halo of the table radius) and columns in ``(my, mx, u)`` order.

    ``E[(qy, qx), :, (my, mx, u)] = table[:, u, my - step qy, mx - step qx]`` (window coordinates), zero where
    that is outside the table. By translation equivariance (section 3.3) the same matrix serves every block
    of every input. ``table_size``: ``[K_h, K_w]`` as Python ints where the table's size is fixed (a local scope):
    the gather index is then a constant of traces and exports (:func:`_block_index_cached`).
    """
    c, u = table.shape[0], table.shape[1]
    if table_size is not None and not torch.jit.is_scripting():
        kh, kw = table_size[0], table_size[1]
        index = _block_index_cached(tile, step, kh, kw, table.device)
    else:
        kh, kw = table.shape[2], table.shape[3]
        index = block_index(tile, step, kh, kw, table.device)
    mh, mw = step * (tile - 1) + kh, step * (tile - 1) + kw
    flat = F.pad(table.permute(0, 2, 3, 1).reshape(c, kh * kw, u), [0, 0, 0, 1])  # [c, K + 1, u]
    e = flat.index_select(1, index).reshape(c, tile * tile, mh * mw * u)
    return e.transpose(0, 1)
