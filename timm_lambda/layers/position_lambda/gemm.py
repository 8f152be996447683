"""The ``gemm`` backend of the tiled form (:mod:`.backends`): the exact form's arithmetic by batched GEMMs, on any
device and dtype.

Chunks of query blocks (``CPU_CHUNK_ROWS`` logit rows on a CPU; whole images up to ``DEVICE_CHUNK_ELEMENTS`` logits
elsewhere): the compact logits ``q R`` by one GEMM with the small table, written into the band of a reused zero
buffer through a strided view (translation equivariance makes the band the same for every block, section 3.3), then
one batched GEMM with the chunk's windows, each a strided view of the padded values. Every query meets its block's
whole window (``M_h x M_w``, 1.7x the exact form's value multiply-adds at a 23x23 scope and 8x8 blocks).

Layouts are the tiled operator's (:mod:`.custom_ops`): ``q [B, h, c, Ho, Wo]``, ``v [B, u V, H, W]``, ``table [c, u,
K_h, K_w]``, an optional content lambda ``[B, c, V]`` added by a matmul.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .plain_ops import operator_content_grads, operator_content_term, tile, to_blocks

__all__ = ['forward', 'backward', 'CPU_CHUNK_ROWS', 'DEVICE_CHUNK_ELEMENTS']

CPU_CHUNK_ROWS = 512  # logit rows (queries x heads) of one chunk on a CPU: cache-sized (no committed measurement)
DEVICE_CHUNK_ELEMENTS = 1 << 26  # logits of one chunk elsewhere (256 MiB in float32): one chunk per layer


def _windows(vp: Tensor, b: int, images: int, by: int, rows: int, bx: int, cols: int, shift: int, mh: int,
             mw: int, every: int = 1) -> Tensor:
    """Context windows of ``rows x cols`` blocks from block ``(by, bx)`` of images ``b .. b + images - 1`` (every
    ``every``-th block column) as one strided view ``[images, rows, cols, M_h, M_w, C]`` of the contiguous
    ``vp [B, H', W', C]``."""
    _, hv, wv, cv = vp.shape
    offset = vp.storage_offset() + ((b * hv + by * shift) * wv + bx * shift) * cv
    return vp.as_strided((images, rows, cols, mh, mw, cv),
                         (hv * wv * cv, shift * wv * cv, every * shift * cv, wv * cv, cv, 1), offset)


def _band(buf: Tensor, t: int, h: int, u: int, kh: int, kw: int, mw: int, step: int) -> Tensor:
    """The band of block logits ``buf [C, (h qy qx), (my mx u)]`` as a view ``[C, h, qy, qx, u, ky, kx]``:
    entry ``(h, qy, qx, my = step qy + ky, mx = step qx + kx, u)``. One strided view, no index tensor."""
    row = buf.shape[2]
    s_my = mw * u
    return buf.as_strided((buf.shape[0], h, t, t, u, kh, kw),
                          (h * t * t * row, t * t * row, t * row + step * s_my, row + step * u, 1, s_my, u),
                          buf.storage_offset())


def _chunks(batch: int, blocks_y: int, blocks_x: int, per_chunk: int) -> List[Tuple[int, int, int, int, int, int]]:
    """``(first image, images, first block row, block rows, first block column, block columns)`` of each chunk:
    whole images, whole block rows of one image, or a part of one row, so that a chunk's windows are one strided
    view (:func:`_windows`)."""
    per_image = blocks_y * blocks_x
    if per_chunk >= per_image:
        images = per_chunk // per_image
        return [(b, min(images, batch - b), 0, blocks_y, 0, blocks_x) for b in range(0, batch, images)]
    out = []
    for b in range(batch):
        if per_chunk >= blocks_x:
            rows = per_chunk // blocks_x
            out += [(b, 1, by, min(rows, blocks_y - by), 0, blocks_x) for by in range(0, blocks_y, rows)]
        else:
            out += [(b, 1, by, 1, bx, min(per_chunk, blocks_x - bx))
                    for by in range(blocks_y) for bx in range(0, blocks_x, per_chunk)]
    return out


class _TiledPlan:
    """Shapes, chunks and reusable buffers of one tiled call (forward or backward)."""

    def __init__(self, q: Tensor, vp: Tensor, table: Tensor, step: int, blocks_y: int, blocks_x: int):
        self.g, self.h, self.t, _, self.c = q.shape
        self.batch, _, _, self.cv = vp.shape
        _, self.u, self.kh, self.kw = table.shape
        self.dv = self.cv // self.u
        self.step, self.blocks_y, self.blocks_x = step, blocks_y, blocks_x
        self.mh, self.mw = step * (self.t - 1) + self.kh, step * (self.t - 1) + self.kw
        self.rows = self.t * self.t * self.h  # logit rows of a block
        self.cols = self.mh * self.mw * self.u  # logit columns of a block
        if q.device.type == 'cpu':
            per_chunk = max(1, CPU_CHUNK_ROWS // self.rows)
        else:
            per_chunk = max(1, DEVICE_CHUNK_ELEMENTS // (self.rows * self.cols))
        self.chunks = _chunks(self.batch, blocks_y, blocks_x, per_chunk)
        n = min(per_chunk, max(self.g, 1))
        self.logits = vp.new_zeros(n, self.rows, self.cols)  # off-band entries stay zero
        self.windows = vp.new_empty(n, self.mh, self.mw, self.cv)
        self.compact = vp.new_empty(n * self.rows, self.u * self.kh * self.kw)
        self.rm = table.view(self.c, self.u * self.kh * self.kw)

    def block_logits(self, q: Tensor, vp: Tensor, chunk) -> Tuple[int, int, Tensor, Tensor]:
        """Windows and band logits of one chunk: ``(first block, blocks, logits [n, rows, cols],
        windows [n, M u, V])``; the compact logits ``q R`` come from one GEMM with the small table."""
        b, ni, by, nr, bx, nc = chunk
        g0, n = (b * self.blocks_y + by) * self.blocks_x + bx, ni * nr * nc
        windows = self.windows[:n]
        windows.view(ni, nr, nc, self.mh, self.mw, self.cv).copy_(
            _windows(vp, b, ni, by, nr, bx, nc, self.step * self.t, self.mh, self.mw))
        compact = self.compact[:n * self.rows]
        torch.mm(q[g0:g0 + n].view(n * self.rows, self.c), self.rm, out=compact)
        logits = self.logits[:n]
        _band(logits, self.t, self.h, self.u, self.kh, self.kw, self.mw, self.step).copy_(
            compact.view(n, self.h, self.t, self.t, self.u, self.kh, self.kw))
        return g0, n, logits, windows.view(n, self.mh * self.mw * self.u, self.dv)

    def new_value_grad(self, vp: Tensor) -> Tensor:
        """The zeroed padded value gradient: ``[B, H', W', C]`` (as ``vp``) on a CPU, ``[B, C, H', W']`` elsewhere
        (see :meth:`overlap_add`)."""
        b, hv, wv, cv = vp.shape
        return vp.new_zeros(b, hv, wv, cv) if vp.device.type == 'cpu' else vp.new_zeros(b, cv, hv, wv)

    def overlap_add(self, gvp: Tensor, gw: Tensor, chunk) -> None:
        """Add the window gradients ``gw [n, M u, V]`` of ``chunk`` into the padded value gradient ``gvp``
        (:meth:`new_value_grad`) where the windows overlap. On a CPU in place, one set of non-overlapping windows
        at a time (chunks of a few blocks; ``F.fold`` per chunk made a bfloat16 stride-2 layer's training step 1.5x
        slower there); elsewhere one ``F.fold`` (col2im) over the chunk's blocks (a loop of small launches made
        the step launch-bound on a GPU)."""
        b, ni, by, nr, bx, nc = chunk
        shift = self.step * self.t
        gw = gw.view(ni, nr, nc, self.mh, self.mw, self.cv)
        if gvp.device.type == 'cpu':
            phases = -(-self.mw // shift)  # windows of blocks this many columns apart do not overlap
            for i in range(ni):
                for r in range(nr):
                    for phase in range(min(phases, nc)):
                        count = len(range(phase, nc, phases))
                        _windows(gvp, b + i, 1, by + r, 1, bx + phase, count, shift, self.mh, self.mw, phases).add_(
                            gw[i:i + 1, r:r + 1, phase::phases])
            return
        cols = gw.permute(0, 5, 3, 4, 1, 2).reshape(ni, self.cv * self.mh * self.mw, nr * nc)
        hs, ws = (nr - 1) * shift + self.mh, (nc - 1) * shift + self.mw
        y0, x0 = by * shift, bx * shift
        gvp[b:b + ni, :, y0:y0 + hs, x0:x0 + ws] += F.fold(cols, (hs, ws), (self.mh, self.mw), stride=shift)


def _gemm_blocks(q: Tensor, v: Tensor, table: Tensor, step: int):
    """The GEMM path's operands: query blocks, padded channels-last values (contiguous) and the block counts."""
    t = tile() // step
    blocks_y, blocks_x = -(-q.shape[3] // t), -(-q.shape[4] // t)
    qb, vp = to_blocks(q, v, table.shape[-2], table.shape[-1], t, step, blocks_y, blocks_x)
    return qb.contiguous(), vp.contiguous(), blocks_y, blocks_x


def forward(q: Tensor, v: Tensor, table: Tensor, step: int, content: Optional[Tensor] = None) -> Tensor:
    """The tiled operator's output ``[B, h V, Ho, Wo]`` (contiguous, as its fake)."""
    b, h, _, ho, wo = q.shape
    table = table.contiguous()
    qb, vp, blocks_y, blocks_x = _gemm_blocks(q, v, table, step)
    p = _TiledPlan(qb, vp, table, step, blocks_y, blocks_x)
    y = vp.new_empty(p.g, p.dv, p.rows)
    for chunk in p.chunks:
        g0, n, logits, windows = p.block_logits(qb, vp, chunk)
        torch.bmm(windows.transpose(1, 2), logits.transpose(1, 2), out=y[g0:g0 + n])
    t = p.t  # [G, V, (h, qy, qx)] -> [B, h V, Ho, Wo]
    y = y.view(b, blocks_y, blocks_x, p.dv, h, t, t).permute(0, 4, 3, 1, 5, 2, 6)
    y = y.reshape(b, h * p.dv, blocks_y * t, blocks_x * t)[:, :, :ho, :wo]
    return y.contiguous() if content is None else operator_content_term(q, content) + y  # contiguous, as the fake


def backward(gy: Tensor, q: Tensor, v: Tensor, table: Tensor, step: int,
             content: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of q, v, the table (summed in float32 at least) and the content lambda (an empty tensor
    without one)."""
    b, h, c, ho, wo = q.shape
    gcontent = v.new_empty(0)
    if content is not None:  # the content term's gradients (the position term's are added below)
        gq_content, gcontent = operator_content_grads(gy, q, content)
    table = table.contiguous()
    qb, vp, blocks_y, blocks_x = _gemm_blocks(q, v, table, step)
    p = _TiledPlan(qb, vp, table, step, blocks_y, blocks_x)
    t = p.t
    gy = F.pad(gy.view(b, h, p.dv, ho, wo), [0, blocks_x * t - wo, 0, blocks_y * t - ho])
    gy = gy.view(b, h, p.dv, blocks_y, t, blocks_x, t).permute(0, 3, 5, 2, 1, 4, 6).reshape(p.g, p.dv, p.rows)
    gq = torch.empty_like(qb)
    gvp = p.new_value_grad(vp)
    grm = torch.zeros(p.rm.shape, dtype=torch.promote_types(p.rm.dtype, torch.float32), device=p.rm.device)
    n_max = p.logits.shape[0]
    gwindows = vp.new_empty(n_max, p.mh * p.mw * p.u, p.dv)
    glogits = vp.new_empty(n_max, p.rows, p.cols)
    gcompact = vp.new_empty(n_max * p.rows, p.u * p.kh * p.kw)
    for chunk in p.chunks:
        g0, n, logits, windows = p.block_logits(qb, vp, chunk)
        gyc = gy[g0:g0 + n].transpose(1, 2)  # [n, rows, V]
        gw = gwindows[:n]
        torch.bmm(logits.transpose(1, 2), gyc, out=gw)
        p.overlap_add(gvp, gw, chunk)
        gl = glogits[:n]
        torch.bmm(gyc, windows.transpose(1, 2), out=gl)
        gc = gcompact[:n * p.rows]
        gc.view(n, p.h, p.t, p.t, p.u, p.kh, p.kw).copy_(_band(gl, p.t, p.h, p.u, p.kh, p.kw, p.mw, step))
        torch.mm(gc, p.rm.t(), out=gq[g0:g0 + n].view(n * p.rows, p.c))
        qc = qb[g0:g0 + n].view(n * p.rows, p.c)
        if grm.dtype == gc.dtype:
            grm.addmm_(qc.t(), gc)
        else:  # accumulate a low-precision table gradient in float32
            grm.add_(torch.mm(qc.t(), gc))
    # back to the operator's layouts
    gq = gq.view(b, blocks_y, blocks_x, h, t, t, c).permute(0, 3, 6, 1, 4, 2, 5).reshape(b, h, c, blocks_y * t,
                                                                                        blocks_x * t)
    pad_y, pad_x = (p.kh - 1) // 2, (p.kw - 1) // 2
    if gvp.device.type == 'cpu':  # channels last
        gvp = gvp.permute(0, 3, 1, 2)
    gv = gvp[:, :, pad_y:pad_y + v.shape[2], pad_x:pad_x + v.shape[3]]
    gq = gq[..., :ho, :wo].contiguous() if content is None else gq_content + gq[..., :ho, :wo]
    return gq, gv.contiguous(), grm.to(table.dtype).view_as(table), gcontent

