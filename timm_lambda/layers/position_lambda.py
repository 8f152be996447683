"""Position lambdas applied to the queries: ``y_n^h = (lambda^p_n)^T q_n^h`` (LambdaNetworks eq. 1-2, section 3.3).

With ``lambda^p_n = sum_m E_nm v_m^T`` and ``E_nm = R[m - n]`` (relative embeddings, intra-depth |u| summed),
the output of one query head is::

    y_n^h = sum_{u, m} (q_n^h . R[m - n, u]) v_{m, u}                                        in R^{|v|}

Every form takes ``q [B, h, k, n]``, ``v [B, u, V, n]`` (``n = H * W``, row-major) and returns ``[B, h, V, n]``:

* ``'einsum'``: the lambda form of Fig. 3: gather ``E [k, u, n, m]``, contract it with the values into
  ``lambda^p [B, n, k, V]``, then apply the queries. Memory grows with ``|n|^2``. Reference.
* ``'conv'``: the lambda convolution (section 3.4, appendix C.1): ``lambda^p`` by a 3-D convolution with the
  value depth as an extra axis. Reference (its CPU backward is slow).
* ``'dense'``: the attention form: logits ``a_nm = q_n . E_nm`` for all pairs, then ``y = a v``: ``|h| (|k| + |v|)``
  instead of ``|k| |v|`` per (n, m) pair, all batched GEMMs.
* ``'tiled'``: the attention form on ``T x T`` query blocks, each against its context window (the block plus
  a halo of the scope radius). Translation equivariance makes the block-to-window embedding the same for
  every block (:func:`~.relative_embedding.block_embedding`), so every contraction is a batched GEMM and memory
  grows with ``|n|`` times the window. A stride-2 layer (3x3 average pooling after it, appendix F.2) is
  computed at the output resolution: pooling is linear, so an output's logits are the sum of its nine
  inputs' logits, one GEMM of the queries' 3x3 patches against the nine shifted kernels (4x fewer rows).

``'einsum'`` and ``'conv'`` are references for tests and benchmarks; ``'auto'`` picks ``'dense'`` or ``'tiled'``
(:func:`choose_impl`). ``'dense'`` and ``'tiled'`` each have two executions of the same arithmetic:

* **kernels** (``timm_lambda::dense_attention``, ``timm_lambda::banded_attention``): custom operators with a
  hand-written backward. Blocks go in chunks whose logits stay cache-sized on a CPU (one chunk per layer on
  other devices) and are recomputed in the backward instead of being saved. Eager mode and
  ``torch.compile`` (an opaque node of the compiled graph; the glue around it is compiled).
* **graphs** (:func:`_dense_graph`, :func:`_banded_graph`): plain tensor ops, shape arithmetic only. TorchScript,
  ``jit.trace``, both ONNX exporters, ``torch.export``, ``torch.func`` transforms, and higher-order gradients
  (a kernel's backward differentiates the graph form when ``create_graph=True``). Inside a size-specialising
  trace or export, ``'auto'`` takes the size-independent choice (``'tiled'``, or ``'dense'`` for a global
  scope), so the traced graph is right at every input size.
"""
import warnings
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from timm.layers import register_notrace_function

from .._compat import DYNAMO_FOLDS_FUNCTORCH_FLAG
from .checks import check_max_size
from .relative_embedding import block_embedding, dense_embedding, dense_embedding_cached, relative_kernel

__all__ = ['POSITION_IMPLS', 'TILE', 'POOLED_TILE', 'position_lambdas', 'choose_impl', 'tile_window',
           'warn_torchscript']

POSITION_IMPLS = ('auto', 'einsum', 'conv', 'dense', 'tiled')


def _tile() -> int:
    """Query block side of the tiled form: measured best of 4, 6, 8, 12 (23x23 and 7x7 scopes, CPU)."""
    return 8


def _pooled_tile() -> int:
    """Output block side of the stride-2 tiled form (8x8 inputs)."""
    return 4


TILE, POOLED_TILE = _tile(), _pooled_tile()  # (functions: TorchScript reads no module-level ints)
CPU_CHUNK_ROWS = 512  # logit rows (queries x heads) of one kernel chunk on a CPU: cache-sized (measured 256-1024 best)
DEVICE_CHUNK_ELEMENTS = 1 << 26  # logits of one chunk elsewhere (256 MiB in float32): one chunk per layer


# ----------------------------------------------------------------------------------------------------------
# execution mode and the 'auto' rule


def _size_independent() -> bool:
    """True while a size-specialising tracer records the graph (jit.trace, legacy ONNX, torch.export)."""
    if torch.jit.is_scripting():
        return False
    return torch.jit.is_tracing() or _compiler_flag('is_exporting')


def _use_kernels() -> bool:
    """True where the custom operators run: eager mode and torch.compile, outside torch.func transforms
    (TorchScript, tracers and exporters record the graph forms instead)."""
    if torch.jit.is_scripting():
        return False
    return not (torch.jit.is_tracing() or _compiler_flag('is_exporting') or _functorch_active())


