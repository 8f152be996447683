"""The dense and tiled forms as custom operators (``torch.library.custom_op``) for eager mode and ``torch.compile``.

Each has a backward operator that recomputes the logits instead of saving them (or, for ``create_graph=True``,
differentiates the plain-op form), a fake kernel, an autocast rule and a FLOP formula. The tiled operator runs the
exact form, each query against its scope, by the CPU kernel on a CPU (:mod:`.cpu_kernel`) and, for small calls and
maps, by Triton kernels on CUDA (:mod:`.tiled_triton`). Elsewhere, or where those are off, it runs the GEMM path:
chunks of query blocks (``CPU_CHUNK_ROWS`` logit rows on a CPU; whole images up to ``DEVICE_CHUNK_ELEMENTS`` logits
elsewhere), the compact logits ``q R`` by one GEMM with the small table, written into the band of a reused zero
buffer through a strided view (translation equivariance makes the band the same for every block), then one batched
GEMM with the chunk's windows, each a strided view of the padded values.
"""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from . import tiled_triton
from .cpu_kernel import compute_dtype, cpu_kernel, native_bfloat16
from .execution import warn_once
from .plain_ops import content_term, dense_plain, tile, tiled_plain, to_blocks

__all__ = ['dense_op', 'tiled_op', 'CPU_CHUNK_ROWS', 'DEVICE_CHUNK_ELEMENTS']

CPU_CHUNK_ROWS = 512  # logit rows (queries x heads) of one chunk on a CPU: cache-sized (no committed measurement)
DEVICE_CHUNK_ELEMENTS = 1 << 26  # logits of one chunk elsewhere (256 MiB in float32): one chunk per layer

_LIB = torch.library.Library('timm_lambda', 'FRAGMENT')  # the autocast rules' registrations


def _backward_fake(gy, q, v, table, *args):
    return q.new_empty(q.shape), v.new_empty(v.shape), table.new_empty(table.shape)  # contiguous, as the real ones


def _register(op, backward_op, plain, flops, tensors: Sequence[int] = (0, 1, 2)) -> None:
    """The autograd, FLOP and autocast registrations of ``op`` and the FLOPs of its ``backward_op``
    (``flops`` of the same inputs with ``backward=True``). ``tensors``: the positions of the inputs that get
    gradients (an optional one may be None), in the order ``backward_op`` returns them. A higher-order gradient
    differentiates ``plain`` (the same arguments as ``op``) instead."""

    def setup(ctx, inputs, output):
        inputs = list(inputs) + [None] * (max(tensors) + 1 - len(inputs))  # an optional input left out: None
        ctx.save_for_backward(*(inputs[i] for i in tensors))
        ctx.inputs = [None if i in tensors else x for i, x in enumerate(inputs)]  # the ints

    def backward(ctx, gy):
        inputs = list(ctx.inputs)
        for i, x in zip(tensors, ctx.saved_tensors):
            inputs[i] = x
        passed = len(ctx.needs_input_grad)
        needs = [i < passed and ctx.needs_input_grad[i] for i in tensors]
        if torch.is_grad_enabled():  # create_graph=True
            grads = _plain_vjp(plain, inputs, tensors, gy, needs)
        else:
            grads = backward_op(gy, *inputs)
        out: List[Optional[Tensor]] = [None] * passed
        for i, g, need in zip(tensors, grads, needs):
            if need:
                out[i] = g
        return tuple(out)

    op.register_autograd(backward, setup_context=setup)
    register_flop_formula(getattr(torch.ops.timm_lambda, op._name))(flops)
    register_flop_formula(getattr(torch.ops.timm_lambda, op._name + '_backward'))(
        lambda gy, *inputs, out_shape=None: flops(*inputs, backward=True))

    def in_autocast_dtype(*args):
        # torch.library.register_autocast (torch >= 2.7) fixes the dtype at registration; autocast's dtype is
        # chosen at run time (bfloat16 or float16, on either device), so this rule reads it as a matmul does
        device = args[0].device.type
        dtype = torch.get_autocast_dtype(device)
        args = [a.to(dtype) if isinstance(a, Tensor) and a.is_floating_point() and a.dtype != torch.float64 else a
                for a in args]
        with torch.autocast(device, enabled=False):
            return op(*args)

    for key in ('AutocastCPU', 'AutocastCUDA'):
        _LIB.impl(op._name, in_autocast_dtype, key)


