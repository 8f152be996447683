"""The tiled form's GPU execution: the contractions over the query depth by cuBLAS, the windowed sums by Triton.

The compact logits ``L[b, h, (u, ky, kx), oy, ox] = q_n^h . R[:, u, ky, kx]`` (eq. 1's ``E_nm`` for the scope
offset ``m - n = (ky, kx)``) are one batched GEMM with the small table, in the queries' own layout. Two Triton
kernels then do what a GEMM cannot, each query against exactly its ``K_h x K_w`` scope (the GEMM path pads every scope
to its block's window, 1.7x the work at a 23x23 scope, and fills a banded logit matrix):

* ``_query_rows``: ``y[b, h V, oy, ox] = sum_{u, ky, kx} L[...] v[b, u V, s oy - p_y + ky, s ox - p_x + kx]``, and
  with ``LOGIT_GRAD`` the same loop for ``dL = sum_v dy[b, h v, oy, ox] v[b, u v, ...]`` (then ``dq = R dL`` and
  ``dR = sum dL q^T`` by GEMMs);
* ``_value_grad``: ``dv[b, u v, r, c] = sum_{h, ky, kx} L[...] dy[b, h v, oy, ox]`` over the queries whose scope holds
  ``(r, c)``, gathered per value position (no atomics: deterministic).

Every multiply-add is one of the exact form (the FLOP formula of :mod:`.custom_ops`), on the CUDA cores: a lane a
query, a loop over the scope. Tested against the float64 per-query reference on a GPU (tests/test_cuda.py) and, on
a CPU, under Triton's interpreter (tests/test_tiled_triton.py).

Layouts are the operator's (:mod:`.custom_ops`): ``q [B, h, C, Ho, Wo]``, ``v [B, u V, H, W]``, ``table [C, u, K_h,
K_w]``, ``s = step``, ``p = (K - 1) // 2``, zero values outside the image. Sums run in float32 (float64 for float64
inputs); results in the inputs' dtype. Images are processed in chunks whose logits hold at most ``chunk_elements``.
Which CUDA execution runs (:func:`runs`): this one where it measured faster than the GEMM path on an H200
(docs/benchmarks.md, "GPU"): calls of at most ``SMALL_CALL`` queries (launch-bound: 3 kernels instead of the GEMM
path's dozen) and maps no larger than the scope (the GEMM path's padded windows then lie mostly outside the image);
the GEMM path's tensor-core GEMMs elsewhere (1.2-2.3x faster at batch 8). These kernels run their
multiply-adds on the CUDA cores, at 2 of the GPU's 33 float32 TMAC/s: a tensor-core formulation is the next step.
``TIMM_LAMBDA_TRITON=1`` runs them wherever they can run (about half the GEMM path's training memory), ``0`` never;
a first launch that fails turns them off (a Triton that cannot compile them here; one warning, and the call
returns None for the GEMM path to answer).
"""
import functools
from typing import Optional

import torch
from torch import Tensor

from ..._env import env_choice
from .execution import warn_once

__all__ = ['runs', 'tiled_forward', 'tiled_backward', 'MODE']

MODE = env_choice('TIMM_LAMBDA_TRITON', ('auto',), 'auto')  # 'auto', '1' (wherever it can run) or '0' (never)
SMALL_CALL = 4096  # queries (images x output positions) of a call up to which Triton runs in 'auto'
_SERVED = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_LAUNCHED = False  # a kernel has run in this process: later errors are errors, not an unusable Triton


def _launch(kernel, grid, *args) -> bool:
    """Run ``kernel``; False where it is the process's first launch and it fails (this execution is then off: the
    caller takes the GEMM path)."""
    global MODE, _LAUNCHED
    if _LAUNCHED:
        kernel[grid](*args)
        return True
    try:
        kernel[grid](*args)
    except Exception as e:
        MODE = '0'
        warn_once('triton', f'the tiled form\'s Triton kernels failed at their first launch ({type(e).__name__}: '
                            f'{str(e)[:300]}); the position lambdas run as batched GEMMs instead (correct, slower)')
        return False
    _LAUNCHED = True
    return True