@torch.jit.ignore
def _compiler_flag(name: str) -> bool:
    """``torch.compiler.is_exporting()`` / ``is_compiling()`` where this torch has them."""
    flag = getattr(getattr(torch, 'compiler', None), name, None)
    return bool(flag()) if flag is not None else False


_WARNED = set()


@torch.jit.ignore
def _warn_once(key: str, message: str) -> None:
    """One RuntimeWarning per process and ``key``."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@torch.jit.ignore
def _note_graph_form() -> None:
    """Warn once where the slower graph forms run instead of the kernels for a reason other than a trace or
    an export (which record the graph forms by design): inside torch.func transforms."""
    if _functorch_active():
        _warn_once('functorch', 'timm_lambda: inside torch.func transforms the position lambdas run as plain tensor '
                                'ops (the kernels have no batching rules): correct, but slower and with more memory '
                                'than in eager mode (docs/execution_modes.md)')


@torch.jit.ignore
def _functorch_active() -> bool:
    """True inside a ``torch.func`` transform (grad, vmap, jacrev, jvp, ...)."""
    if not DYNAMO_FOLDS_FUNCTORCH_FLAG and _compiler_flag('is_compiling'):
        return False  # torch 2.4: dynamo cannot trace the flag below (timm_lambda/_compat.py)
    active = getattr(torch._C, '_are_functorch_transforms_active', None)
    return bool(active()) if active is not None else False


def warn_torchscript() -> None:
    """Called when a layer is scripted (``__prepare_scriptable__``): once per process, say that TorchScript runs
    the graph forms (a scripted model must load without this package's custom operators)."""
    _warn_once('torchscript', 'timm_lambda: TorchScript runs the position lambdas as plain tensor ops (a scripted '
                              'model must load without this package\'s custom operators): inference is fine, training '
                              'is 4-5x slower per lambda layer than eager mode or torch.compile '
                              '(docs/execution_modes.md)')


def tile_window(kernel_h: int, kernel_w: int) -> int:
    """Context positions of one query block of the tiled form: ``(T + K_h - 1)(T + K_w - 1)``."""
    return (_tile() + kernel_h - 1) * (_tile() + kernel_w - 1)


def choose_impl(impl: str, height: int, width: int, window: int, global_scope: bool) -> str:
    """The implementation ``impl`` resolves to for an ``height x width`` input (the ``'auto'`` rule).

    ``window`` is the number of context positions of one query block of the tiled form (:func:`tile_window`).
    The dense form computes ``|n|^2`` (query, context) pairs, the tiled one ``n_pad x window`` (its queries padded
    to whole 8x8 blocks, each against its block's window) at about a quarter of the cost per pair: dense while
    ``4 |n|^2 <= n_pad x window``. Measured (docs/results/sweep_scope23.json, sweep_scope7_u4.json, 2 CPU cores):
    the rule picks the clearly faster form at every size where one is (23x23 scope: dense up to 14 px, tiled
    from 22 px; 7x7 scope with |u|=4: dense at 5-7 and 9 px, tiled from 12 px; tests/test_lambda_impl_rule.py);
    at 16-20 px and at 8 and 10 px the two forms are within each other's spread. The rule is the same on every
    device (no GPU measurement exists yet).
    """
    if impl != 'auto':
        return impl
    if global_scope:
        return 'dense'
    if _size_independent():
        return 'tiled'
    t = _tile()
    padded = ((height + t - 1) // t) * ((width + t - 1) // t) * t * t
    return 'dense' if 4 * (height * width) ** 2 <= padded * window else 'tiled'


def _chunk_blocks(device: torch.device, rows_per_block: int, columns: int) -> int:
    """Query blocks per kernel chunk: ``CPU_CHUNK_ROWS`` logit rows on a CPU, ``DEVICE_CHUNK_ELEMENTS`` logits
    elsewhere (a GPU runs a layer in one chunk: a few launches instead of a loop of small kernels)."""
    if device.type == 'cpu':
        return max(1, CPU_CHUNK_ROWS // rows_per_block)
    return max(1, DEVICE_CHUNK_ELEMENTS // (rows_per_block * columns))


@torch.jit.unused
def _kernel_dtype(*tensors: Tensor) -> Tuple[torch.dtype, bool]:
    """The one dtype a kernel runs in, and whether autocast is on: autocast's lower precision where it is on
    (as for any matmul), else the inputs' common dtype."""
    device = tensors[0].device.type
    # cpu / cuda first: torch 2.4's dynamo cannot trace is_autocast_available (a graph break there)
    available = device in ('cpu', 'cuda') or torch.amp.is_autocast_available(device)
    if available and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device), True
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype, False


def _run_kernel(op, tensors: Sequence[Tensor], *args):
    """Call a kernel with its tensors contiguous and in one dtype, autocast off inside."""
    dtype, autocast = _kernel_dtype(*tensors)
    tensors = [t.to(dtype).contiguous() for t in tensors]
    if autocast:
        with torch.autocast(tensors[0].device.type, enabled=False):
            return op(*tensors, *args)
    return op(*tensors, *args)


@torch.jit.unused
def _graph_vjp(graph, inputs: Tuple[Tensor, ...], args: tuple, grad: Tensor, needs: Sequence[bool]):
    """Vector-Jacobian product of ``graph(*inputs, *args)`` that is itself differentiable: a kernel's
    backward when higher-order gradients are requested (``create_graph=True``)."""
    _warn_once('create_graph', 'timm_lambda: higher-order gradients (create_graph=True) differentiate the plain-op '
                               'form of the position lambdas: correct, but slower and with more memory than the '
                               'first-order kernels (docs/execution_modes.md)')
    with torch.enable_grad():
        out = graph(*inputs, *args)
    wrt = [x for x, need in zip(inputs, needs) if need]
    got = iter(torch.autograd.grad(out, wrt, grad, create_graph=True, allow_unused=True)) if wrt else iter(())
    grads = []
    for x, need in zip(inputs, needs):
        g = next(got) if need else None
        grads.append(torch.zeros_like(x) if need and g is None else g)
    return tuple(grads)


# ----------------------------------------------------------------------------------------------------------
# references: the lambda form (Fig. 3) and the lambda convolution (section 3.4)


def _einsum(q: Tensor, v: Tensor, kernel: Tensor, height: int, width: int, masked: bool) -> Tensor:
    emb = dense_embedding(kernel, height, width, masked).to(v.dtype)  # [k, u, n, m]
    lambdas = torch.einsum('kunm,buvm->bnkv', [emb, v])  # lambda^p_n (eq. 1)
    return torch.einsum('bhkn,bnkv->bhvn', [q, lambdas.to(q.dtype)])  # (lambda^p_n)^T q_n (eq. 2)


def _conv(q: Tensor, v: Tensor, kernel: Tensor, height: int, width: int) -> Tensor:
    b, u, dv = v.shape[0], v.shape[1], v.shape[2]
    k, kh, kw = kernel.shape[0], kernel.shape[-2], kernel.shape[-1]
    # [B, u, V, H, W] * [k, u, 1, kh, kw] -> lambda^p [B, k, V, H, W]; explicit padding: a global kernel's
    # size follows the input, and a tracer records F.pad's amounts but freezes conv3d's padding argument
    vp = F.pad(v.reshape(b, u, dv, height, width), [(kw - 1) // 2, (kw - 1) // 2, (kh - 1) // 2, (kh - 1) // 2])
    lambdas = F.conv3d(vp, kernel.unsqueeze(2).to(v.dtype))
    return torch.einsum('bhkn,bkvn->bhvn', [q, lambdas.reshape(b, k, dv, height * width).to(q.dtype)])


# ----------------------------------------------------------------------------------------------------------
# the dense form: q [n, B h, k], v [B, u m, V], E [n, k, u m] -> y [B, n h, V]


def _dense_graph(q: Tensor, v: Tensor, emb: Tensor, heads: int) -> Tensor:
    """``y[b, (n, h)] = sum_m (q[n, (b, h)] . E[n, :, m]) v[b, m]``, in plain ops."""
    n = q.shape[0]
    b, m = v.shape[0], v.shape[1]
    logits = torch.bmm(q, emb.to(q.dtype)).reshape(n, b, heads, m).transpose(0, 1).reshape(b, n * heads, m)
    return torch.bmm(logits, v.to(logits.dtype))


@torch.library.custom_op('timm_lambda::dense_attention', mutates_args=())
def _dense_attention(q: Tensor, v: Tensor, emb: Tensor, heads: int) -> Tensor:
    """The dense form's kernel: every contraction one batched GEMM on contiguous operands (an einsum over
    these layouts copies every batch entry separately on the CPU)."""
    return _dense_graph(q.contiguous(), v.contiguous(), emb.contiguous(), heads).contiguous()


@_dense_attention.register_fake
def _(q, v, emb, heads):
    return v.new_empty(v.shape[0], q.shape[0] * heads, v.shape[2])


@torch.library.custom_op('timm_lambda::dense_attention_backward', mutates_args=())
def _dense_attention_backward(gy: Tensor, q: Tensor, v: Tensor, emb: Tensor, heads: int
                              ) -> Tuple[Tensor, Tensor, Tensor]:
    q, v, emb, gy = q.contiguous(), v.contiguous(), emb.contiguous(), gy.contiguous()
    n, bh, k = q.shape
    b, m = v.shape[0], v.shape[1]
    logits = torch.bmm(q, emb).view(n, b, heads, m).transpose(0, 1).reshape(b, n * heads, m)  # recomputed
    gv = torch.bmm(logits.transpose(1, 2), gy)
    glogits = torch.bmm(gy, v.transpose(1, 2)).view(b, n, heads, m).transpose(0, 1).reshape(n, bh, m)
    gq, gemb = torch.bmm(glogits, emb.transpose(1, 2)), torch.bmm(q.transpose(1, 2), glogits)
    return gq.contiguous(), gv.contiguous(), gemb.contiguous()  # bmm may hand back a transposed layout


@_dense_attention_backward.register_fake
def _(gy, q, v, emb, heads):
    return q.new_empty(q.shape), v.new_empty(v.shape), emb.new_empty(emb.shape)  # contiguous, as the kernel's


def _dense_setup(ctx, inputs, output):
    q, v, emb, heads = inputs
    ctx.save_for_backward(q, v, emb)
    ctx.heads = heads


def _dense_backward(ctx, gy):
    q, v, emb = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: a differentiable backward
        grads = _graph_vjp(_dense_graph, (q, v, emb), (ctx.heads,), gy, ctx.needs_input_grad[:3])
    else:
        grads = _dense_attention_backward(gy, q, v, emb, ctx.heads)
    return grads[0], grads[1], grads[2], None


_dense_attention.register_autograd(_dense_backward, setup_context=_dense_setup)


@torch.jit.unused
def _dense_kernel(q: Tensor, v: Tensor, table: Tensor, height: int, width: int, global_scope: bool,
                  heads: int) -> Tensor:
    k, u, n = table.shape[0], table.shape[1], height * width
    emb = dense_embedding_cached(table, height, width, not global_scope)  # [k, u, n, m]
    emb = emb.permute(2, 0, 1, 3).reshape(n, k, u * n)
    return _run_kernel(_dense_attention, (q, v, emb), heads)


def _dense(q: Tensor, v: Tensor, table: Tensor, height: int, width: int, global_scope: bool,
           kernels: bool) -> Tensor:
    b, h, k, n = q.shape
    u, dv = v.shape[1], v.shape[2]
    q_by_position = q.permute(3, 0, 1, 2).reshape(n, b * h, k)
    v_by_position = v.transpose(2, 3).reshape(b, u * n, dv)
    if kernels:
        y = _dense_kernel(q_by_position, v_by_position, table, height, width, global_scope, h)
    else:
        kernel = relative_kernel(table, height, width, global_scope)
        emb = dense_embedding(kernel, height, width, not global_scope).permute(2, 0, 1, 3).reshape(n, k, u * n)
        y = _dense_graph(q_by_position, v_by_position, emb, h)
    return y.reshape(b, n, h, dv).permute(0, 2, 3, 1)


# ----------------------------------------------------------------------------------------------------------
# the tiled form: q [G, T, T, h, c] query blocks, vp [B, H', W', u V] padded values (channels last),
# R [c, u, K_h, K_w]; block g = (b, by, bx) sees the window vp[b, s T by + (0..M_h), s T bx + (0..M_w)],
# M = s (T - 1) + K, with query (qy, qx) at window position (s qy, s qx) (s = step) -> y [G, T T h, V]


def _banded_graph(q: Tensor, vp: Tensor, table: Tensor, step: int, blocks_y: int, blocks_x: int,
                  kernel_size: Optional[List[int]] = None) -> Tensor:
    """The tiled contraction in plain ops: windows by two index gathers, logits by one matmul with the
    block embedding (:func:`~.relative_embedding.block_embedding`), then one batched GEMM. ``kernel_size``:
    the table's ``[K_h, K_w]`` as Python ints where they are fixed (see ``block_embedding``)."""
    g, h, c = q.shape[0], q.shape[3], q.shape[4]
    t = _tile() if step == 1 else _pooled_tile()  # a Python int, never a traced size: the index is a constant
    b, hv, cv = vp.shape[0], vp.shape[1], vp.shape[3]
    u = table.shape[1]
    if kernel_size is None:
        kh, kw = table.shape[2], table.shape[3]
    else:
        kh, kw = kernel_size[0], kernel_size[1]
    dv = cv // u
    mh, mw = step * (t - 1) + kh, step * (t - 1) + kw
    # every window position of every block as one index into the flattened values: one gather whose rows
    # are whole channel vectors, in block order (a permute of gathered windows would make torch.export guard
    # on the number of blocks being 1 and specialise the input size)
    dev = vp.device
    by = torch.arange(blocks_y, device=dev) * (step * t)
    bx = torch.arange(blocks_x, device=dev) * (step * t)
    rows = by[:, None, None, None] + torch.arange(mh, device=dev)[None, None, :, None]  # [by, 1, my, 1]
    cols = bx[None, :, None, None] + torch.arange(mw, device=dev)[None, None, None, :]  # [1, bx, 1, mx]
    index = (rows * vp.shape[2] + cols).reshape(blocks_y * blocks_x * mh * mw)
    w = vp.reshape(b, hv * vp.shape[2], cv).index_select(1, index).reshape(g, mh * mw * u, dv)
    emb = block_embedding(table, t, step, kernel_size).to(q.dtype)  # [T T, c, M u]
    logits = torch.matmul(q.reshape(g, t * t, h, c), emb).reshape(g, t * t * h, mh * mw * u)
    return torch.bmm(logits, w.to(logits.dtype))


def _windows(vp: Tensor, b: int, by: int, rows: int, bx: int, cols: int, shift: int, mh: int, mw: int,
             every: int = 1) -> Tensor:
    """Context windows of ``rows x cols`` blocks from block ``(by, bx)`` of image ``b`` (every ``every``-th block
    column) as one strided view ``[rows, cols, M_h, M_w, C]`` of the contiguous ``vp [B, H', W', C]``."""
    _, hv, wv, cv = vp.shape
    offset = vp.storage_offset() + ((b * hv + by * shift) * wv + bx * shift) * cv
    return vp.as_strided((rows, cols, mh, mw, cv), (shift * wv * cv, every * shift * cv, wv * cv, cv, 1), offset)


def _band(buf: Tensor, t: int, h: int, u: int, kh: int, kw: int, mw: int, step: int) -> Tensor:
    """The band of block logits ``buf [C, (qy qx h), (my mx u)]`` as a view ``[C, qy, qx, h, u, ky, kx]``:
    entry ``(qy, qx, h, my = step qy + ky, mx = step qx + kx, u)``. One strided view, no index tensor."""
    s_h = buf.shape[2]
    s_qx, s_my = h * s_h, mw * u
    s_qy = t * s_qx
    return buf.as_strided((buf.shape[0], t, t, h, u, kh, kw),
                          (t * s_qy, s_qy + step * s_my, s_qx + step * u, s_h, 1, s_my, u), buf.storage_offset())


def _chunks(batch: int, blocks_y: int, blocks_x: int, per_chunk: int) -> List[Tuple[int, int, int, int, int]]:
    """``(image, first block row, block rows, first block column, block columns)`` of each kernel chunk:
    whole block rows of one image, or a part of one row, so that a chunk's windows are one strided view."""
    out = []
    for b in range(batch):
        if per_chunk >= blocks_x:
            rows = per_chunk // blocks_x
            for by in range(0, blocks_y, rows):
                out.append((b, by, min(rows, blocks_y - by), 0, blocks_x))
        else:
            for by in range(blocks_y):
                for bx in range(0, blocks_x, per_chunk):
                    out.append((b, by, 1, bx, min(per_chunk, blocks_x - bx)))
    return out


class _BandedPlan:
    """Shapes, chunks and reusable buffers of one kernel call (forward or backward)."""

    def __init__(self, q: Tensor, vp: Tensor, table: Tensor, step: int, blocks_y: int, blocks_x: int):
        self.g, self.t, _, self.h, self.c = q.shape
        self.batch, _, _, self.cv = vp.shape
        _, self.u, self.kh, self.kw = table.shape
        self.dv = self.cv // self.u
        self.step, self.blocks_y, self.blocks_x = step, blocks_y, blocks_x
        self.mh, self.mw = step * (self.t - 1) + self.kh, step * (self.t - 1) + self.kw
        self.rows = self.t * self.t * self.h  # logit rows of a block
        self.cols = self.mh * self.mw * self.u  # logit columns of a block
        per_chunk = _chunk_blocks(q.device, self.rows, self.cols)
        self.chunks = _chunks(self.batch, blocks_y, blocks_x, per_chunk)
        n = min(per_chunk, max(self.g, 1))
        self.logits = vp.new_zeros(n, self.rows, self.cols)  # off-band entries stay zero
        self.windows = vp.new_empty(n, self.mh, self.mw, self.cv)
        self.compact = vp.new_empty(n * self.rows, self.u * self.kh * self.kw)

    def block_logits(self, q: Tensor, vp: Tensor, rm: Tensor, chunk) -> Tuple[int, int, Tensor, Tensor]:
        """Windows and band logits of one chunk: ``(first block, blocks, logits [n, rows, cols],
        windows [n, M u, V])``; the compact logits ``q R`` come from one GEMM with the small table."""
        b, by, nr, bx, nc = chunk
        g0, n = (b * self.blocks_y + by) * self.blocks_x + bx, nr * nc
        windows = self.windows[:n]
        windows.view(nr, nc, self.mh, self.mw, self.cv).copy_(
            _windows(vp, b, by, nr, bx, nc, self.step * self.t, self.mh, self.mw))
        compact = self.compact[:n * self.rows]
        torch.mm(q[g0:g0 + n].view(n * self.rows, self.c), rm, out=compact)
        logits = self.logits[:n]
        _band(logits, self.t, self.h, self.u, self.kh, self.kw, self.mw, self.step).copy_(
            compact.view(n, self.t, self.t, self.h, self.u, self.kh, self.kw))
        return g0, n, logits, windows.view(n, self.mh * self.mw * self.u, self.dv)


def _banded_forward(q: Tensor, vp: Tensor, table: Tensor, step: int, blocks_y: int, blocks_x: int) -> Tensor:
    q, vp, table = q.contiguous(), vp.contiguous(), table.contiguous()
    p = _BandedPlan(q, vp, table, step, blocks_y, blocks_x)
    y = vp.new_empty(p.g, p.rows, p.dv)
    rm = table.view(p.c, p.u * p.kh * p.kw)
    for chunk in p.chunks:
        g0, n, logits, windows = p.block_logits(q, vp, rm, chunk)
        torch.bmm(logits, windows, out=y[g0:g0 + n])
    return y


def _banded_backward(gy: Tensor, q: Tensor, vp: Tensor, table: Tensor, step: int, blocks_y: int,
                     blocks_x: int) -> Tuple[Tensor, Tensor, Tensor]:
    q, vp, table, gy = q.contiguous(), vp.contiguous(), table.contiguous(), gy.contiguous()
    p = _BandedPlan(q, vp, table, step, blocks_y, blocks_x)
    rm = table.view(p.c, p.u * p.kh * p.kw)
    gq = torch.empty_like(q)
    gvp = torch.zeros_like(vp)
    grm = torch.zeros(rm.shape, dtype=torch.promote_types(rm.dtype, torch.float32), device=rm.device)
    n_max = p.logits.shape[0]
    gwindows = vp.new_empty(n_max, p.mh * p.mw * p.u, p.dv)
    glogits = vp.new_empty(n_max, p.rows, p.cols)
    gcompact = vp.new_empty(n_max * p.rows, p.u * p.kh * p.kw)
    phases = -(-p.mw // (step * p.t))  # windows of blocks this many columns apart do not overlap
    for chunk in p.chunks:
        b, by, nr, bx, nc = chunk
        g0, n, logits, windows = p.block_logits(q, vp, rm, chunk)
        gyc = gy[g0:g0 + n]
        gw = gwindows[:n]
        torch.bmm(logits.transpose(1, 2), gyc, out=gw)
        gw = gw.view(nr, nc, p.mh, p.mw, p.cv)
        for r in range(nr):  # overlap-add into the padded values: one non-overlapping set of windows at a time
            for phase in range(min(phases, nc)):
                count = len(range(phase, nc, phases))
                _windows(gvp, b, by + r, 1, bx + phase, count, step * p.t, p.mh, p.mw, phases).add_(
                    gw[r:r + 1, phase::phases])
        gl = glogits[:n]
        torch.bmm(gyc, windows.transpose(1, 2), out=gl)
        gc = gcompact[:n * p.rows]
        gc.view(n, p.t, p.t, p.h, p.u, p.kh, p.kw).copy_(_band(gl, p.t, p.h, p.u, p.kh, p.kw, p.mw, step))
        torch.mm(gc, rm.t(), out=gq[g0:g0 + n].view(n * p.rows, p.c))
        qc = q[g0:g0 + n].view(n * p.rows, p.c)
        if grm.dtype == gc.dtype:
            grm.addmm_(qc.t(), gc)
        else:  # accumulate a low-precision table gradient in float32
            grm.add_(torch.mm(qc.t(), gc))
    return gq, gvp, grm.to(table.dtype).view_as(table)


@torch.library.custom_op('timm_lambda::banded_attention', mutates_args=())
def _banded_attention(q: Tensor, vp: Tensor, table: Tensor, step: int, blocks_y: int, blocks_x: int) -> Tensor:
    """The tiled form's kernel: compact logits ``q R`` by one GEMM with the small table, written into the
    band of a reused zero buffer through a strided view, then one batched GEMM with the chunk's windows."""
    return _banded_forward(q, vp, table, step, blocks_y, blocks_x)


@_banded_attention.register_fake
def _(q, vp, table, step, blocks_y, blocks_x):
    return vp.new_empty(q.shape[0], q.shape[1] * q.shape[2] * q.shape[3], vp.shape[3] // table.shape[1])


@torch.library.custom_op('timm_lambda::banded_attention_backward', mutates_args=())
def _banded_attention_backward(gy: Tensor, q: Tensor, vp: Tensor, table: Tensor, step: int, blocks_y: int,
                               blocks_x: int) -> Tuple[Tensor, Tensor, Tensor]:
    return _banded_backward(gy, q, vp, table, step, blocks_y, blocks_x)


@_banded_attention_backward.register_fake
def _(gy, q, vp, table, step, blocks_y, blocks_x):
    return q.new_empty(q.shape), vp.new_empty(vp.shape), table.new_empty(table.shape)  # contiguous, as the kernel's


def _banded_setup(ctx, inputs, output):
    q, vp, table, step, blocks_y, blocks_x = inputs
    ctx.save_for_backward(q, vp, table)
    ctx.args = (step, blocks_y, blocks_x)


def _banded_backward_rule(ctx, gy):
    q, vp, table = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: a differentiable backward
        grads = _graph_vjp(_banded_graph, (q, vp, table), ctx.args, gy, ctx.needs_input_grad[:3])
    else:
        grads = _banded_attention_backward(gy, q, vp, table, *ctx.args)
    return grads[0], grads[1], grads[2], None, None, None


_banded_attention.register_autograd(_banded_backward_rule, setup_context=_banded_setup)


@torch.jit.unused
def _banded_kernel(q: Tensor, vp: Tensor, table: Tensor, step: int, blocks_y: int, blocks_x: int) -> Tensor:
    return _run_kernel(_banded_attention, (q, vp, table), step, blocks_y, blocks_x)


def _pooled_table(kernel: Tensor) -> Tensor:
    """The nine shifted kernels of a 3x3 average pool: ``[9 k, u, K_h + 2, K_w + 2]``, rows ``(dy, dx, k)``,
    ``out[(d, k), u, e] = kernel[k, u, e - d]`` (zero outside)."""
    shifted: List[Tensor] = []
    for dy in range(3):
        for dx in range(3):
            shifted.append(F.pad(kernel, [dx, 2 - dx, dy, 2 - dy]))
    return torch.cat(shifted, 0)


def _tiled(q: Tensor, v: Tensor, kernel: Tensor, height: int, width: int, stride: int, count_include_pad: bool,
           kernels: bool, kernel_size: Optional[List[int]] = None) -> Tensor:
    """The tiled form, average-pooled (3x3, stride 2, padding 1) when ``stride == 2``: ``[B, h, V, n_out]``.
    ``kernel_size``: the kernel's ``[K_h, K_w]`` as Python ints where they are fixed (a local scope)."""
    if stride == 1 or kernels:
        return _tiled_blocks(q, v, kernel, height, width, stride, count_include_pad, kernels, kernel_size)
    # graphs compute the full map and pool it: the pooled contraction's logits matmul (9 |k| deep, on small
    # per-query GEMMs) costs more in onnxruntime than the 4x larger full-resolution one plus AveragePool
    b, h, dv = q.shape[0], q.shape[1], v.shape[2]
    y = _tiled_blocks(q, v, kernel, height, width, 1, count_include_pad, kernels, kernel_size)
    y = F.avg_pool2d(y.reshape(b, h * dv, height, width), 3, 2, 1, count_include_pad=count_include_pad)
    return y.reshape(b, h, dv, y.shape[-2] * y.shape[-1])


def _block_counts(height: int, width: int, t: int) -> Tuple[int, int]:
    """Query blocks of side ``t`` along each axis: ``ceil(size / t)``, and at least 2 inside ``torch.export``.

    A block count of 1 is a size-1 dimension of the block tensors, and torch.export (2.14) guards on it when it
    records their contiguity: an export from one example size would then hold only for the inputs with the same
    'one block or more' answer in every layer (129-256 px for a LambdaResNet exported at 160 px). With at least
    two blocks, the extra block is all padding (zero values, queries whose outputs are dropped), so the results
    are the same at every size, and the guard never arises.
    """
    blocks_y, blocks_x = (height + t - 1) // t, (width + t - 1) // t
    if not torch.jit.is_scripting() and _compiler_flag('is_exporting'):
        blocks_y, blocks_x = torch.sym_max(blocks_y, 2), torch.sym_max(blocks_x, 2)
    return blocks_y, blocks_x


def _tiled_blocks(q: Tensor, v: Tensor, kernel: Tensor, height: int, width: int, stride: int,
                  count_include_pad: bool, kernels: bool, kernel_size: Optional[List[int]]) -> Tensor:
    b, h, k, n = q.shape
    u, dv = v.shape[1], v.shape[2]
    if kernel_size is None:
        kh, kw = kernel.shape[-2], kernel.shape[-1]
    else:
        kh, kw = kernel_size[0], kernel_size[1]
    # pads on the contiguous NCHW maps, then one permute each (a pad of a permuted tensor makes torch.export
    # guard on sizes of 1 and specialise the input size)
    qn = q.reshape(b, h * k, height, width)
    if stride == 1:
        t, step, table, c = _tile(), 1, kernel, k
        ho, wo = height, width
        blocks_y, blocks_x = _block_counts(ho, wo, t)
        qb = F.pad(qn, [0, blocks_x * t - width, 0, blocks_y * t - height])
        qb = qb.reshape(b, h, k, blocks_y, t, blocks_x, t).permute(0, 3, 5, 4, 6, 1, 2)  # [B, by, bx, T, T, h, k]
        pad_y, pad_x = (kh - 1) // 2, (kw - 1) // 2  # values before the first query's window
    else:
        # output o averages inputs 2 o - 1 .. 2 o + 1: its queries are the 3x3 patch (d, k) of q, its table the
        # nine shifted kernels, and its window starts two input positions further for the next output
        t, step, table, c = _pooled_tile(), 2, _pooled_table(kernel), 9 * k
        ho, wo = (height + 1) // 2, (width + 1) // 2
        blocks_y, blocks_x = _block_counts(ho, wo, t)
        qp = F.pad(qn, [1, 2 * blocks_x * t - width, 1, 2 * blocks_y * t - height])
        patch: List[Tensor] = []
        for dy in range(3):
            for dx in range(3):
                patch.append(qp[:, :, dy:dy + 2 * blocks_y * t:2, dx:dx + 2 * blocks_x * t:2])
        qb = torch.stack(patch, 2).reshape(b, h, k, 9, blocks_y, t, blocks_x, t)
        qb = qb.permute(0, 4, 6, 5, 7, 1, 3, 2)  # [B, by, bx, T, T, h, 9, k]
        pad_y, pad_x = (kh - 1) // 2 + 1, (kw - 1) // 2 + 1
    qb = qb.reshape(b * blocks_y * blocks_x, t, t, h, c)
    table_size = [kh + 2 * (step - 1), kw + 2 * (step - 1)]  # the pooled table is 2 larger
    mh, mw = step * (t - 1) + table_size[0], step * (t - 1) + table_size[1]
    vp = F.pad(v.reshape(b, u * dv, height, width), [pad_x, step * t * (blocks_x - 1) + mw - width - pad_x,
                                                    pad_y, step * t * (blocks_y - 1) + mh - height - pad_y])
    vp = vp.permute(0, 2, 3, 1)  # channels last: a window's rows (my, mx, u) are whole channel vectors
    if kernels:
        y = _banded_kernel(qb, vp, table, step, blocks_y, blocks_x)
    else:
        y = _banded_graph(qb, vp, table.to(qb.dtype), step, blocks_y, blocks_x,
                          None if kernel_size is None else table_size)
    oy, ox = torch.arange(ho, device=y.device), torch.arange(wo, device=y.device)  # also the stride-2 border counts
    if kernels:  # back to the output positions: one permute of whole channel vectors
        y = y.reshape(b, blocks_y, blocks_x, t, t, h * dv).permute(0, 1, 3, 2, 4, 5)
        y = y.reshape(b, blocks_y * t, blocks_x * t, h * dv)[:, :ho, :wo].permute(0, 3, 1, 2)
    else:  # graphs: one gather of whole rows (a permute would make torch.export guard on 'one block')
        row = ((oy // t) * blocks_x)[:, None] * (t * t) + (oy % t)[:, None] * t + ((ox // t) * (t * t) + ox % t)[None, :]
        y = y.reshape(b, blocks_y * blocks_x * t * t, h * dv).index_select(1, row.reshape(ho * wo))
        y = y.permute(0, 2, 1).reshape(b, h * dv, ho, wo)
    if stride == 2:
        if count_include_pad:
            y = y / 9
        else:  # average over the in-image inputs of each output
            in_rows = 3 - (oy == 0).to(y.dtype) - (2 * oy + 1 >= height).to(y.dtype)
            in_cols = 3 - (ox == 0).to(y.dtype) - (2 * ox + 1 >= width).to(y.dtype)
            y = y / (in_rows[:, None] * in_cols[None, :])
    return y.reshape(b, h, dv, ho * wo)


# ----------------------------------------------------------------------------------------------------------


def position_lambdas(q: Tensor, v: Tensor, table: Tensor, height: int, width: int, impl: str,
                     global_scope: bool, stride: int = 1, count_include_pad: bool = False,
                     table_size: Optional[List[int]] = None) -> Tensor:
    """``y_n^h = (lambda^p_n)^T q_n^h`` for every query: ``q [B, h, k, n], v [B, u, V, n] -> [B, h, V, n]``.

    ``table`` is the relative embedding ``[k, u, R_h, R_w]`` (:class:`RelativePositionEmbedding`), ``impl``
    one of :data:`POSITION_IMPLS`. ``stride=2``: the result average-pooled (3x3, stride 2, padding 1;
    ``count_include_pad`` as ``nn.AvgPool2d``), ``[B, h, V, ceil(H/2) ceil(W/2)]``. ``table_size``: the table's
    ``[R_h, R_w]`` as Python ints (a layer knows them at construction): inside ``jit.trace`` a local scope's
    block embedding then becomes a constant that onnxruntime folds. An FX leaf: its Python size logic runs at
    call time, not at trace time.
    """
    if global_scope and not torch.jit.is_tracing():
        check_max_size(height, width, (table.shape[-2] + 1) // 2, (table.shape[-1] + 1) // 2)
    impl = choose_impl(impl, height, width, tile_window(table.shape[-2], table.shape[-1]), global_scope)
    kernels = _use_kernels()
    if not kernels and not torch.jit.is_scripting() and (impl == 'dense' or impl == 'tiled'):
        _note_graph_form()
    if impl == 'tiled':
        kernel = relative_kernel(table, height, width, global_scope)
        return _tiled(q, v, kernel, height, width, stride, count_include_pad, kernels,
                      None if global_scope else table_size)
    if impl == 'dense':
        y = _dense(q, v, table, height, width, global_scope, kernels)
    elif impl == 'einsum':
        y = _einsum(q, v, relative_kernel(table, height, width, global_scope), height, width, not global_scope)
    elif impl == 'conv':
        y = _conv(q, v, relative_kernel(table, height, width, global_scope), height, width)
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