@torch.jit.unused
def _plain_vjp(plain, inputs: list, tensors: Sequence[int], grad: Tensor, needs: Sequence[bool]):
    """A differentiable vector-Jacobian product of ``plain(*inputs)`` with respect to ``inputs[i]`` for ``i`` in
    ``tensors`` where ``needs``: the operators' backward when a higher-order gradient is requested
    (``create_graph=True``).

    An input that ``plain`` does not reach gets None, as autograd gives it for the plain-op form: a backward's None
    is autograd's zero gradient, and the input's gradient stays None where nothing else reaches it (zeros would
    leave ``.grad`` a tensor and make ``torch.autograd.grad`` without ``allow_unused`` return where the plain-op form
    raises). tests/test_double_backward.py compares with the plain-op forms."""
    warn_once('create_graph', 'higher-order gradients (create_graph=True) differentiate the plain-op form of the '
                              'position lambdas: correct, but slower and with more memory than the custom operators')
    with torch.enable_grad():
        out = plain(*inputs)
    wrt = [inputs[i] for i in tensors]
    got = iter(torch.autograd.grad(out, [x for x, need in zip(wrt, needs) if need], grad, create_graph=True,
                                   allow_unused=True))
    return tuple(next(got) if need else None for need in needs)


# ----------------------------------------------------------------------------------------------------------
# dense: q [n, B h, k], v [B, u m, V], emb [n, k, u m] -> y [B, n h, V]


@torch.library.custom_op('timm_lambda::dense_position_lambdas', mutates_args=())
def _dense(q: Tensor, v: Tensor, emb: Tensor, heads: int) -> Tensor:
    return dense_plain(q.contiguous(), v.contiguous(), emb.contiguous(), heads).contiguous()


@_dense.register_fake
def _(q, v, emb, heads):
    return v.new_empty(v.shape[0], q.shape[0] * heads, v.shape[2])


@torch.library.custom_op('timm_lambda::dense_position_lambdas_backward', mutates_args=())
def _dense_backward(gy: Tensor, q: Tensor, v: Tensor, emb: Tensor, heads: int) -> Tuple[Tensor, Tensor, Tensor]:
    q, v, emb, gy = q.contiguous(), v.contiguous(), emb.contiguous(), gy.contiguous()
    n, bh, _ = q.shape
    b, m = v.shape[0], v.shape[1]
    logits = torch.bmm(q, emb).view(n, b, heads, m).transpose(0, 1).reshape(b, n * heads, m)  # recomputed
    gv = torch.bmm(logits.transpose(1, 2), gy)
    glogits = torch.bmm(gy, v.transpose(1, 2)).view(b, n, heads, m).transpose(0, 1).reshape(n, bh, m)
    gq, gemb = torch.bmm(glogits, emb.transpose(1, 2)), torch.bmm(q.transpose(1, 2), glogits)
    return gq.contiguous(), gv.contiguous(), gemb.contiguous()  # bmm may hand back a transposed layout


def _dense_flops(q, v, emb, heads, out_shape=None, backward=False) -> int:
    """Logits ``n (B h) k (u m)`` and output ``B (n h) (u m) V`` multiply-adds; the backward: the logits again,
    their gradient and the gradients of ``q``, ``v``, ``emb`` (``3 k + 2 V`` instead of ``k + V``)."""
    (n, bh, k), (_, um, dv) = q, v
    return 2 * n * bh * um * ((3 * k + 2 * dv) if backward else (k + dv))


_dense_backward.register_fake(_backward_fake)
_register(_dense, _dense_backward, dense_plain, _dense_flops)


