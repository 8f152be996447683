"""The dense and tiled forms around their contractions: ``q [B, h, k, n]``, ``v [B, u, V, n]`` into the operands
of :mod:`.plain_ops` / :mod:`.custom_ops` (``custom_ops=True``) and the result back to ``[B, h V, H_out, W_out]``
(a strided view where that saves a copy).
"""
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..relative_embedding import dense_embedding, dense_embedding_cached
from .custom_ops import dense_op, tiled_op
from .execution import contiguous, is_exporting
from .plain_ops import dense_plain, tiled_plain

__all__ = ['tile', 'dense', 'tiled']


def tile() -> int:
    """Query block side of the tiled form: 8, the tile of the committed sweeps (a function: TorchScript reads no
    module-level ints)."""
    return 8


def dense(q: Tensor, v: Tensor, table: Tensor, height: int, width: int, masked: bool, custom_ops: bool) -> Tensor:
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
    ``out[(d, k), u, e] = table[k, u, e - d]`` (zero outside)."""
    return torch.cat([F.pad(table, [d % 3, 2 - d % 3, d // 3, 2 - d // 3]) for d in range(9)], 0)  # d = (dy, dx)


def tiled(q: Tensor, v: Tensor, table: Tensor, height: int, width: int, stride: int, count_include_pad: bool,
          custom_ops: bool, table_size: Optional[List[int]] = None) -> Tensor:
    """The tiled form (:func:`.plain_ops.tiled_plain`): ``[B, h V, H_out, W_out]``. ``table``: cut to the input
    (:func:`table_for_input`); ``table_size``: its ``[K_h, K_w]`` as Python ints where fixed (a local scope).

    ``stride == 2`` (3x3 average pooling, stride 2, padding 1 after the layer, appendix F.2) is computed at the output
    resolution: pooling is linear, so output ``o``'s logits are the sum of those of inputs ``2 o - 1 .. 2 o + 1``, one
    GEMM of the queries' 3x3 patches ``(d, k)`` against the nine shifted tables, 4x fewer rows than the full map; the
    window of the next output starts two input positions further (``step = 2``).
    """
    b, h, k, n = q.shape
    u, dv = v.shape[1], v.shape[2]
    kh, kw = (table.shape[-2], table.shape[-1]) if table_size is None else (table_size[0], table_size[1])
    t, step = tile() // stride, stride  # stride 2: 4x4 output blocks (8x8 inputs)
    ho, wo = (height + step - 1) // step, (width + step - 1) // step
    blocks_y, blocks_x = (ho + t - 1) // t, (wo + t - 1) // t
    if not torch.jit.is_scripting() and is_exporting():
        # torch.export (2.14) guards on a block count of 1 and would specialise the export to inputs with the same
        # 'one block or more' answer in every layer: at least 2 blocks (the extra one all padding, same results)
        blocks_y, blocks_x = torch.sym_max(blocks_y, 2), torch.sym_max(blocks_x, 2)
    # pads on the contiguous NCHW maps, then one permute each (a pad of a permuted tensor makes torch.export
    # guard on sizes of 1 and specialise the input size)
    qn = q.reshape(b, h * k, height, width)
    if stride == 1:
        c = k
        qb = F.pad(qn, [0, blocks_x * t - width, 0, blocks_y * t - height])
        qb = qb.reshape(b, h, k, blocks_y, t, blocks_x, t).permute(0, 3, 5, 1, 4, 6, 2)  # [B, by, bx, h, T, T, k]
    else:
        c, table = 9 * k, _pooled_table(table)
        kh, kw = kh + 2, kw + 2  # the pooled table's size
        qp = F.pad(qn, [1, 2 * blocks_x * t - width, 1, 2 * blocks_y * t - height])
        patch: List[Tensor] = []
        for dy in range(3):
            for dx in range(3):
                patch.append(qp[:, :, dy:dy + 2 * blocks_y * t:2, dx:dx + 2 * blocks_x * t:2])
        qb = torch.stack(patch, 2).reshape(b, h, k, 9, blocks_y, t, blocks_x, t)
        qb = qb.permute(0, 4, 6, 1, 5, 7, 3, 2)  # [B, by, bx, h, T, T, 9, k]
    qb = qb.reshape(b * blocks_y * blocks_x, h, t, t, c)
    pad_y, pad_x = (kh - 1) // 2, (kw - 1) // 2  # values before the first query's window
    mh, mw = step * (t - 1) + kh, step * (t - 1) + kw
    vp = F.pad(v.reshape(b, u * dv, height, width), [pad_x, step * t * (blocks_x - 1) + mw - width - pad_x,
                                                    pad_y, step * t * (blocks_y - 1) + mh - height - pad_y])
    vp = vp.permute(0, 2, 3, 1)  # channels last: a window's rows (my, mx, u) are whole channel vectors
    oy, ox = torch.arange(ho, device=q.device), torch.arange(wo, device=q.device)  # also the stride-2 border counts
    if custom_ops:  # back to the output positions: one permute of whole block rows (T contiguous values)
        y = tiled_op(qb, vp, table, step, blocks_y, blocks_x, height, width)  # [G, V, h T T]
        y = y.reshape(b, blocks_y, blocks_x, dv, h, t, t).permute(0, 4, 3, 1, 5, 2, 6)
        y = y.reshape(b, h * dv, blocks_y * t, blocks_x * t)[:, :, :ho, :wo]
    else:  # one gather of whole rows (a permute would make torch.export guard on 'one block')
        y = tiled_plain(qb, vp, table, t, step, blocks_y, blocks_x, None if table_size is None else [kh, kw])
        row = (((oy // t) * blocks_x)[:, None] * (t * t) + (oy % t)[:, None] * t
               + ((ox // t) * (t * t) + ox % t)[None, :])
        # indexed by the 2-D row map: a reshape to [.., ho, wo] would make torch.export guard on ho * wo != 1
        y = y.reshape(b, blocks_y * blocks_x * t * t, h * dv)[:, row].permute(0, 3, 1, 2)
    if stride == 2:
        if count_include_pad:
            y = y / 9
        else:  # average over the in-image inputs of each output
            in_rows = 3 - (oy == 0).to(y.dtype) - (2 * oy + 1 >= height).to(y.dtype)
            in_cols = 3 - (ox == 0).to(y.dtype) - (2 * ox + 1 >= width).to(y.dtype)
            y = y / (in_rows[:, None] * in_cols[None, :])
    return y
