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

``'auto'`` picks ``'dense'`` for inputs of up to half a block window's positions (and for global scopes)
and ``'tiled'`` above (see :func:`choose_impl`). Inside ``torch.jit.trace``, a legacy ONNX export or
``torch.export``, ``'auto'`` always takes the size-independent choice (``'tiled'`` for local scopes,
``'dense'`` for global ones), so the traced graph is right at every input size.
"""
import contextlib
from typing import List

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function

from .relative_embedding import dense_embedding, dense_embedding_cached, relative_kernel, tile_embedding

__all__ = ['POSITION_IMPLS', 'position_lambdas', 'choose_impl', 'tile_size', 'tile_window']

POSITION_IMPLS = ('auto', 'einsum', 'conv', 'dense', 'tiled')


def tile_size(kernel_h: int, kernel_w: int) -> int:
    """Query block side T of the tiled form: 8 (measured best of 4, 6, 8, 12 for 23x23 and 7x7 scopes).

    A block's context window holds (T + K - 1)^2 keys for T^2 queries: large enough blocks make efficient
    GEMMs (|h| T^2 rows), small enough blocks keep the window from being mostly outside every query's scope.
    """
    return 8


def _size_independent() -> bool:
    """True while a size-specialising tracer records the graph (jit.trace, legacy ONNX, torch.export)."""
    if torch.jit.is_scripting():
        return False
    return torch.jit.is_tracing() or _compiler_flag('is_exporting')


def _graph_capture() -> bool:
    """True under TorchScript, tracers and torch.compile: plain tensor ops only (no custom autograd.Function)."""
    if torch.jit.is_scripting():
        return True
    return torch.jit.is_tracing() or _compiler_flag('is_compiling')


@torch.jit.ignore
def _compiler_flag(name: str) -> bool:
    """``torch.compiler.is_exporting()`` / ``is_compiling()`` where this torch has them."""
    flag = getattr(getattr(torch, 'compiler', None), name, None)
    return bool(flag()) if flag is not None else False


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
    # The dense form costs ~|n|^2 per image, the tiled one ~|n| x window with a larger constant: measured
    # crossovers (tools/benchmark_lambda_layer.py --sweep, CPU) at 20x20 for the 23x23 scope (window 900) and
    # 12-14 px for the 7x7 scope with |u|=4 (window 196), i.e. |n| ~ window / 2.
    return 'dense' if 2 * height * width <= window else 'tiled'


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


def _dense(q: torch.Tensor, v: torch.Tensor, table: torch.Tensor, height: int, width: int,
           global_scope: bool) -> torch.Tensor:
    b, h, k, n = q.shape
    u, dv = v.shape[1], v.shape[2]
    v = v.transpose(2, 3).reshape(b, u * n, dv)
    if _graph_capture():
        # one einsum (shape arithmetic only: traces, exports, compiles)
        kernel = relative_kernel(table, height, width, global_scope)
        emb = dense_embedding(kernel, height, width, not global_scope).to(q.dtype)  # [k, u, n, m]
        logits = torch.einsum('bhkn,kunm->bnhum', [q, emb]).reshape(b, n * h, u * n)
        y = torch.bmm(logits, v.to(logits.dtype))  # [B, n h, V]
    else:
        y = _dense_attention(q, v, dense_embedding_cached(table, height, width, not global_scope))
    return y.reshape(b, n, h, dv).permute(0, 2, 3, 1)


@torch.jit.unused
def _dense_attention(q: torch.Tensor, v: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """Eager form of the dense contraction (:class:`_DenseAttention`) in one dtype (:func:`_one_dtype`)."""
    k, u, n, m = emb.shape
    with _one_dtype(q, v) as dtype:
        q_by_position = q.permute(3, 0, 1, 2).reshape(n, -1, k).to(dtype)  # [n, B h, k]
        emb_by_position = emb.permute(2, 0, 1, 3).reshape(n, k, u * m).to(dtype)  # [n, k, u m]
        return _DenseAttention.apply(q_by_position, v.to(dtype), emb_by_position)


class _DenseAttention(torch.autograd.Function):
    """``y[b, (n, h)] = sum_m a[b, n, h, m] v[b, m]`` with ``a[., n, ., m] = q[., n, .] . E[n, :, m]``: the dense form.

    ``q [n, B h, k]``, ``v [B, m, V]``, ``E [n, k, m]`` -> ``[B, n h, V]``. Every contraction is one batched GEMM
    on contiguous operands (an einsum over these layouts copies every batch entry separately on the CPU).
    """

    @staticmethod
    def forward(ctx, q, v, emb):
        q, v, emb = q.contiguous(), v.contiguous(), emb.contiguous()
        n, bh, k = q.shape
        b, m, dv = v.shape
        h = bh // b
        logits = torch.bmm(q, emb).view(n, b, h, m).transpose(0, 1).reshape(b, n * h, m)
        ctx.save_for_backward(q, v, emb, logits)
        return torch.bmm(logits, v)

    @staticmethod
    def backward(ctx, gy):
        q, v, emb, logits = ctx.saved_tensors
        n, bh, k = q.shape
        b, m, dv = v.shape
        h = bh // b
        gy = gy.contiguous()
        gv = torch.bmm(logits.transpose(1, 2), gy)
        glogits = torch.bmm(gy, v.transpose(1, 2)).view(b, n, h, m).transpose(0, 1).reshape(n, bh, m)
        return torch.bmm(glogits, emb.transpose(1, 2)), gv, torch.bmm(q.transpose(1, 2), glogits)


def _tiled(q: torch.Tensor, v: torch.Tensor, kernel: torch.Tensor, height: int, width: int, t: int) -> torch.Tensor:
    b, h, k, n = q.shape
    u, dv = v.shape[1], v.shape[2]
    kh, kw = kernel.shape[-2], kernel.shape[-1]
    ty, tx = (height + t - 1) // t, (width + t - 1) // t  # blocks per axis
    hp, wp = ty * t, tx * t
    mh, mw = t + kh - 1, t + kw - 1  # context window of a block
    # queries by block: [B ty tx, T, T, h, k]
    qb = F.pad(q.reshape(b, h, k, height, width), [0, wp - width, 0, hp - height])
    qb = qb.reshape(b, h, k, ty, t, tx, t).permute(0, 3, 5, 4, 6, 1, 2).reshape(b * ty * tx, t, t, h, k)
    # context windows: [B ty tx, u M, V]
    vp = F.pad(v.reshape(b, u, dv, height, width),
               [(kw - 1) // 2, (kw - 1) // 2 + wp - width, (kh - 1) // 2, (kh - 1) // 2 + hp - height])
    # overlapping windows by index gathers (exportable to ONNX with dynamic sizes, unlike Tensor.unfold)
    rows = (torch.arange(ty, device=v.device)[:, None] * t + torch.arange(mh, device=v.device)).reshape(-1)
    cols = (torch.arange(tx, device=v.device)[:, None] * t + torch.arange(mw, device=v.device)).reshape(-1)
    vw = vp.index_select(3, rows).index_select(4, cols).reshape(b, u, dv, ty, mh, tx, mw)
    vw = vw.permute(0, 3, 5, 1, 4, 6, 2).reshape(b * ty * tx, u * mh * mw, dv)
    if _graph_capture():
        # one einsum with the block embedding matrix (shape arithmetic only: traces, exports and compiles)
        emb = tile_embedding(kernel, t).to(q.dtype)  # [k, u, T T, M]
        logits = torch.einsum('tnhk,kunm->tnhum', [qb.reshape(b * ty * tx, t * t, h, k), emb])
        y = torch.bmm(logits.reshape(b * ty * tx, t * t * h, u * mh * mw), vw.to(q.dtype))
    else:
        y = _banded_block_attention(qb, vw, kernel)
    y = y.reshape(b, ty, tx, t, t, h, dv).permute(0, 5, 6, 1, 3, 2, 4).reshape(b, h, dv, hp, wp)  # [B, h, V, .., ..]
    return y[:, :, :, :height, :width].reshape(b, h, dv, n)


@torch.jit.unused
def _tiled_pooled(q: torch.Tensor, v: torch.Tensor, kernel: torch.Tensor, height: int, width: int,
                  count_include_pad: bool) -> torch.Tensor:
    """The tiled form followed by 3x3 average pooling with stride 2 and padding 1, computed directly at the
    output resolution: ``out_o = 1/c_o sum_{d in 3x3} y_{2o+d} = 1/c_o sum_m (sum_d a_{2o+d, m}) v_m``, the
    nine shifted logits summed into one ``[T_o^2 h, M]`` matrix per block of ``T_o x T_o`` outputs, so the big
    GEMM runs once per output instead of once per input position (4x fewer rows). Returns
    ``[B, h, V, ceil(H/2) ceil(W/2)]``; eager only (graph capture computes the full map, then pools)."""
    b, h, k, n = q.shape
    u, dv = v.shape[1], v.shape[2]
    kh, kw = kernel.shape[-2], kernel.shape[-1]
    t = 4  # output block side: a block sees (2T + 1)^2 query positions and a (2T + K)^2 context window
    ho, wo = (height + 1) // 2, (width + 1) // 2
    ty, tx = (ho + t - 1) // t, (wo + t - 1) // t
    hop, wop = ty * t, tx * t
    mh, mw = 2 * t + kh, 2 * t + kw
    dev = q.device
    # query regions [B ty tx, 2T+1, 2T+1, h, k] around each output block (input rows 2 o - 1 .. 2 o + 1)
    qp = F.pad(q.reshape(b, h * k, height, width), [1, 2 * wop - width, 1, 2 * hop - height])
    rows = (torch.arange(ty, device=dev)[:, None] * (2 * t) + torch.arange(2 * t + 1, device=dev)).reshape(-1)
    cols = (torch.arange(tx, device=dev)[:, None] * (2 * t) + torch.arange(2 * t + 1, device=dev)).reshape(-1)
    qr = qp.index_select(2, rows).index_select(3, cols).reshape(b, h, k, ty, 2 * t + 1, tx, 2 * t + 1)
    qr = qr.permute(0, 3, 5, 4, 6, 1, 2).reshape(b * ty * tx, 2 * t + 1, 2 * t + 1, h, k)
    # context windows [B ty tx, u M, V]
    ry, rx = (kh - 1) // 2, (kw - 1) // 2
    vp = F.pad(v.reshape(b, u, dv, height, width), [1 + rx, 2 * wop - width + rx, 1 + ry, 2 * hop - height + ry])
    rows = (torch.arange(ty, device=dev)[:, None] * (2 * t) + torch.arange(mh, device=dev)).reshape(-1)
    cols = (torch.arange(tx, device=dev)[:, None] * (2 * t) + torch.arange(mw, device=dev)).reshape(-1)
    vw = vp.index_select(3, rows).index_select(4, cols).reshape(b, u, dv, ty, mh, tx, mw)
    vw = vw.permute(0, 3, 5, 1, 4, 6, 2).reshape(b * ty * tx, u * mh * mw, dv)
    with _one_dtype(qr, vw) as dtype:
        y = _PooledBandedBlockAttention.apply(qr.to(dtype), vw.to(dtype), kernel.to(dtype))
    y = y.reshape(b, ty, tx, t, t, h, dv).permute(0, 5, 6, 1, 3, 2, 4).reshape(b, h, dv, hop, wop)[..., :ho, :wo]
    if count_include_pad:
        return y.reshape(b, h, dv, ho * wo) / 9
    in_rows = 3 - (torch.arange(ho, device=dev) == 0).to(y.dtype) - (2 * torch.arange(ho, device=dev) + 1 >= height).to(y.dtype)
    in_cols = 3 - (torch.arange(wo, device=dev) == 0).to(y.dtype) - (2 * torch.arange(wo, device=dev) + 1 >= width).to(y.dtype)
    return (y / (in_rows[:, None] * in_cols[None, :])).reshape(b, h, dv, ho * wo)


def _pooled_band(buf: torch.Tensor, t: int, h: int, u: int, kh: int, kw: int, dy: int, dx: int) -> torch.Tensor:
    """Entries of the output-block logits ``buf [C, (oy ox h), (u my mx)]`` that query ``2 o + (dy, dx)`` (window
    coordinates) reaches at kernel offset ``(ky, kx)``, as a view ``[C, oy, ox, h, u, ky, kx]``."""
    mh, mw = 2 * t + kh, 2 * t + kw
    s_u = mh * mw
    s_h = u * s_u
    s_ox = h * s_h
    s_oy = t * s_ox
    return buf.as_strided((buf.shape[0], t, t, h, u, kh, kw),
                          (t * s_oy, s_oy + 2 * mw, s_ox + 2, s_h, s_u, mw, 1),
                          buf.storage_offset() + dy * mw + dx)


class _PooledBandedBlockAttention(torch.autograd.Function):
    """The tiled form summed over the nine input positions of each stride-2 output (see :func:`_tiled_pooled`).

    Inputs: ``q [G, 2T+1, 2T+1, h, k]`` query regions, ``w [G, u M, V]`` context windows, ``R [k, u, K_h, K_w]``;
    output ``[G, T T h, V]`` (sums; the caller divides by the pooling counts).
    """
    CHUNK_ROWS = 1024

    @staticmethod
    def _logits(buf, qc, rm, t, h, u, kh, kw):
        c, side = qc.shape[0], qc.shape[1]
        compact = torch.mm(qc.reshape(-1, qc.shape[-1]), rm).view(c, side, side, h, u, kh, kw)
        buf.zero_()
        for dy in range(3):
            for dx in range(3):
                _pooled_band(buf, t, h, u, kh, kw, dy, dx).add_(compact[:, dy:dy + 2 * t:2, dx:dx + 2 * t:2])
        return buf

    @staticmethod
    def forward(ctx, q, w, table):
        q, w, table = q.contiguous(), w.contiguous(), table.contiguous()
        g, side, _, h, k = q.shape
        t = (side - 1) // 2
        _, u, kh, kw = table.shape
        m, dv = w.shape[1], w.shape[2]
        chunk = max(1, _PooledBandedBlockAttention.CHUNK_ROWS // (t * t * h))
        rm = table.reshape(k, u * kh * kw)
        y = w.new_empty(g, t * t * h, dv)
        buf = w.new_empty(min(chunk, g), t * t * h, m)
        for c0 in range(0, g, chunk):
            c1 = min(g, c0 + chunk)
            logits = _PooledBandedBlockAttention._logits(buf[:c1 - c0], q[c0:c1], rm, t, h, u, kh, kw)
            torch.bmm(logits, w[c0:c1], out=y[c0:c1])
        ctx.save_for_backward(q, w, table)
        return y

    @staticmethod
    def backward(ctx, gy):
        q, w, table = ctx.saved_tensors
        g, side, _, h, k = q.shape
        t = (side - 1) // 2
        _, u, kh, kw = table.shape
        m, dv = w.shape[1], w.shape[2]
        chunk = max(1, _PooledBandedBlockAttention.CHUNK_ROWS // (t * t * h))
        rm = table.reshape(k, u * kh * kw)
        gy = gy.contiguous()
        gq = q.new_empty(q.shape)
        gw = w.new_empty(w.shape)
        grm = rm.new_zeros(rm.shape)
        buf = w.new_empty(min(chunk, g), t * t * h, m)
        for c0 in range(0, g, chunk):
            c1 = min(g, c0 + chunk)
            c = c1 - c0
            qc = q[c0:c1]
            logits = _PooledBandedBlockAttention._logits(buf[:c], qc, rm, t, h, u, kh, kw)
            torch.bmm(logits.transpose(1, 2), gy[c0:c1], out=gw[c0:c1])
            glogits = torch.bmm(gy[c0:c1], w[c0:c1].transpose(1, 2))
            gcompact = q.new_zeros(c, side, side, h, u, kh, kw)
            for dy in range(3):
                for dx in range(3):
                    gcompact[:, dy:dy + 2 * t:2, dx:dx + 2 * t:2].add_(_pooled_band(glogits, t, h, u, kh, kw, dy, dx))
            gcompact = gcompact.view(-1, u * kh * kw)
            torch.mm(gcompact, rm.t(), out=gq[c0:c1].view(-1, k))
            grm.addmm_(qc.reshape(-1, k).t(), gcompact)
        return gq, gw, grm.view_as(table)


@torch.jit.unused
def _banded_block_attention(qb: torch.Tensor, vw: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """Eager form of the tiled contraction (:class:`_BandedBlockAttention`) in one dtype (:func:`_one_dtype`)."""
    with _one_dtype(qb, vw) as dtype:
        return _BandedBlockAttention.apply(qb.to(dtype), vw.to(dtype), kernel.to(dtype))


@contextlib.contextmanager
def _one_dtype(q: torch.Tensor, v: torch.Tensor):
    """The dtype a custom contraction runs in: autocast's lower precision where it is on (as for any matmul),
    with autocast off inside; else the inputs' common dtype."""
    device = v.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):
            yield torch.get_autocast_dtype(device)
    else:
        yield torch.promote_types(q.dtype, v.dtype)