@torch.jit.unused
def dense_op(q: Tensor, v: Tensor, emb: Tensor, heads: int) -> Tensor:
    """:func:`.plain_ops.dense_plain` by the custom operator."""
    return _dense(q, v.to(q.dtype), emb.to(q.dtype), heads)


# ----------------------------------------------------------------------------------------------------------
# tiled: q [B, h, c, Ho, Wo], v [B, u V, H, W], table [c, u, K_h, K_w] -> y [B, h V, Ho, Wo]: the layer's own layouts
# (query (oy, ox) meets the values from (step oy - (K_h - 1) // 2, step ox - (K_w - 1) // 2) on, zero outside the
# image). The CPU kernel reads and writes them directly; the GEMM path below works on the query blocks and padded
# windows of :func:`.plain_ops.to_blocks` (blocks of tile() // step queries a side). An optional content lambda
# [B, c, V] is applied to the same queries and added (eq. 2): in the kernel's accumulators, elsewhere by a matmul.


def _content_term(q: Tensor, content: Tensor) -> Tensor:
    """:func:`.plain_ops.content_term` of the operator's queries ``q [B, h, c, Ho, Wo]``: ``[B, h V, Ho, Wo]``."""
    b, h, c, ho, wo = q.shape
    return content_term(content, q.reshape(b, h, c, ho * wo), ho, wo)


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


@torch.library.custom_op('timm_lambda::tiled_position_lambdas', mutates_args=())
def _tiled(q: Tensor, v: Tensor, table: Tensor, step: int, content: Optional[Tensor] = None) -> Tensor:
    kernel = cpu_kernel(q, step)
    if native_bfloat16(kernel, q.dtype):  # bfloat16 on AVX-512 BF16 (CPU autocast)
        return kernel.tiled_forward_bf16(q, v.to(q.dtype), table.to(q.dtype), content, step)
    if kernel is not None:  # a 16-bit input (CPU autocast, stride 1) in float32, the result rounded back
        c = compute_dtype(q.dtype)
        return kernel.tiled_forward(q.to(c), v.to(c), table.to(c), None if content is None else content.to(c),
                                    step).to(q.dtype)
    y = tiled_triton.tiled_forward(q, v, table, step, DEVICE_CHUNK_ELEMENTS, content) \
        if tiled_triton.runs(q, v, table) else None
    if y is not None:  # content lambda included
        return y
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
    return y.contiguous() if content is None else _content_term(q, content) + y  # contiguous, as the fake


