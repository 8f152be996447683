"""The ``gemm`` backend (:mod:`.backends`): the tiled form's arithmetic by batched GEMMs, on any device and dtype,
and the dense form (logits of every query-context pair, then one GEMM with the values).

Chunks of query blocks (``CPU_CHUNK_ROWS`` logit rows on a CPU; whole images up to ``DEVICE_CHUNK_ELEMENTS`` logits
elsewhere): the compact logits ``q R`` by one GEMM with the small table, written into the band of a reused zero
buffer through a strided view (translation equivariance makes the band the same for every block, section 3.3), then
one batched GEMM with the chunk's windows, each a strided view of the padded values. Every query meets its block's
whole window (``M_h x M_w``, 1.7x the exact form's value multiply-adds at a 23x23 scope and 8x8 blocks).

Layouts are the tiled kernels' (:meth:`.fused.Tiled.tiled_forward`): ``q [B, h, c, Ho, Wo]``, ``v [B, u V, H, W]``,
``table [c, u, K_h, K_w]``, an optional content lambda ``[B, c, V]`` added by a matmul.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..relative_embedding import dense_embedding, dense_index_for
from .backends import Call, Decision
from .fused import Tiled, content_grads, content_lambda, pool, pool_backward, reach, reach_grad
from .plain_ops import operator_content_grads, operator_content_term, tile, to_blocks

__all__ = ['Gemm', 'forward', 'backward', 'CPU_CHUNK_ROWS', 'DEVICE_CHUNK_ELEMENTS']

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


def _block_chunks(batch: int, blocks_y: int, blocks_x: int,
                  per_chunk: int) -> List[Tuple[int, int, int, int, int, int]]:
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

    def __init__(self, q: Tensor, vp: Tensor, table: Tensor, step: int, blocks_y: int, blocks_x: int, chunk: int):
        self.g, self.h, self.t, _, self.c = q.shape
        self.batch, _, _, self.cv = vp.shape
        _, self.u, self.kh, self.kw = table.shape
        self.dv = self.cv // self.u
        self.step, self.blocks_y, self.blocks_x = step, blocks_y, blocks_x
        self.mh, self.mw = step * (self.t - 1) + self.kh, step * (self.t - 1) + self.kw
        self.rows = self.t * self.t * self.h  # logit rows of a block
        self.cols = self.mh * self.mw * self.u  # logit columns of a block
        # chunk: logit rows (a CPU) or elements (elsewhere) of a chunk, the plan's tiling (Gemm.decide)
        per_chunk = max(1, chunk // (self.rows if q.device.type == 'cpu' else self.rows * self.cols))
        self.chunks = _block_chunks(self.batch, blocks_y, blocks_x, per_chunk)
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


def forward(q: Tensor, v: Tensor, table: Tensor, step: int, content: Optional[Tensor] = None,
            chunk: int = CPU_CHUNK_ROWS) -> Tensor:
    """The tiled kernels' output ``[B, h V, Ho, Wo]`` (contiguous); ``chunk``: see :class:`_TiledPlan`."""
    b, h, _, ho, wo = q.shape
    table = table.contiguous()
    qb, vp, blocks_y, blocks_x = _gemm_blocks(q, v, table, step)
    p = _TiledPlan(qb, vp, table, step, blocks_y, blocks_x, chunk)
    y = vp.new_empty(p.g, p.dv, p.rows)
    for chunk in p.chunks:
        g0, n, logits, windows = p.block_logits(qb, vp, chunk)
        torch.bmm(windows.transpose(1, 2), logits.transpose(1, 2), out=y[g0:g0 + n])
    t = p.t  # [G, V, (h, qy, qx)] -> [B, h V, Ho, Wo]
    y = y.view(b, blocks_y, blocks_x, p.dv, h, t, t).permute(0, 4, 3, 1, 5, 2, 6)
    y = y.reshape(b, h * p.dv, blocks_y * t, blocks_x * t)[:, :, :ho, :wo]
    return y.contiguous() if content is None else operator_content_term(q, content) + y  # contiguous, as the fake