@functools.lru_cache(maxsize=None)
def _kernels():
    """The Triton kernels, compiled on first use (None without Triton)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _query_rows(l_ptr, v_ptr, y_ptr, H, W, Ho, Wo, HEADS, U, V, KH, KW, STEP: tl.constexpr, ACC: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr, LOGIT_GRAD: tl.constexpr):
        """Rows (head, query) of one output row segment against every in-image scope offset. Forward: ``y`` from
        the logits ``l``. ``LOGIT_GRAD``: ``l`` (zero-initialised) from the output gradient ``y``."""
        ox0, oy, b = tl.program_id(0) * BLOCK_Q, tl.program_id(1), tl.program_id(2).to(tl.int64)
        r = tl.arange(0, BLOCK_Q * BLOCK_H)
        hd, ox = r // BLOCK_Q, ox0 + r % BLOCK_Q
        rmask = (hd < HEADS) & (ox < Wo)
        vv = tl.arange(0, BLOCK_V)
        vmask = vv < V
        hw, howo = H * W, Ho * Wo
        y_off = ((b * HEADS + hd) * V)[:, None] * howo + vv[None, :] * howo + oy * Wo + ox[:, None]
        l_row = (b * HEADS + hd) * (U * KH * KW * howo) + oy * Wo + ox  # [R] at scope offset 0
        if LOGIT_GRAD:
            g = tl.load(y_ptr + y_off, mask=rmask[:, None] & vmask[None, :], other=0.0).to(ACC)
        else:
            acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_V], ACC)
        for u in range(U):
            v_base = (b * U + u) * V * hw
            for ky in range(KH):
                row = oy * STEP - (KH - 1) // 2 + ky
                if (row >= 0) & (row < H):
                    for kx in range(KW):
                        col = ox * STEP - (KW - 1) // 2 + kx
                        m = rmask & (col >= 0) & (col < W)
                        vg = tl.load(v_ptr + v_base + vv[None, :] * hw + row * W + col[:, None],
                                     mask=m[:, None] & vmask[None, :], other=0.0).to(ACC)
                        l_at = l_ptr + l_row + ((u * KH + ky) * KW + kx) * howo
                        if LOGIT_GRAD:
                            tl.store(l_at, tl.sum(g * vg, axis=1).to(l_ptr.dtype.element_ty), mask=m)
                        else:
                            acc += tl.load(l_at, mask=m, other=0.0).to(ACC)[:, None] * vg
        if not LOGIT_GRAD:
            tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & vmask[None, :])

    @triton.jit
    def _value_grad(l_ptr, gy_ptr, gv_ptr, H, W, Ho, Wo, HEADS, U, V, KH, KW, STEP: tl.constexpr, ACC: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_V: tl.constexpr):
        """``gv`` at value columns ``c0 + STEP i`` of row ``r`` (one column phase, so that every scope offset
        ``kx`` of that phase meets consecutive queries ``ox``)."""
        pid, r, bu = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        b, u = bu // U, bu % U
        c0 = (pid // STEP) * (STEP * BLOCK_P) + pid % STEP
        i = tl.arange(0, BLOCK_P)
        c = c0 + STEP * i
        cmask = c < W
        vv = tl.arange(0, BLOCK_V)
        vmask = vv < V
        howo = Ho * Wo
        acc = tl.zeros([BLOCK_P, BLOCK_V], ACC)
        for hd in range(HEADS):
            l_head = (b * HEADS + hd) * (U * KH * KW * howo)
            g_head = (b * HEADS + hd) * V * howo
            for ky in range(KH):
                num = r + (KH - 1) // 2 - ky  # = STEP oy
                oy = num // STEP
                if (num >= 0) & (num % STEP == 0) & (oy < Ho):
                    for kx in range((c0 + (KW - 1) // 2) % STEP, KW, STEP):
                        ox = (c0 + (KW - 1) // 2 - kx) // STEP + i  # exact: kx has c0's phase
                        m = cmask & (ox >= 0) & (ox < Wo)
                        lc = tl.load(l_ptr + l_head + ((u * KH + ky) * KW + kx) * howo + oy * Wo + ox, mask=m,
                                     other=0.0).to(ACC)
                        gg = tl.load(gy_ptr + g_head + vv[None, :] * howo + oy * Wo + ox[:, None],
                                     mask=m[:, None] & vmask[None, :], other=0.0).to(ACC)
                        acc += lc[:, None] * gg
        out = ((b * U + u) * V + vv[None, :]) * (H * W) + r * W + c[:, None]
        tl.store(gv_ptr + out, acc.to(gv_ptr.dtype.element_ty), mask=cmask[:, None] & vmask[None, :])

    return dict(query_rows=_query_rows, value_grad=_value_grad, tl=tl, triton=triton)


def runs(q: Tensor, v: Tensor, table: Tensor) -> bool:
    """True where this execution runs the tiled operator's call (see above): CUDA tensors of a served dtype, Triton
    importable, not turned off, and in ``'auto'`` a call of at most ``SMALL_CALL`` queries or a map no larger than
    the (pooled) table."""
    if MODE not in ('auto', '1', '0'):  # read by timm_lambda._env: only a value assigned to MODE gets here
        raise ValueError(f"tiled_triton.MODE must be 'auto', '1' or '0', got {MODE!r}")
    if MODE == '0' or not q.is_cuda or q.dtype not in _SERVED or _kernels() is None:
        return False
    small = q.shape[0] * q.shape[3] * q.shape[4] <= SMALL_CALL
    return MODE == '1' or small or (v.shape[2] <= table.shape[2] and v.shape[3] <= table.shape[3])


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _meta(q: Tensor, v: Tensor, table: Tensor):
    b, h, c, ho, wo = q.shape
    _, u, kh, kw = table.shape
    k = _kernels()
    acc = k['tl'].float64 if q.dtype == torch.float64 else k['tl'].float32
    return b, h, c, ho, wo, u, kh, kw, v.shape[1] // u, v.shape[2], v.shape[3], acc, k


def _row_tiles(h: int, wo: int, dv: int):
    """(queries per program, heads padded to a power of 2, channels padded): about 4096 accumulators a program."""
    bh, bv = _pow2(h), _pow2(dv, 16)
    bq = max(1, min(_pow2(wo), 4096 // (bh * bv)))
    return bq, bh, bv


def _chunks(batch: int, per_image: int, chunk_elements: int):
    n = max(1, chunk_elements // max(per_image, 1))
    return [(b0, min(n, batch - b0)) for b0 in range(0, batch, n)]


def _logits(q: Tensor, table: Tensor) -> Tensor:
    """``[n, h, C, Ho, Wo] -> [n, h, u K_h K_w, Ho, Wo]``: the compact logits by one batched GEMM."""
    n, h, c, ho, wo = q.shape
    rt = table.reshape(c, -1).t()
    return torch.bmm(rt.expand(n * h, *rt.shape), q.reshape(n * h, c, ho * wo)).view(n, h, -1, ho, wo)


def tiled_forward(q: Tensor, v: Tensor, table: Tensor, step: int, chunk_elements: int) -> Optional[Tensor]:
    """The position term ``[B, h V, Ho, Wo]`` (contiguous) of the tiled operator; None if the kernels cannot run."""
    b, h, c, ho, wo, u, kh, kw, dv, height, width, acc, k = _meta(q, v, table)
    q, v, table = q.contiguous(), v.contiguous(), table.contiguous()
    y = q.new_empty(b, h * dv, ho, wo)
    if y.numel() == 0:
        return y
    bq, bh, bv = _row_tiles(h, wo, dv)
    for b0, n in _chunks(b, h * u * kh * kw * ho * wo, chunk_elements):
        logits = _logits(q[b0:b0 + n], table)
        if not _launch(k['query_rows'], (k['triton'].cdiv(wo, bq), ho, n), logits, v[b0:b0 + n], y[b0:b0 + n],
                       height, width, ho, wo, h, u, dv, kh, kw, step, acc, bq, bh, bv, False):
            return None
    return y


def tiled_backward(gy: Tensor, q: Tensor, v: Tensor, table: Tensor, step: int, chunk_elements: int):
    """The gradients of ``q``, ``v`` and ``table`` (contiguous; the table's summed in float32 or float64); None if the
    kernels cannot run."""
    b, h, c, ho, wo, u, kh, kw, dv, height, width, acc, k = _meta(q, v, table)
    q, v, table, gy = q.contiguous(), v.contiguous(), table.contiguous(), gy.contiguous()
    gq, gv = torch.empty_like(q), torch.empty_like(v)
    gt = torch.zeros(c, u * kh * kw, dtype=torch.promote_types(table.dtype, torch.float32), device=q.device)
    if q.numel() == 0 or v.numel() == 0:
        return gq.zero_(), gv.zero_(), gt.to(table.dtype).view_as(table)
    bq, bh, bv = _row_tiles(h, wo, dv)
    bp = max(1, min(_pow2(-(-width // step)), 4096 // bv))
    cdiv = k['triton'].cdiv
    rm = table.view(c, u * kh * kw)
    for b0, n in _chunks(b, h * u * kh * kw * ho * wo, chunk_elements):
        qc, gyc = q[b0:b0 + n], gy[b0:b0 + n]
        logits = _logits(qc, table)
        if not _launch(k['value_grad'], (cdiv(width, step * bp) * step, height, n * u), logits, gyc, gv[b0:b0 + n],
                       height, width, ho, wo, h, u, dv, kh, kw, step, acc, bp, bv):
            return None
        gl = torch.zeros_like(logits)
        if not _launch(k['query_rows'], (cdiv(wo, bq), ho, n), gl, v[b0:b0 + n], gyc,
                       height, width, ho, wo, h, u, dv, kh, kw, step, acc, bq, bh, bv, True):
            return None
        gl = gl.view(n * h, u * kh * kw, ho * wo)
        torch.bmm(rm.expand(n * h, *rm.shape), gl, out=gq[b0:b0 + n].view(n * h, c, ho * wo))
        gt += torch.bmm(gl, qc.reshape(n * h, c, ho * wo).transpose(1, 2)).to(gt.dtype).sum(0).t()
    return gq, gv, gt.to(table.dtype).view_as(table)