@_tiled.register_fake
def _(q, v, table, step, content=None):
    return v.new_empty(q.shape[0], q.shape[1] * (v.shape[1] // table.shape[1]), q.shape[3], q.shape[4])


@torch.library.custom_op('timm_lambda::tiled_position_lambdas_backward', mutates_args=())
def _tiled_backward(gy: Tensor, q: Tensor, v: Tensor, table: Tensor, step: int,
                    content: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of q, v, table and content (an empty tensor without content)."""
    kernel = cpu_kernel(q, step)
    if kernel is not None:
        c = compute_dtype(q.dtype)
        if native_bfloat16(kernel, q.dtype):  # float32 gradients of the bfloat16 forward
            gq, gv, gtable, gcontent = kernel.tiled_backward_bf16(gy.to(q.dtype), q, v.to(q.dtype),
                                                                  table.to(q.dtype), content, step)
        else:
            gq, gv, gtable, gcontent = kernel.tiled_backward(gy.to(c), q.to(c), v.to(c), table.to(c),
                                                             None if content is None else content.to(c), step)
        return (gq.to(q.dtype), gv.to(v.dtype), gtable.to(table.dtype),
                gcontent.to(v.dtype if content is None else content.dtype))
    b, h, c, ho, wo = q.shape
    gcontent = v.new_empty(0)
    if content is not None:  # the content term's gradients (the position term's are added below)
        gy4 = gy.reshape(b, h, content.shape[2], ho * wo)
        q4 = q.reshape(b, h, c, ho * wo)
        gcontent = torch.matmul(q4, gy4.transpose(2, 3)).sum(1).to(content.dtype).contiguous()
        gq_content = torch.matmul(content.unsqueeze(1), gy4).view(b, h, c, ho, wo)
    grads = tiled_triton.tiled_backward(gy, q, v, table, step, DEVICE_CHUNK_ELEMENTS) \
        if tiled_triton.runs(q, v, table) else None
    if grads is not None:
        gq, gv, gtable = grads
        return (gq if content is None else gq_content + gq), gv, gtable, gcontent
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


@_tiled_backward.register_fake
def _(gy, q, v, table, step, content=None):
    return _backward_fake(gy, q, v, table) + (v.new_empty(0) if content is None else content.new_empty(content.shape),)


def _in_image(size: int, queries: int, step: int, k: int) -> int:
    """Scope offsets along one axis that meet the image, summed over the queries."""
    lo = (k - 1) // 2
    return sum(max(0, min(k, lo + size - step * q) - max(0, lo - step * q)) for q in range(queries))


def _tiled_flops(q, v, table, step, content=None, out_shape=None, backward=False) -> int:
    """Multiply-adds of the exact form that the CPU and Triton kernels compute: per query ``h u K_h K_w``
    logits of depth ``c``, and a value row of depth ``V`` per scope offset that meets the image; the backward: the
    logits again and the gradients of ``q`` and the table (3x ``c``), of the values and of the logits (2x ``V``).
    The GEMM path does the ``V`` part for whole windows, ``M_h M_w`` offsets per query. A content
    lambda adds ``h c V`` per query (twice in the backward: the gradients of ``q`` and of the content lambda)."""
    (b, h, c, ho, wo), (_, cv, height, width), (_, u, kh, kw) = q, v, table
    logits = b * ho * wo * h * u * kh * kw * c
    values = b * h * cv * _in_image(height, ho, step, kh) * _in_image(width, wo, step, kw)
    extra = 0 if content is None else b * ho * wo * h * c * content[2] * (2 if backward else 1)
    return 2 * ((3 * logits + 2 * values) if backward else (logits + values)) + 2 * extra


def _tiled_plain_as_op(q: Tensor, v: Tensor, table: Tensor, step: int, content: Optional[Tensor] = None) -> Tensor:
    """:func:`.plain_ops.tiled_plain` in the operator's layouts."""
    b, h, _, ho, wo = q.shape
    t = tile() // step
    blocks_y, blocks_x = -(-ho // t), -(-wo // t)
    y = tiled_plain(*to_blocks(q, v, table.shape[-2], table.shape[-1], t, step, blocks_y, blocks_x), table, t, step,
                    blocks_y, blocks_x)  # [G, (qy, qx, h), V]
    y = y.reshape(b, blocks_y, blocks_x, t, t, h, y.shape[2]).permute(0, 5, 6, 1, 3, 2, 4)
    y = y.reshape(b, h * y.shape[2], blocks_y * t, blocks_x * t)[:, :, :ho, :wo]
    return y if content is None else _content_term(q, content) + y


_register(_tiled, _tiled_backward, _tiled_plain_as_op, _tiled_flops, tensors=(0, 1, 2, 4))


@torch.jit.unused
def tiled_op(q: Tensor, v: Tensor, table: Tensor, step: int, content: Optional[Tensor] = None) -> Tensor:
    """:func:`.plain_ops.tiled_plain` by the custom operator, in the layer's layouts: ``q [B, h, c, Ho, Wo]``,
    ``v [B, u V, H, W]``, ``table [c, u, K_h, K_w]``, optionally a content lambda ``[B, c, V]`` applied to the same
    queries -> ``[B, h V, Ho, Wo]`` (see the comment above ``_tiled``)."""
    return _tiled(q, v.to(q.dtype), table.to(q.dtype), step, None if content is None else content.to(q.dtype))