def backward(gy: Tensor, q: Tensor, v: Tensor, table: Tensor, step: int, content: Optional[Tensor] = None,
             chunk: int = CPU_CHUNK_ROWS) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of q, v, the table (summed in float32 at least) and the content lambda (an empty tensor
    without one)."""
    b, h, c, ho, wo = q.shape
    gcontent = v.new_empty(0)
    if content is not None:  # the content term's gradients (the position term's are added below)
        gq_content, gcontent = operator_content_grads(gy, q, content)
    table = table.contiguous()
    qb, vp, blocks_y, blocks_x = _gemm_blocks(q, v, table, step)
    p = _TiledPlan(qb, vp, table, step, blocks_y, blocks_x, chunk)
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



class Gemm(Tiled):
    """The ``gemm`` backend: the tiled form by the batched GEMMs above, the dense form by the GEMMs below, on any
    device and dtype."""
    name = 'gemm'
    forms = ('dense', 'tiled')

    def decide(self, call: Call) -> Decision:
        """The tiled form's (:meth:`.fused.Tiled.decide`); the dense form has no variant, its chunks the tiled's."""
        if call.form == 'tiled':
            return super().decide(call)
        return Decision('', call.dtype, self.kernel_tiling(call.device, call.dtype, 1, call.k, call.kw))

    def kernel_tiling(self, device: str, dtype: torch.dtype, step: int, c: int, kw: int) -> Tuple[int, ...]:
        """The chunk size: :data:`CPU_CHUNK_ROWS` logit rows on a CPU, :data:`DEVICE_CHUNK_ELEMENTS` logits
        elsewhere."""
        return (CPU_CHUNK_ROWS if device == 'cpu' else DEVICE_CHUNK_ELEMENTS,)

    def tiled_forward(self, plan, q, v, table, step, content):
        return forward(q, v, table, step, content, plan.tiling[0])

    def tiled_backward(self, plan, gy, q, v, table, step, content):
        return backward(gy, q, v, table, step, content, plan.tiling[0])

    def forward(self, plan, q, keys, v, table, shared):
        if plan.form != 'dense':
            return super().forward(plan, q, keys, v, table, shared)
        b, k, u = q.shape[0], table.shape[0], table.shape[1]
        height, width = q.shape[2], q.shape[3]
        h, dv = q.shape[1] // k, v.shape[1] // u
        content, kn = content_lambda(keys, v, shared, plan.key_norm, k)
        table = reach(table, height, width, plan.global_scope)
        q4, v4 = _views(q, v, k, u)
        qd, vd, emb, _ = _dense_operands(q4, v4, table, height, width, plan.global_scope)
        y = torch.bmm(_dense_logits(qd, emb, b, h), vd)  # [B, n h, V]
        y = y.view(b, height * width, h * dv).transpose(1, 2).reshape(b, h, dv, height * width)
        if content is not None:  # + (lambda^c)^T q_n^h (eq. 2)
            y = torch.matmul(content.transpose(1, 2).unsqueeze(1), q4).add_(y)
        y = y.view(b, h * dv, height, width)
        return (pool(y, plan.count_include_pad) if plan.stride == 2 else y), content, kn

    def backward(self, plan, gy, q, keys, v, table, shared, content, kn):
        if plan.form != 'dense':
            return super().backward(plan, gy, q, keys, v, table, shared, content, kn)
        k, u = table.shape[0], table.shape[1]
        if content is None and (keys is not None or shared is not None):
            content, kn = content_lambda(keys, v, shared, plan.key_norm, k)
        q4, v4 = _views(q, v, k, u)
        height, width = q.shape[2], q.shape[3]
        gq, gv, gtable, gcontent = _dense_backward(gy, q4, v4, reach(table, height, width, plan.global_scope), content,
                                                   height, width, plan.stride, plan.count_include_pad,
                                                   plan.global_scope)
        return content_grads(gq, gv, reach_grad(gtable, table), gcontent, q, keys, v, shared, kn, plan.key_norm)


def _views(q: Tensor, v: Tensor, k: int, u: int) -> Tuple[Tensor, Tensor]:
    """The maps as ``q [B, h, k, n]`` and ``v [B, u, V, n]`` (views)."""
    b, n = q.shape[0], q.shape[2] * q.shape[3]
    return q.reshape(b, q.shape[1] // k, k, n), v.reshape(b, u, v.shape[1] // u, n)


def _dense_operands(q: Tensor, v: Tensor, table: Tensor, height: int, width: int, global_scope: bool):
    """The dense form's GEMM operands: ``q [n, B h, k]``, ``v [B, u m, V]``, the embeddings ``E [n, k, u m]``
    (``E_nm = R[m - n]``, zero outside a local scope) and their gather index."""
    b, h, k, n = q.shape
    u, dv = v.shape[1], v.shape[2]
    masked = not global_scope
    index = dense_index_for(height, width, table.shape[2], table.shape[3], masked, table.device, traced=False)
    emb = dense_embedding(table, height, width, masked, index).permute(2, 0, 1, 3).reshape(n, k, u * n)
    return (q.permute(3, 0, 1, 2).reshape(n, b * h, k), v.transpose(2, 3).reshape(b, u * n, dv), emb, index)


def _dense_logits(qd: Tensor, emb: Tensor, b: int, h: int) -> Tensor:
    """``[B, n h, u m]``: the logits of every (query, context) pair."""
    n = qd.shape[0]
    m = emb.shape[2]
    return torch.bmm(qd, emb).view(n, b, h, m).transpose(0, 1).reshape(b, n * h, m)


def _dense_backward(gy: Tensor, q: Tensor, v: Tensor, table: Tensor, content: Optional[Tensor], height: int,
                    width: int, stride: int, count_include_pad: bool, global_scope: bool):
    """The dense form's gradients of ``q [B, h, k, n]``, ``v [B, u, V, n]`` (an ``height x width`` map), the (reached)
    table and the content lambda ``[B, k, V]``."""
    b, h, k, n = q.shape
    u, dv = v.shape[1], v.shape[2]
    if stride == 2:
        gy = pool_backward(gy, height, width, count_include_pad)
    gy4 = gy.reshape(b, h, dv, n)
    gcontent = gq = None
    if content is not None:  # the content term's
        gcontent = torch.matmul(q, gy4.transpose(2, 3)).sum(1)
        gq = torch.matmul(content.unsqueeze(1), gy4)
    qd, vd, emb, index = _dense_operands(q, v, table, height, width, global_scope)
    gyd = gy4.permute(0, 3, 1, 2).reshape(b, n * h, dv)  # [B, n h, V]
    logits = _dense_logits(qd, emb, b, h)  # recomputed
    gv = torch.bmm(logits.transpose(1, 2), gyd).view(b, u, n, dv).transpose(2, 3)
    glogits = torch.bmm(gyd, vd.transpose(1, 2)).view(b, n, h, u * n).transpose(0, 1).reshape(n, b * h, u * n)
    gqd = torch.bmm(glogits, emb.transpose(1, 2)).view(n, b, h, k).permute(1, 2, 3, 0)
    gq = gqd if gq is None else gq + gqd
    gemb = torch.bmm(qd.transpose(1, 2), glogits).view(n, k, u, n).permute(1, 2, 0, 3).reshape(k, u, n * n)
    slots = table.shape[2] * table.shape[3] + (0 if global_scope else 1)
    gflat = gemb.new_zeros(k, u, slots).index_add_(2, index, gemb)
    gtable = gflat[:, :, :table.shape[2] * table.shape[3]].reshape(table.shape)
    return gq, gv, gtable, gcontent