def _band(buf: torch.Tensor, t: int, h: int, u: int, kh: int, kw: int) -> torch.Tensor:
    """The band of block logits ``buf [C, (qy qx h), (u my mx)]`` as a view ``[C, qy, qx, h, u, ky, kx]``:
    entry ``(qy, qx, h, u, qy + ky, qx + kx)``. One strided view, no index tensor."""
    mh, mw = t + kh - 1, t + kw - 1
    s_u = mh * mw
    s_h = u * s_u
    s_qx = h * s_h
    s_qy = t * s_qx
    return buf.as_strided((buf.shape[0], t, t, h, u, kh, kw), (t * s_qy, s_qy + mw, s_qx + 1, s_h, s_u, mw, 1),
                          buf.storage_offset())


class _BandedBlockAttention(torch.autograd.Function):
    """``y[g, (n, h)] = sum_m a[g, n, h, m] w[g, m]``, ``a[g, n, h, n + r] = q[g, n, h] . R[r]``: the tiled form.

    Inputs: ``q [G, T, T, h, k]`` query blocks, ``w [G, u M, V]`` their context windows, ``R [k, u, K_h, K_w]``.
    Compact logits ``q R`` come from one GEMM with the small table ``R`` (no ``[T^2, k, M]`` embedding matrix
    to stream through memory) and are written into the band of a reused zero buffer by a strided view. Blocks
    go in chunks of ``CHUNK_ROWS`` query rows, so the ``[rows, M]`` logits stay cache-sized and are recomputed
    in the backward instead of being saved (memory: ``q``, ``w`` and ``R`` only).
    """
    CHUNK_ROWS = 1024

    @staticmethod
    def forward(ctx, q, w, table):
        q, w, table = q.contiguous(), w.contiguous(), table.contiguous()
        g, t, _, h, k = q.shape
        _, u, kh, kw = table.shape
        m, dv = w.shape[1], w.shape[2]
        chunk = max(1, _BandedBlockAttention.CHUNK_ROWS // (t * t * h))
        rm = table.reshape(k, u * kh * kw)
        y = w.new_empty(g, t * t * h, dv)
        buf = w.new_zeros(min(chunk, g), t * t * h, m)
        for c0 in range(0, g, chunk):
            c1 = min(g, c0 + chunk)
            logits = buf[:c1 - c0]
            _band(logits, t, h, u, kh, kw).copy_(torch.mm(q[c0:c1].reshape(-1, k), rm).view(c1 - c0, t, t, h, u, kh, kw))
            torch.bmm(logits, w[c0:c1], out=y[c0:c1])
        ctx.save_for_backward(q, w, table)
        return y

    @staticmethod
    def backward(ctx, gy):
        q, w, table = ctx.saved_tensors
        g, t, _, h, k = q.shape
        _, u, kh, kw = table.shape
        m, dv = w.shape[1], w.shape[2]
        chunk = max(1, _BandedBlockAttention.CHUNK_ROWS // (t * t * h))
        rm = table.reshape(k, u * kh * kw)
        gy = gy.contiguous()
        gq = q.new_empty(q.shape)
        gw = w.new_empty(w.shape)
        grm = rm.new_zeros(rm.shape)
        buf = w.new_zeros(min(chunk, g), t * t * h, m)
        for c0 in range(0, g, chunk):
            c1 = min(g, c0 + chunk)
            qc = q[c0:c1].reshape(-1, k)
            logits = buf[:c1 - c0]
            _band(logits, t, h, u, kh, kw).copy_(torch.mm(qc, rm).view(c1 - c0, t, t, h, u, kh, kw))
            torch.bmm(logits.transpose(1, 2), gy[c0:c1], out=gw[c0:c1])
            glogits = torch.bmm(gy[c0:c1], w[c0:c1].transpose(1, 2))
            gcompact = _band(glogits, t, h, u, kh, kw).reshape(-1, u * kh * kw)
            torch.mm(gcompact, rm.t(), out=gq[c0:c1].view(-1, k))
            grm.addmm_(qc.t(), gcompact)
        return gq, gw, grm.view_as(table)


def position_lambdas(q: torch.Tensor, v: torch.Tensor, table: torch.Tensor, height: int, width: int,
                     impl: str, global_scope: bool, tile: int, stride: int = 1,
                     count_include_pad: bool = False) -> torch.Tensor:
    """``y_n^h = (lambda^p_n)^T q_n^h`` for every query: ``q [B, h, k, n], v [B, u, V, n] -> [B, h, V, n]``.

    ``table`` is the relative embedding ``[k, u, R_h, R_w]`` (:class:`RelativePositionEmbedding`), ``impl``
    one of :data:`POSITION_IMPLS`, ``tile`` the block side of the tiled form (:func:`tile_size` of the
    table). ``stride=2``: the result average-pooled (3x3, stride 2, padding 1; ``count_include_pad`` as
    ``nn.AvgPool2d``), ``[B, h, V, ceil(H/2) ceil(W/2)]``. An FX leaf: its Python size logic runs at call
    time, not at trace time.
    """
    if global_scope and not torch.jit.is_tracing() and (
            2 * height - 1 > table.shape[-2] or 2 * width - 1 > table.shape[-1]):
        raise ValueError(f'input of {height}x{width} is larger than max_size=({(table.shape[-2] + 1) // 2}, '
                         f'{(table.shape[-1] + 1) // 2}) of the global position embedding; build the layer '
                         f'with a larger max_size (img_size) or use a local scope')
    window = (tile + table.shape[-2] - 1) * (tile + table.shape[-1] - 1)
    impl = choose_impl(impl, height, width, window, global_scope)
    if impl == 'tiled' and stride == 2 and not _graph_capture():
        return _tiled_pooled(q, v, relative_kernel(table, height, width, global_scope), height, width,
                             count_include_pad)
    if impl == 'dense':
        y = _dense(q, v, table, height, width, global_scope)
    else:
        kernel = relative_kernel(table, height, width, global_scope)
        if impl == 'tiled':
            y = _tiled(q, v, kernel, height, width, tile)
        elif impl == 'conv':
            y = _conv(q, v, kernel, height, width)
        elif impl == 'einsum':
            y = _einsum(q, v, kernel, height, width, not global_scope)
        else:
            raise ValueError("impl must be one of 'auto', 'einsum', 'conv', 'dense', 'tiled', got '" + impl + "'")
    if stride == 1:
        return y
    b, h, dv = y.shape[0], y.shape[1], y.shape[2]
    y = F.avg_pool2d(y.reshape(b, h * dv, height, width), 3, 2, 1, count_include_pad=count_include_pad)
    return y.reshape(b, h, dv, y.shape[-2] * y.shape[-1])


# An FX leaf for timm's feature extraction; modules that call it also declare torch.fx.wrap('position_lambdas')
# (torch.fx.wrap patches the caller's global name) so that plain torch.fx.symbolic_trace works too.
register_notrace_function(position_lambdas)
