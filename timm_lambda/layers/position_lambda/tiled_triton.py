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

Two variants, two backends of :mod:`.backends`: ``triton_tc`` (float16, bfloat16, float32) contracts banded tiles of
the query-major logits with the value windows by ``tl.dot`` on the tensor cores (16-bit operands, float32 sums;
float32 on TF32 where torch's matmuls may use it, else exact), the content lambda fused into the forward; at stride
1 its forward computes the logits it contracts in the kernel (``L = Q E`` by ``tl.dot``, skewed by ``tl.gather``: no
logits tensor, no GEMM) and its logit gradient computes ``dq`` (the logit gradients are still a tensor, for the
``dR`` GEMM); its value gradient reads the logits from the GEMM's tensor (``dv^T = dY^T A``, the value channels as
the MMA's rows); ``triton_fma`` (also float64) runs the loops above on the CUDA cores, a lane a query.
Tested against the float64 per-query reference on a CPU under Triton's interpreter (tests/test_tiled_triton.py) and
on a GPU (tests/test_cuda.py).

Layouts are the operator's (:mod:`.custom_ops`): ``q [B, h, C, Ho, Wo]``, ``v [B, u V, H, W]``, ``table [C, u, K_h,
K_w]``, ``s = step``, ``p = (K - 1) // 2``, zero values outside the image. Results in the inputs' dtype. Images are
processed in chunks of about equal size whose logits hold at most ``chunk_elements`` (:data:`CHUNK_ELEMENTS`). A
first launch that fails because Triton cannot build kernels here raises :class:`.execution.BackendUnusable` (the
backend table hands the call on, or raises in strict mode); any other error propagates.
"""
import functools
import os
from typing import Optional

import torch
from torch import Tensor

from ..execution import BackendUnusable
from .backends import Call
from .fused import Tiled, check_kernel_arguments
from .plain_ops import operator_content_grads, operator_content_term
from .plan import SMALL_CALL

__all__ = ['TritonTC', 'TritonFMA', 'kernels', 'image_chunks', 'forward', 'backward', 'unavailable', 'logit_stride',
           'tc_launch_meta', 'padded_table', 'query_major_logits', 'sm_count', 'widens', 'INTERPRETED',
           'CHUNK_ELEMENTS']

# The logits of one chunk of images (512 MiB in float32; the backward's logit gradients as many again): one chunk a
# layer step at LambdaResNet-101's shapes up to batch 8 at 1024 px (at 2**26, c4's batch 8 ran as chunks of 7 and 1
# images on the H200: every launch of the step twice, the second on a grid of one image)
CHUNK_ELEMENTS = 1 << 27

# Entries of each cache keyed by input sizes (launch constants: a few hundred bytes each, at most about 100 KB a
# cache however many input sizes a process meets; docs/execution_modes.md)
SIZE_CACHE = 256
_LAUNCHED = False  # a kernel has run in this process: later errors are errors, not an unusable Triton
_FAILED: Optional[str] = None  # why the first launch failed: Triton cannot build kernels here (both backends)


def _launch(kernel, grid, *args, **meta) -> None:
    """Run ``kernel``. At the process's first launch, an error that says this backend cannot serve calls here
    (:func:`_cannot_run_here`: no driver or compiler, a kernel this Triton or GPU cannot build) raises
    :class:`.execution.BackendUnusable` (and both Triton backends are then :func:`unavailable`); any other error (a
    kernel fault, out of memory) and any error after a first launch succeeded propagate as they are."""
    global _LAUNCHED, _FAILED
    try:
        kernel[grid](*args, **meta)
    except Exception as e:
        if _LAUNCHED or not _cannot_run_here(e):
            raise
        _FAILED = f"Triton's first launch failed: {type(e).__name__}: {str(e)[:300]}"
        raise BackendUnusable(_FAILED) from e
    _LAUNCHED = True


# What a RuntimeError says when this Triton cannot build or launch kernels on this machine (no driver, no C compiler
# for its launcher, no assembler or kernel image for this GPU), and what a kernel fault says (never a fallback)
_CANNOT_RUN = ('active drivers', 'driver version', 'driver not', 'no cuda', 'cuda is not available', 'libcuda',
               'c compiler', 'no compiler', 'ptxas', 'ptx codegen', 'no kernel image', 'kernel image is invalid',
               'unsupported gpu', 'unsupported architecture', 'cuinit')
_FAULTS = ('illegal memory access', 'misaligned address', 'device-side assert', 'launch failure', 'illegal instruction',
           'out of memory', 'an illegal', 'exception on the device', 'uncorrectable')


def _cannot_run_here(e: Exception) -> bool:
    """Whether ``e`` says that this backend cannot serve calls here: Triton cannot build or launch kernels on this
    machine (no driver, no C compiler for its launcher, no assembler for this GPU: ``OSError``, ``ImportError``,
    ``subprocess.SubprocessError``, Triton's ``PTXASError``, a ``RuntimeError`` saying so, :data:`_CANNOT_RUN`), or
    a kernel that this Triton cannot compile or this GPU cannot hold (Triton's ``CompilationError``,
    ``OutOfResources``: another Triton version or a GPU with less shared memory). A kernel fault (an illegal address,
    a device-side assert: ``torch.AcceleratorError``, a ``RuntimeError`` naming one), running out of memory or any
    other error is not: it propagates, in strict mode or not."""
    import subprocess
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources
    except ImportError:  # another Triton: judge by the builtin types alone
        CompilationError = OutOfResources = ()
    try:
        from triton.runtime.errors import PTXASError
    except ImportError:
        PTXASError = ()
    if isinstance(e, torch.OutOfMemoryError) or isinstance(e, getattr(torch, 'AcceleratorError', ())):
        return False
    if isinstance(e, (CompilationError, OutOfResources, PTXASError, OSError, ImportError, subprocess.SubprocessError)):
        return True
    if type(e) is not RuntimeError:  # a subclass is some library's own error (a CUDA fault, a torch check)
        return False
    message = str(e).lower()
    return not any(f in message for f in _FAULTS) and any(c in message for c in _CANNOT_RUN)


@functools.lru_cache(maxsize=None)
def kernels():
    """The Triton kernels by name (``query_rows``, ``value_grad``, ``tc_rows``, ``tc_value_grad``; ``tl``, ``triton``:
    the modules), compiled on first use; None without Triton. (Observe their launches with Triton's own
    ``add_pre_run_hook``.)"""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _query_rows(l_ptr, v_ptr, y_ptr, H, W, Ho, Wo, HEADS, U, V, KH, KW, STEP: tl.constexpr, ACC: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_V: tl.constexpr, LOGIT_GRAD: tl.constexpr):
        """Rows (head, query) of one output row segment against every in-image scope offset. Forward: ``y`` from
        the logits ``l``. ``LOGIT_GRAD``: ``l`` from the output gradient ``y``, every scope offset of the rows written
        (zero off the image)."""
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
                        if LOGIT_GRAD:  # zero off the image (vg is): every offset written, no zero-filled buffer
                            tl.store(l_at, tl.sum(g * vg, axis=1).to(l_ptr.dtype.element_ty), mask=rmask)
                        else:
                            acc += tl.load(l_at, mask=m, other=0.0).to(ACC)[:, None] * vg
                elif LOGIT_GRAD:  # a scope row off the image: zero gradients
                    for kx in range(KW):
                        tl.store(l_ptr + l_row + ((u * KH + ky) * KW + kx) * howo,
                                 tl.zeros([BLOCK_Q * BLOCK_H], l_ptr.dtype.element_ty), mask=rmask)
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

    global _as_operand  # (a module-level name: Triton resolves the jit functions a kernel calls among its globals)

    @triton.jit
    def _as_operand(x, dtype: tl.constexpr, WIDEN: tl.constexpr):
        """float32 sums rounded to the operands' ``dtype``, as the tensor they stand for is; ``WIDEN``: to bfloat16's
        precision (to nearest even) but kept in float32 (the interpreter's casts to bfloat16 truncate)."""
        if WIDEN:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(dtype)

    @triton.jit
    def _tc_rows(l_ptr, v_ptr, y_ptr, q_ptr, c_ptr, H, W, Ho, Wo, HEADS, U, V, C, KH, KW, LS, STEP: tl.constexpr,
                 PREC: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
                 BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr, LOGIT_GRAD: tl.constexpr, CONTENT: tl.constexpr,
                 WIDEN: tl.constexpr, BLOCK_Y: tl.constexpr = 1, FUSED: tl.constexpr = False,
                 KWP: tl.constexpr = 32, ADD: tl.constexpr = False, ALIGN: tl.constexpr = 1):
        """Tensor cores: rows (output row, head, query) of ``BLOCK_Q`` queries of ``BLOCK_Y`` output rows, all heads
        (they share the values), against the ``BLOCK_W`` value columns that hold their scopes, one value row at a
        time (each row meets the scope row it falls in: the rows of ``BLOCK_Y`` output rows share each value tile).
        Forward: ``y += A V`` with ``A[(y, h, q), w] = L[h, q, ky, w - STEP q]`` gathered from the query-major
        compact logits (zero off the band), plus ``q lambda^c`` with ``CONTENT``. ``LOGIT_GRAD``: ``dA = dY V^T``,
        its band stored into ``l`` (``y`` holds ``dY``), every scope offset of the rows written (zero off the image:
        the scope rows off the image by stores alone, after the loop). ``WIDEN``: 16-bit tiles widened to float32
        before each product (exact; Triton's interpreter has no bfloat16 matmul). ``LS``: the logits' row stride
        (``U KH KW`` rounded up: :func:`logit_stride`). One loop over the (u, value row) pairs, without branches:
        Triton pipelines its loads. ``ALIGN``: the window starts at a multiple of it, one column before the scopes'
        where they start at an odd one (its rows 4-byte aligned in 16-bit: ``cp.async``).

        ``FUSED`` (forward): ``l`` is the table ``[C, LS]`` (its offsets as columns, ``LS`` apart), and each value row's
        logits are computed here, ``L = Q E`` by a batched ``tl.dot`` over the ``BLOCK_Y`` output rows, each output
        row's queries against its own scope row of the table (``KWP`` columns, the scope's width rounded up: each
        logit once a program), rounded to the operands' dtype as the logits tensor is, and skewed into the banded
        tile by ``tl.gather``: no logits tensor, no GEMM launch, nothing read back. ``FUSED`` with ``LOGIT_GRAD``:
        also ``dq = dL E^T`` (``c`` the table ``[C, U KH KW]``, ``dq`` into ``q``, added to what it holds with
        ``ADD``: the content term's), batched likewise, the band gathered back by ``tl.gather`` and rounded as the
        stored logit gradients are: no ``dq`` GEMM."""
        ox0, oy0, b = tl.program_id(0) * BLOCK_Q, tl.program_id(1) * BLOCK_Y, tl.program_id(2).to(tl.int64)
        r = tl.arange(0, BLOCK_Y * BLOCK_H * BLOCK_Q)
        oy, hd, j = oy0 + r // (BLOCK_H * BLOCK_Q), (r // BLOCK_Q) % BLOCK_H, r % BLOCK_Q
        ox = ox0 + j
        rmask = (hd < HEADS) & (ox < Wo) & (oy < Ho)
        vv = tl.arange(0, BLOCK_V)
        vmask = vv < V
        w = tl.arange(0, BLOCK_W)
        # the window's value columns, from a multiple of ALIGN (its rows then 4-byte aligned in 16-bit: cp.async)
        col0 = ox0 * STEP - (KW - 1) // 2
        shift = (col0 % ALIGN + ALIGN) % ALIGN  # (the window's first scope column: 0, or 1 with ALIGN 2)
        col0 = tl.multiple_of(col0 - shift, ALIGN)
        col = col0 + w
        cmask = (col >= 0) & (col < W)
        kx = w[None, :] - shift - STEP * j[:, None]  # [R, BW]: the scope column of (row, window column)
        kmask = rmask[:, None] & (kx >= 0) & (kx < KW)
        hw, howo = H * W, Ho * Wo
        l_row = ((b * HEADS + hd) * howo + oy * Wo + ox) * LS  # [R]: the row's compact logits
        y_off = ((b * HEADS + hd) * V)[:, None] * howo + vv[None, :] * howo + (oy * Wo + ox)[:, None]
        row0 = oy * STEP - (KH - 1) // 2  # [R]: the value row of each row's scope row 0
        all_first = oy0 * STEP - (KH - 1) // 2  # the value rows of the program's scopes: [all_first, all_last)
        all_last = (tl.minimum(oy0 + BLOCK_Y, Ho) - 1) * STEP - (KH - 1) // 2 + KH
        # the products visit those in the image only (the logit gradient writes zeros at the others after the loop)
        first = tl.maximum(all_first, 0)
        last = tl.minimum(all_last, H)
        n_rows = last - first
        v_at = v_ptr + b * U * V * hw + vv[None, :] * hw + col[:, None]  # [BW, BV] at (u 0, value row 0)
        l_at = l_ptr + l_row[:, None] + kx  # [R, BW] at (u 0, scope row 0)
        if LOGIT_GRAD:
            g = tl.load(y_ptr + y_off, mask=rmask[:, None] & vmask[None, :], other=0.0)
            if WIDEN:
                g = g.to(tl.float32)
        else:
            acc = tl.zeros([BLOCK_Y * BLOCK_H * BLOCK_Q, BLOCK_V], tl.float32)
        if FUSED:
            # each output row's logits (or their gradients) at its own scope row: a batched dot over the BLOCK_Y
            # output rows, [BY, BH BQ, BC] x [BY, BC, KWP] (each logit once a program: no output row's columns
            # computed for another's rows)
            cc = tl.arange(0, BLOCK_C)
            t_kx = tl.arange(0, KWP)  # the scope columns of the logits tile
            t_row0 = (oy0 + tl.arange(0, BLOCK_Y)) * STEP - (KH - 1) // 2  # [BY]: each output row's scope row 0
            if LOGIT_GRAD:
                # column kx of row r: the window column kx + STEP j + shift of its band
                d_col = t_kx[None, :] + STEP * j[:, None] + shift
                d_ok = (t_kx < KW)[None, :] & rmask[:, None] & (d_col < BLOCK_W)
                d_idx = tl.where(d_ok, d_col, 0)  # [R, KWP]
                dq = tl.zeros([BLOCK_Y, BLOCK_H * BLOCK_Q, BLOCK_C], tl.float32)
            else:
                qf = tl.load(q_ptr + ((b * HEADS + hd) * C)[:, None] * howo + cc[None, :] * howo
                             + (oy * Wo + ox)[:, None], mask=rmask[:, None] & (cc < C)[None, :], other=0.0)
                if WIDEN:
                    qf = qf.to(tl.float32)
                qf3 = tl.reshape(qf, [BLOCK_Y, BLOCK_H * BLOCK_Q, BLOCK_C])  # (rows are output row major)
                # row r's band in its logits: column kx; the rest is masked out after the gather
                g_idx = tl.where(kmask, kx, 0)  # [R, BW]
        for i in range(0, U * n_rows):
            u = i // n_rows
            vr = first + i % n_rows
            ky = vr - row0  # [R]: the scope row of this value row, for each row
            m = kmask & ((ky >= 0) & (ky < KH))[:, None]
            vt = tl.load(v_at + (u * V * hw + vr * W), mask=cmask[:, None] & vmask[None, :],
                         other=0.0)  # [BW, BV] (a value row in the image), zero at the columns off it
            if WIDEN:
                vt = vt.to(tl.float32)
            at = l_at + ((u * KH + ky) * KW)[:, None]
            if LOGIT_GRAD:  # zero at the columns off the image (vt is)
                da = tl.dot(g, tl.trans(vt), input_precision=PREC)
                tl.store(at, da.to(l_ptr.dtype.element_ty), mask=m)
                if FUSED:  # dq += dL E^T for this scope row of each row
                    dr = _as_operand(da, v_ptr.dtype.element_ty, WIDEN)  # as the stored gradients will be
                    t_ky = vr - t_row0  # [BY]: this value row's scope row, for each output row
                    dl = tl.where(d_ok & ((ky >= 0) & (ky < KH))[:, None], tl.gather(dr, d_idx, axis=1), 0.0)
                    dl = tl.reshape(dl.to(dr.dtype), [BLOCK_Y, BLOCK_H * BLOCK_Q, KWP])
                    et = tl.load(c_ptr + cc[None, None, :] * (U * KH * KW)
                                 + ((u * KH + t_ky)[:, None, None] * KW + t_kx[None, :, None]),
                                 mask=(cc < C)[None, None, :] & (t_kx < KW)[None, :, None]
                                 & ((t_ky >= 0) & (t_ky < KH))[:, None, None], other=0.0)  # [BY, KWP, BC]
                    if WIDEN:
                        et = et.to(tl.float32)
                    dq = tl.dot(dl, et, dq, input_precision=PREC)
            elif FUSED:
                t_ky = vr - t_row0  # [BY]: the scope row of this value row, for each output row
                e = tl.load(l_ptr + cc[None, :, None] * LS
                            + ((u * KH + t_ky)[:, None, None] * KW + t_kx[None, None, :]),
                            mask=(cc < C)[None, :, None] & (t_kx < KW)[None, None, :]
                            & ((t_ky >= 0) & (t_ky < KH))[:, None, None], other=0.0)  # [BY, BC, KWP]
                if WIDEN:
                    e = e.to(tl.float32)
                la = tl.reshape(tl.dot(qf3, e, input_precision=PREC), [BLOCK_Y * BLOCK_H * BLOCK_Q, KWP])
                la = _as_operand(la, v_ptr.dtype.element_ty, WIDEN)  # [R, KWP]
                a = tl.where(m, tl.gather(la, g_idx, axis=1), 0.0)
                acc = tl.dot(a.to(la.dtype), vt, acc, input_precision=PREC)
            else:
                a = tl.load(at, mask=m, other=0.0)
                if WIDEN:
                    a = a.to(tl.float32)
                acc = tl.dot(a, vt, acc, input_precision=PREC)
        if LOGIT_GRAD:  # the scope rows off the image: zero gradients (no product)
            n_top = first - all_first
            n_off = n_top + all_last - last
            for i in range(0, U * n_off):
                u = i // n_off
                vr = tl.where(i % n_off < n_top, all_first + i % n_off, last + i % n_off - n_top)
                ky = vr - row0
                tl.store(l_at + ((u * KH + ky) * KW)[:, None],
                         tl.zeros([BLOCK_Y * BLOCK_H * BLOCK_Q, BLOCK_W], l_ptr.dtype.element_ty),
                         mask=kmask & ((ky >= 0) & (ky < KH))[:, None])
        if LOGIT_GRAD and FUSED:
            dq_at = q_ptr + ((b * HEADS + hd) * C)[:, None] * howo + cc[None, :] * howo + (oy * Wo + ox)[:, None]
            dq_mask = rmask[:, None] & (cc < C)[None, :]
            dq2 = tl.reshape(dq, [BLOCK_Y * BLOCK_H * BLOCK_Q, BLOCK_C])
            if ADD:
                dq2 += tl.load(dq_at, mask=dq_mask, other=0.0).to(tl.float32)
            tl.store(dq_at, dq2.to(q_ptr.dtype.element_ty), mask=dq_mask)
        if not LOGIT_GRAD:
            if CONTENT:
                cc = tl.arange(0, BLOCK_C)
                if FUSED:
                    qm = qf
                else:
                    qm = tl.load(q_ptr + ((b * HEADS + hd) * C)[:, None] * howo + cc[None, :] * howo
                                 + (oy * Wo + ox)[:, None], mask=rmask[:, None] & (cc < C)[None, :], other=0.0)
                cm = tl.load(c_ptr + b * C * V + cc[:, None] * V + vv[None, :],
                             mask=(cc < C)[:, None] & vmask[None, :], other=0.0)
                if WIDEN:
                    qm, cm = qm.to(tl.float32), cm.to(tl.float32)
                acc = tl.dot(qm, cm, acc, input_precision=PREC)
            tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & vmask[None, :])

    @triton.jit
    def _tc_value_grad(l_ptr, gy_ptr, gv_ptr, H, W, Ho, Wo, HEADS, U, V, KH, KW, LS, STEP: tl.constexpr,
                       PREC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_QC: tl.constexpr, WIDEN: tl.constexpr, ALIGN: tl.constexpr = 1):
        """Tensor cores: ``dv`` at ``BLOCK_P`` value columns of row ``r`` and ``BLOCK_V`` of the value channels
        (program axis 2: image, |u| and channel block), transposed: ``dv^T = sum dY^T A`` with the channels as the
        MMA's rows (64 or 128: Hopper's ``wgmma``), the columns as its columns and the contraction over (head, query)
        pairs, ``BLOCK_H`` heads by ``BLOCK_QC`` consecutive queries a step, of the output rows
        ``(r + p_y - ky) / STEP`` whose scopes reach row ``r``: only the queries whose scopes reach the program's
        columns (no atomics). ``A[(h, q), c] = L[h, q, ky, c + p_x - STEP q]`` is read from the query-major logits
        ``l`` (zero off the band). One loop over the (output row, query chunk) pairs, without branches. ``ALIGN``: the
        chunks start at a multiple of it (dY's rows 4-byte aligned in 16-bit: ``cp.async``)."""
        c0, r, z = tl.program_id(0) * BLOCK_P, tl.program_id(1), tl.program_id(2).to(tl.int64)
        n_vb = tl.cdiv(V, BLOCK_V)
        bu, v0 = z // n_vb, (z % n_vb) * BLOCK_V
        b, u = bu // U, bu % U
        c = c0 + tl.arange(0, BLOCK_P)
        pmask = c < W
        vv = v0 + tl.arange(0, BLOCK_V)
        vmask = vv < V
        k = tl.arange(0, BLOCK_H * BLOCK_QC)  # the contraction: (head, query of the chunk)
        hd, qk = k // BLOCK_QC, k % BLOCK_QC
        hmask = hd < HEADS
        howo = Ho * Wo
        # the queries whose scopes reach the columns [c0, c0 + BLOCK_P): STEP q in [c0 + p_x - KW + 1, c0 + BLOCK_P
        # - 1 + p_x], within the map; ceil(t / STEP) and floor by shifts (STEP is 1 or 2)
        t = c0 + (KW - 1) // 2 - (KW - 1)
        q_lo = tl.maximum(0, (t + STEP - 1) >> (STEP - 1))
        q_lo = tl.multiple_of(q_lo - q_lo % ALIGN, ALIGN)  # (ALIGN: the rows of dY 4-byte aligned, cp.async)
        q_hi = tl.minimum(Wo - 1, (c0 + BLOCK_P - 1 + (KW - 1) // 2) >> (STEP - 1))
        n_qc = tl.cdiv(tl.maximum(q_hi - q_lo + 1, 0), BLOCK_QC)
        # the output rows whose scope row ky = r + p_y - STEP oy is in [0, KH): oy in [oy_lo, oy_hi]
        top = r + (KH - 1) // 2
        oy_lo = tl.maximum(0, (top - (KH - 1) + STEP - 1) >> (STEP - 1))
        oy_hi = tl.minimum(Ho - 1, top >> (STEP - 1))
        head = b * HEADS + hd  # [K]
        a_ptr = l_ptr + (head * howo * LS)[:, None] + u * KH * KW + c[None, :] + (KW - 1) // 2  # [K, BP] at q 0, oy 0
        g_ptr = gy_ptr + (head * V * howo)[None, :] + vv[:, None] * howo  # [BV, K] at q 0, oy 0
        acc = tl.zeros([BLOCK_V, BLOCK_P], tl.float32)
        for i in range(0, (oy_hi - oy_lo + 1) * n_qc):
            oy = oy_lo + i // n_qc
            q = q_lo + (i % n_qc) * BLOCK_QC + qk  # [K]
            ky = top - STEP * oy
            qmask = hmask & (q < Wo)  # (past q_hi: A is zero there; Wo, not q_hi, keeps the rows' vectors whole)
            kx = c[None, :] + (KW - 1) // 2 - STEP * q[:, None]  # [K, BP]
            a = tl.load(a_ptr + ((oy * Wo + q) * LS + ky * KW - STEP * q)[:, None],
                        mask=qmask[:, None] & pmask[None, :] & (kx >= 0) & (kx < KW), other=0.0)
            g = tl.load(g_ptr + (oy * Wo + q)[None, :], mask=vmask[:, None] & qmask[None, :], other=0.0)
            if WIDEN:
                a, g = a.to(tl.float32), g.to(tl.float32)
            acc = tl.dot(g, a, acc, input_precision=PREC)
        out = ((b * U + u) * V + vv[:, None]) * (H * W) + r * W + c[None, :]
        tl.store(gv_ptr + out, acc.to(gv_ptr.dtype.element_ty), mask=vmask[:, None] & pmask[None, :])

    return dict(query_rows=_query_rows, value_grad=_value_grad, tc_rows=_tc_rows, tc_value_grad=_tc_value_grad,
                tl=tl, triton=triton)


def unavailable() -> Optional[str]:
    """Why these kernels cannot run here (None: Triton imports, and no first launch failed in this process)."""
    if kernels() is None:
        return 'needs Triton (it comes with torch on Linux x86-64)'
    return _FAILED


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: TF32 for float32 where torch's matmuls may use it, else exact."""
    return 'tf32' if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else 'ieee'


# Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) keeps bfloat16 as raw 16-bit integers: its tl.dot would
# multiply the bit patterns and its casts to bfloat16 truncate. There the tensor-core kernels widen bfloat16 tiles to
# float32 before each product (exact, as the tensor cores' products are) and write float32 results that torch rounds
# to bfloat16 (to nearest, as the GPU's conversion does).
INTERPRETED = os.environ.get('TRITON_INTERPRET', '0') == '1'


def widens(dtype: torch.dtype) -> bool:
    """Whether the tensor-core kernels widen ``dtype``'s tiles to float32 (bfloat16 under the interpreter)."""
    return INTERPRETED and dtype == torch.bfloat16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # (triton.cdiv is a constexpr function: 14 us a call on the host in Triton 3.8)


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _meta(q: Tensor, v: Tensor, table: Tensor):
    b, h, c, ho, wo = q.shape
    _, u, kh, kw = table.shape
    k = kernels()
    acc = k['tl'].float64 if q.dtype == torch.float64 else k['tl'].float32
    return b, h, c, ho, wo, u, kh, kw, v.shape[1] // u, v.shape[2], v.shape[3], acc, k


def _row_tiles(h: int, wo: int, dv: int):
    """(queries per program, heads padded to a power of 2, channels padded): about 4096 accumulators a program."""
    bh, bv = _pow2(h), _pow2(dv, 16)
    bq = max(1, min(_pow2(wo), 4096 // (bh * bv)))
    return bq, bh, bv


@functools.lru_cache(maxsize=SIZE_CACHE)  # on every call of the layer: a pure function of a few ints
def _tc_row_tiles(h: int, wo: int, kw: int, step: int, fewest_rows: bool = False):
    """Tensor-core forward tiles: ``(queries, heads padded, window columns)`` of a program. The window (a power of
    2, at least 16) is the MMA's depth: the fewest columns per query row first (the padded multiply-adds), then the
    most queries sharing them (``fewest_rows``: the fewest, 16 rows where the heads allow); the rows ``heads x
    queries`` between 16 and 128."""
    bh = _pow2(h)
    best = None
    for bq in (1, 2, 4, 8, 16, 32, 64):
        if not 16 <= bh * bq <= 128 or (bq > _pow2(wo) and bh * bq > 16):
            continue
        bw = _pow2(step * (bq - 1) + kw, 16)
        if best is None or (bw, bq if fewest_rows else -bq) < (best[2], best[0] if fewest_rows else -best[0]):
            best = (bq, bh, bw)
    return best


@functools.lru_cache(maxsize=SIZE_CACHE)
def _tc_value_tiles(kw: int, step: int, dv: int, heads: int):
    """Tensor-core value-gradient tiles: ``(value columns, heads padded, queries a contraction step, value
    channels)`` of a program. 16 columns (the fewest an MMA takes: the queries whose scopes reach them, the
    contraction, grow with the columns), the contraction ``heads x queries`` of 16 to 64 that pads the fewest queries
    beyond those the 16 columns' scopes reach (the most queries a step among them); at most 128 channels a program,
    the rest on the grid."""
    bp, bh = 16, _pow2(heads)
    window = (bp - 1 + kw - 1) // step + 1  # the queries that reach bp columns inside the map
    best = None
    for qc in (1, 2, 4, 8, 16, 32, 64):
        if bh * qc > 64 and qc > 1:
            break
        if bh * qc < 16:
            continue
        key = (_cdiv(window, qc) * qc, -qc)
        if best is None or key < best[0]:
            best = (key, qc)
    return bp, bh, best[1], min(_pow2(dv, 16), 128)


def tc_launch_meta(heads: int, c: int, dv: int, width: int, wo: int, kw: int, step: int,
                   dtype: torch.dtype = torch.float32, ho: Optional[int] = None,
                   precision: Optional[str] = None, images: Optional[int] = None, sms: Optional[int] = None,
                   height: Optional[int] = None, u: int = 1) -> dict:
    """The constants, warps and stages of the tensor-core launches at a shape (``c``: the query depth, 9 |k| at step
    2; ``ho``: the output rows, default ``wo``) for ``dtype`` operands with ``tl.dot``'s input ``precision`` (default
    :func:`_precision`): ``{'rows': {...}, 'logit_grad': {...}, 'value_grad': {...}}`` (``tc_rows`` forward, its
    logit-gradient variant, ``tc_value_grad``), each the kernel's block sizes, flags, ``num_warps`` and where set
    ``num_stages``; the forward's ``CONTENT`` is the caller's. What the wrappers launch, on every call (cached: a
    pure function of its arguments; callers copy before changing it); benchmarks/sm90_kernels.py and
    benchmarks/tune_tc_kernels.py use the same.

    Measured by the GPU check's sweep on an H200 (docs/results/gpu_h200_run5_check_layer.json, ``tc_kernels``; each
    kernel at LambdaResNet-101's three 1024 px shapes, batch 8, at the tiles of then): 16-bit rows at the fewest
    query rows (16: 1.13-1.29x against 32 at c4 and c5, one output row a program), float32 rows at one stage (no
    software pipelining of the TF32 loads: 1.10-1.30x, one case 0.97x), the value gradient at up to 128 channels a
    program (1.02-1.28x at |v| = 128 against 64).

    Inferred from that sweep, not yet measured: 64 rows a program (Hopper's ``wgmma`` takes 64) from ``BLOCK_Y``
    output rows that share each value tile, for 16-bit rows, TF32 rows (of at most 64 channels before issue 53, now
    all) and every 16-bit or TF32 logit gradient. There 64 rows by more queries (twice the padded window) ran as
    fast as 16 rows, 1.2-2.1x the work per microsecond, except TF32 rows at |v| = 128 (0.95x); output rows add 4-12%
    multiply-adds instead. Exact
    float32 keeps one row (at 64 its logit gradient spills 3.9 KB a thread on sm_90).

    Chosen for the multiply-adds that the tiles issue (benchmarks/count_macs.py, docs/results/kernel_macs.json),
    inferred, not measured: the rows' queries the most that keep the fewest window columns (8 at a 23-wide scope: 30
    of 32 columns) and so the fewest output rows a program (2: each program visits 24 value rows for 23 a row needs,
    26 at 4); the value gradient transposed, its channels the MMA's 64 or 128 rows (``wgmma``), 16 value columns a
    program (the fewest an MMA takes: 38 queries' scopes reach 16 columns at a 23-wide scope, 54 reach 32) and the
    heads in the contraction (:func:`_tc_value_tiles`), on 4 warps (none spilled, at least two programs a
    multiprocessor on sm_90: benchmarks/sm90_kernels.py). A small grid (``images`` in the launch, ``|u|``, the value
    map's ``height``, default ``width``, on a GPU of ``sms`` multiprocessors: :func:`sm_count`): while a kernel's
    grid has fewer programs than the GPU has multiprocessors, fewer output rows a program (``BLOCK_Y`` halved, down
    to 1) and fewer value-gradient channels a program (``BLOCK_V`` halved, down to 32): each program then repeats
    loads another would share, but the idle multiprocessors work. At batch 8 every default grid of
    LambdaResNet-101's three shapes already has at least 2x132 programs (unchanged); at batch 1 the c5 layer's (32 x
    32 map) had 32 (value gradient, then 32 columns a program; 64 at 16) and 64 (16-bit rows) on an H200's 132
    (docs/benchmarks.md, "GPU"; inferred, not yet measured: the GPU check's ``occupancy`` part of
    benchmarks/tune_tc_kernels.py times both). Without ``images`` and ``sms``: the tiles of a full grid.

    ``FUSED`` (forward and logit gradient): the forward computes the logits it contracts from the queries and the
    table, the logit gradient ``dq``, at stride 1, ``|k| <= 64`` and scopes up to 32 wide; elsewhere GEMMs do. The
    value gradient reads the logits from a GEMM's tensor everywhere (a multiply-add a logit; computed in its programs,
    each query's logits in every program its scope reaches: 2.3-2.5x)."""
    return _tc_launch_meta(heads, c, dv, width, wo, kw, step, dtype, wo if ho is None else ho,
                           precision or _precision(dtype), images or 0, sms or 0, height or width, u)


@functools.lru_cache(maxsize=SIZE_CACHE)
def _tc_launch_meta(heads: int, c: int, dv: int, width: int, wo: int, kw: int, step: int, dtype: torch.dtype,
                    ho: int, precision: str, images: int, sms: int, height: int, u: int) -> dict:
    sixteen = dtype in (torch.float16, torch.bfloat16)
    tf32 = dtype == torch.float32 and precision == 'tf32'
    bq, bh, bw = _tc_row_tiles(heads, wo, kw, step)
    bv = _pow2(dv, 16)
    bp, bhv, bqc, bvv = _tc_value_tiles(kw, step, dv, heads)
    by = max(1, min(64 // (bh * bq), _pow2(ho))) if sixteen or tf32 else 1  # output rows: 64 rows a program
    by_rows = by  # (TF32 rows at |v| = 128 too, since issue 53: wgmma, none spilled; inferred, not measured)
    if images and sms:  # a small grid: more programs, down to one a multiprocessor
        row_programs = _cdiv(wo, bq) * images
        while by_rows > 1 and row_programs * _cdiv(ho, by_rows) < sms:
            by_rows //= 2
        while by > 1 and row_programs * _cdiv(ho, by) < sms:
            by //= 2
        while bvv > 32 and _cdiv(width, bp) * height * images * u * _cdiv(dv, bvv) < sms:
            bvv //= 2

    # 16-bit: the value windows (rows) and the output gradients' rows (value gradient) from even columns, where the
    # window or the query chunks do not grow for it: their loads 4-byte aligned, asynchronous (cp.async, pipelined)
    align = 2 if sixteen and step * (bq - 1) + kw + 1 <= bw else 1
    c0 = 1024 * bp  # (an interior program: every program's columns start at a multiple of bp, the same parity)
    q_lo, q_hi = -((kw - 1 - (kw - 1) // 2 - c0) // step), (c0 + bp - 1 + (kw - 1) // 2) // step
    align_v = 2 if sixteen and _cdiv(q_hi - q_lo + 1 + q_lo % 2, bqc) == _cdiv(q_hi - q_lo + 1, bqc) else 1

    def rows(y):
        m = y * bh * bq
        out = dict(BLOCK_Q=bq, BLOCK_H=bh, BLOCK_W=bw, BLOCK_V=bv, BLOCK_Y=y, KWP=_pow2(kw, 16), ALIGN=align,
                   num_warps=_warps(m * bv, m * bw))
        return dict(out, num_stages=1) if dtype == torch.float32 else out
    # the forward and the value gradient compute their logits (no logits tensor) at stride 1 and scopes up to 32 wide
    # (at stride 2 the 9 |k| deep pooled queries' tile, and a wider (global) scope's logits tile, would not fit the
    # registers); the 16-bit forward of 64 rows on 4 warps (with the logits of every output row's scope row in one
    # [64, BY KWP] tile it spilled at 4 and ran on 8; with each output row's own, [64, KWP], 168-234 registers at 4
    # warps, none spilled, two programs a multiprocessor: benchmarks/sm90_kernels.py)
    fused = _fuses(step, c, kw)
    forward = dict(rows(by_rows), BLOCK_C=_pow2(c, 16), LOGIT_GRAD=False, FUSED=fused)
    return dict(rows=forward,
                logit_grad=dict(rows(by), BLOCK_C=_pow2(c, 16), LOGIT_GRAD=True, CONTENT=False, FUSED=fused),
                value_grad=dict(BLOCK_P=bp, BLOCK_H=bhv, BLOCK_QC=bqc, BLOCK_V=bvv, ALIGN=align_v, num_warps=4))


def _fuses(step: int, c: int, kw: int) -> bool:
    """Whether the tensor-core kernels compute their logits (and ``dq``) themselves: stride 1, ``|k| <= 64`` and
    scopes up to 32 wide (:func:`tc_launch_meta`)."""
    return step == 1 and c <= 64 and kw <= 32


def sm_count(device: torch.device) -> Optional[int]:
    """The multiprocessors of the GPU that holds a tensor on ``device`` (None off a GPU: Triton's interpreter keeps
    the tiles of a full grid, :func:`tc_launch_meta`)."""
    if device.type != 'cuda':
        return None
    return _cuda_sms(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _warps(*tiles: int) -> int:
    return 4 if max(tiles) <= 8192 else 8


def image_chunks(batch: int, per_image: int, chunk_elements: int):
    """``(first image, images)`` of each chunk: the fewest chunks of at most ``chunk_elements // per_image`` images,
    their sizes differing by at most one (8 images at 7 a chunk: 4 and 4, not 7 and 1)."""
    count = _cdiv(batch, max(1, chunk_elements // max(per_image, 1)))
    out, b0 = [], 0
    for i in range(count):
        n = batch // count + (i < batch % count)
        out.append((b0, n))
        b0 += n
    return out


def _logits(q: Tensor, table: Tensor) -> Tensor:
    """``[n, h, C, Ho, Wo] -> [n, h, u K_h K_w, Ho, Wo]``: the compact logits by one batched GEMM."""
    n, h, c, ho, wo = q.shape
    rt = table.reshape(c, -1).t()
    return torch.bmm(rt.expand(n * h, *rt.shape), q.reshape(n * h, c, ho * wo)).view(n, h, -1, ho, wo)


def logit_stride(scope: int) -> int:
    """The row stride of the query-major logits for ``scope = u K_h K_w`` offsets: rounded up to 8 elements (16 bytes
    in 16-bit, 32 in float32), so that the GEMMs that write and read them get cuBLAS's aligned kernels (at a row of
    529, a 23x23 scope, an H200 ran them on SIMT/unaligned kernels: 0.27 ms of a 2.2 ms layer step in float32 TF32,
    0.38 ms of 2.4 in bfloat16, at batch 8: docs/benchmarks.md, "GPU")."""
    return -(-scope // 8) * 8


def padded_table(table: Tensor) -> Tensor:
    """``[C, u, K_h, K_w] -> [C, LS]``: the table's offsets as columns, zero-padded to :func:`logit_stride`."""
    rm = table.reshape(table.shape[0], -1)
    pad = logit_stride(rm.shape[1]) - rm.shape[1]
    return torch.nn.functional.pad(rm, (0, pad)) if pad else rm  # (aligned already: no copy, no launch)


def query_major_logits(q: Tensor, table_padded: Tensor) -> Tensor:
    """``[n, h, C, Ho, Wo] -> [n h, Ho Wo, LS]``: the compact logits with each query's scope contiguous (what the
    tensor-core kernels gather their banded tiles from; the columns past ``u K_h K_w`` zero), by one batched GEMM
    with the padded table (:func:`padded_table`)."""
    n, h, c, ho, wo = q.shape
    return torch.bmm(q.reshape(n * h, c, ho * wo).transpose(1, 2), table_padded.expand(n * h, *table_padded.shape))


def forward(q: Tensor, v: Tensor, table: Tensor, step: int, content: Optional[Tensor] = None,
            tensor_cores: bool = True, chunk_elements: int = CHUNK_ELEMENTS, fused: Optional[bool] = None,
            sms: Optional[int] = None) -> Tensor:
    """The position term ``[B, h V, Ho, Wo]`` (contiguous) of the tiled kernels, plus ``q lambda^c`` for a content
    lambda ``[B, C, V]`` (inside the tensor-core kernel's accumulators). ``fused``: the tensor-core kernel computes
    its logits (default :func:`_fuses`; the plan's tiling); ``sms``: the multiprocessors the tiles are chosen for
    (default the GPU's; off a GPU none: full-grid tiles, :func:`tc_launch_meta`)."""
    check_kernel_arguments('tiled_triton.forward', q, v, table, step, content)
    b, h, c, ho, wo, u, kh, kw, dv, height, width, acc, k = _meta(q, v, table)
    q, v, table = q.contiguous(), v.contiguous(), table.contiguous()
    y = q.new_empty(b, h * dv, ho, wo)
    if y.numel() == 0:
        return y
    if tensor_cores:
        widen = widens(q.dtype)
        out = y.float() if widen else y
        if content is not None:
            content = content.contiguous()
        sms = sm_count(q.device) if sms is None else sms
        fused = _fuses(step, c, kw) if fused is None else fused  # (no logits tensor)
        # the table as the kernel reads it, [C, LS]: padded for the logits GEMM's aligned rows, as it is when fused
        tp = table.view(c, u * kh * kw) if fused else padded_table(table)
        for b0, n in [(0, b)] if fused else image_chunks(b, h * tp.shape[1] * ho * wo, chunk_elements):
            rows = tc_launch_meta(h, c, dv, width, wo, kw, step, q.dtype, ho, images=n, sms=sms, height=height,
                                  u=u)['rows']
            logits = tp if fused else query_major_logits(q[b0:b0 + n], tp)
            cn = None if content is None else content[b0:b0 + n]
            _launch(k['tc_rows'], (_cdiv(wo, rows['BLOCK_Q']), _cdiv(ho, rows['BLOCK_Y']), n), logits, v[b0:b0 + n],
                    out[b0:b0 + n], q[b0:b0 + n], logits if cn is None else cn, height, width, ho, wo, h, u, dv, c,
                    kh, kw, tp.shape[1], step, _precision(q.dtype), CONTENT=cn is not None, WIDEN=widen, **rows)
        return out.to(y.dtype) if widen else y
    bq, bh, bv = _row_tiles(h, wo, dv)
    for b0, n in image_chunks(b, h * u * kh * kw * ho * wo, chunk_elements):
        logits = _logits(q[b0:b0 + n], table)
        _launch(k['query_rows'], (_cdiv(wo, bq), ho, n), logits, v[b0:b0 + n], y[b0:b0 + n],
                height, width, ho, wo, h, u, dv, kh, kw, step, acc, bq, bh, bv, LOGIT_GRAD=False)
    return y if content is None else y + operator_content_term(q, content)


def backward(gy: Tensor, q: Tensor, v: Tensor, table: Tensor, step: int, content: Optional[Tensor] = None,
             tensor_cores: bool = True, chunk_elements: int = CHUNK_ELEMENTS, fused: Optional[bool] = None,
             sms: Optional[int] = None):
    """The gradients of ``q``, ``v``, ``table`` (contiguous; the table's summed in float32 or float64 over chunks)
    and the content lambda (an empty tensor without one). The content term's ``dq`` enters the GEMM that gives the
    position term's (one launch fewer), or at stride 1 the logit-gradient kernel adds the position term's to it; its
    ``dcontent`` is one matmul."""
    check_kernel_arguments('tiled_triton.backward', q, v, table, step, content, gy)
    b, h, c, ho, wo, u, kh, kw, dv, height, width, acc, k = _meta(q, v, table)
    q, v, table, gy = q.contiguous(), v.contiguous(), table.contiguous(), gy.contiguous()
    gq, gv = torch.empty_like(q), torch.empty_like(v)
    gcontent = v.new_empty(0)
    if content is not None:
        gq_content, gcontent = operator_content_grads(gy, q, content)
    if q.numel() == 0 or v.numel() == 0:
        gq = gq.zero_() if content is None else gq_content.contiguous()
        return gq, gv.zero_(), table.new_zeros(table.shape), gcontent
    ukk = u * kh * kw
    rm = table.view(c, ukk)
    gt = None  # the table's gradient: [c, u K_h K_w], summed over chunks in float32 (float64) where there are several
    if tensor_cores:
        # fused (stride 1): the logit-gradient kernel computes dq itself and reads the table as it is; the logits
        # GEMM (the value gradient's) and elsewhere the dq GEMM read it padded to aligned rows
        fused = _fuses(step, c, kw) if fused is None else fused
        ls = logit_stride(ukk)  # the logits' and logit gradients' row stride (aligned for the GEMMs)
        tp = padded_table(table)
        if not fused:
            rm = tp[:, :ukk]  # (dq's GEMM reads the table at the padded, aligned stride)
        chunks = image_chunks(b, h * ls * ho * wo, chunk_elements)
        prec = _precision(q.dtype)
        sms = sm_count(q.device) if sms is None else sms
        widen = widens(q.dtype)
        gvw = gv.float() if widen else gv
        if fused:  # dq written by the logit-gradient kernel, added to the content term's where there is one
            dq_buf = gq if content is None else gq_content.contiguous()
            dq_buf = dq_buf.float() if widen else dq_buf
    else:
        chunks = image_chunks(b, h * ukk * ho * wo, chunk_elements)
        bq, bh, bv = _row_tiles(h, wo, dv)
        bp = max(1, min(_pow2(-(-width // step)), 4096 // bv))
    for b0, n in chunks:
        qc, gyc = q[b0:b0 + n], gy[b0:b0 + n]
        if tensor_cores:
            meta = tc_launch_meta(h, c, dv, width, wo, kw, step, q.dtype, ho, prec, images=n, sms=sms, height=height,
                                  u=u)
            rows, vg = meta['logit_grad'], meta['value_grad']
            # [n h, Ho Wo, LS] logits by one aligned GEMM (a multiply-add a logit: fewer than the value gradient
            # computing them, each query's in every program its scope reaches), read by the value gradient
            logits = query_major_logits(qc, tp)
            _launch(k['tc_value_grad'], (_cdiv(width, vg['BLOCK_P']), height, n * u * _cdiv(dv, vg['BLOCK_V'])),
                    logits, gyc, gvw[b0:b0 + n], height, width, ho, wo, h, u, dv, kh, kw, ls, step, prec,
                    WIDEN=widen, **vg)
            del logits  # (its memory for the logit gradients)
            gl = torch.empty((n * h, ho * wo, ls), dtype=torch.float32 if widen else q.dtype, device=q.device)
            _launch(k['tc_rows'], (_cdiv(wo, rows['BLOCK_Q']), _cdiv(ho, rows['BLOCK_Y']), n), gl, v[b0:b0 + n],
                    gyc, dq_buf[b0:b0 + n] if fused else qc, rm if fused else gl, height, width, ho, wo, h, u, dv, c,
                    kh, kw, ls, step, prec, WIDEN=widen, ADD=fused and content is not None, **rows)
            gl = gl.to(q.dtype)  # the logit gradients in the 16-bit dtype, as a matmul's backward has them
            # (the kernel writes the u K_h K_w columns; the padding is never read: the GEMMs take the slice)
            # [n h, u K_h K_w, Ho Wo], leading dimension LS: the dq GEMM's, where the kernel did not compute dq
            gl_t = None if fused else gl[:, :, :ukk].transpose(1, 2)
            # [(n h Ho Wo), LS]: the dR GEMM's every operand aligned, its output [C, LS] too (the padding columns
            # are never written: their products are dropped)
            flat = gl.view(n * h * ho * wo, ls)
        else:
            logits = _logits(qc, table)  # [n, h, u K_h K_w, Ho, Wo]
            _launch(k['value_grad'], (_cdiv(width, step * bp) * step, height, n * u), logits, gyc, gv[b0:b0 + n],
                    height, width, ho, wo, h, u, dv, kh, kw, step, acc, bp, bv)
            gl = torch.empty_like(logits)
            _launch(k['query_rows'], (_cdiv(wo, bq), ho, n), gl, v[b0:b0 + n], gyc,
                    height, width, ho, wo, h, u, dv, kh, kw, step, acc, bq, bh, bv, LOGIT_GRAD=True)
            gl_t = gl.view(n * h, u * kh * kw, ho * wo)
            flat = None
        # dq = R dL (+ the content term's dq, in the same GEMM), where the kernel did not
        if not (tensor_cores and fused):
            gq_c = gq[b0:b0 + n].view(n * h, c, ho * wo)
            rm_b = rm.expand(n * h, *rm.shape)
            if content is None:
                torch.bmm(rm_b, gl_t, out=gq_c)
            else:
                torch.baddbmm(gq_content[b0:b0 + n].reshape(n * h, c, ho * wo), rm_b, gl_t, out=gq_c)
        # dR = sum over images, heads and queries of q dL^T
        if flat is not None:
            qt = qc.reshape(n * h, c, ho * wo).transpose(0, 1).reshape(c, n * h * ho * wo)
            part = torch.mm(qt, flat)[:, :ukk]
        else:
            part = torch.bmm(gl_t, qc.reshape(n * h, c, ho * wo).transpose(1, 2)).sum(0).t()
        if len(chunks) == 1:
            gt = part
        else:
            part = part.to(torch.promote_types(table.dtype, torch.float32))
            gt = part if gt is None else gt.add_(part)
    if tensor_cores and widen:
        gv.copy_(gvw)
    if tensor_cores and fused:
        gq = dq_buf.to(q.dtype)  # (the buffer itself, or rounded from the interpreter's float32 one)
    return gq, gv, gt.to(table.dtype).reshape(table.shape), gcontent


class _Triton(Tiled):
    """The tiled form by this module's kernels on CUDA tensors (on CPU tensors under Triton's interpreter,
    ``TRITON_INTERPRET=1``: the CPU tests)."""
    tensor_cores = True

    @property
    def devices(self):
        return ('cuda', 'cpu') if INTERPRETED else ('cuda',)

    def unavailable(self) -> Optional[str]:
        return unavailable()

    def not_supported_reasons(self, call: Call):
        reasons = super().not_supported_reasons(call)
        return [r + " (or Triton's interpreter, TRITON_INTERPRET=1)" if r.startswith('needs CUDA') else r
                for r in reasons]

    def kernel_tiling(self, device: str, dtype: torch.dtype, step: int, c: int, kw: int):
        """Whether the tensor-core kernels compute their logits (and ``dq``) themselves (:func:`_fuses`), and the
        logits of a chunk (:data:`CHUNK_ELEMENTS`)."""
        return (int(self.tensor_cores and _fuses(step, c, kw)), CHUNK_ELEMENTS)

    def tiled_forward(self, plan, q, v, table, step, content):
        return forward(q, v, table, step, content, self.tensor_cores, plan.tiling[1], bool(plan.tiling[0]))

    def tiled_backward(self, plan, gy, q, v, table, step, content):
        return backward(gy, q, v, table, step, content, self.tensor_cores, plan.tiling[1], bool(plan.tiling[0]))


class TritonTC(_Triton):
    """``triton_tc``: float16, bfloat16 (float32 sums) and float32 on the tensor cores (TF32 where torch's matmuls
    may use it, ``torch.backends.cuda.matmul.allow_tf32``, else exact)."""
    name = 'triton_tc'
    dtypes = (torch.float16, torch.bfloat16, torch.float32)


class TritonFMA(_Triton):
    """``triton_fma``: every float dtype on the CUDA cores; ``'auto'`` runs it for float64 calls of at most
    :data:`.plan.SMALL_CALL` queries or a map within the scope (the gemm backend's GEMMs are faster on larger ones:
    measured on an H200)."""
    name = 'triton_fma'
    tensor_cores = False

    def declines(self, call: Call) -> Optional[str]:
        if call.queries <= SMALL_CALL or call.map_in_scope:
            return None
        return (f'auto: a call of more than {SMALL_CALL} queries on a map larger than the scope runs faster as the '
                'gemm backend\'s GEMMs (docs/benchmarks.md, "GPU")')

