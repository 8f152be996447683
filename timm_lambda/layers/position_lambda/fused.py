"""The lambda computation after the query and value norms around the tiled kernels (sections 3.1-3.3): key
normalisation, the content lambda (eq. 1), the position lambdas applied to the queries (eq. 2) with the content term
in the kernels' accumulators, and at stride 2 the 3x3 average pooling (appendix F.2). :class:`Tiled` is the base of
the built-in operator backends (:mod:`.backends`): each gives its tiled kernels (:meth:`Tiled.tiled_forward`,
:meth:`Tiled.tiled_backward`); the ``gemm`` backend also computes the dense form (:mod:`.gemm`).

Inputs (the layer's own maps): ``q [B, h k, H, W]``, ``keys [B, u k, H, W]`` (not normalised; None without the
content lambda), ``v [B, u V, H, W]``, the relative embedding ``table [k, u, R_h, R_w]``, ``shared [B, k, V]`` (a part
of every ``lambda_n`` added to the content lambda, or standing for it without keys; None: none). Output ``[B, h V, Ho,
Wo]``; the gradients in the inputs' shapes. (Maps, not views of them: under torch.compile a view that the backward
saves made inductor compare symbolic strides it cannot order at batch 1, issue 51.)

Stride 2, the plan's ``variant``: ``'patched'`` runs at the output resolution (:func:`patched` says where that is
fewer multiply-adds): pooling is linear, so output ``o`` is the sum over its 3x3 window of the inputs' terms divided
by the window's in-image count (or 9): the queries' 3x3 patches (one im2col, channels ``(k, dy, dx)``) meet a table of
the nine shifted tables (:func:`pooled_table`) and the content lambda repeated nine times, so that the kernel computes
the window sum of both terms at once, 4x fewer queries than the map; ``'pooled'`` runs on the full map, pooled after.
"""
import functools
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_max_size
from ..size_cache import SizeCache
from . import plan as _plan  # (its native_bf16; methods here take a plan argument)
from .backends import Backend, Call, Decision

__all__ = ['KEY_NORMS', 'normalize_keys', 'Tiled', 'check_kernel_arguments', 'content_lambda', 'content_grads',
           'patched', 'pooled_table', 'in_image_counts', 'reach']


KEY_NORMS = ('softmax', 'l2', 'none')


def normalize_keys(keys: Tensor, key_norm: str, dim: int = -1) -> Tensor:
    """Normalise keys over the context positions ``dim`` (Table 11)."""
    if key_norm == 'softmax':
        return keys.softmax(dim=dim)
    if key_norm == 'l2':
        return F.normalize(keys, dim=dim)
    return keys


def content_lambda(keys: Optional[Tensor], v: Tensor, shared: Optional[Tensor], key_norm: str,
                   k: int) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """``(lambda^c + shared [B, k, V], the normalised keys [B, u, k, n])`` of the maps ``keys [B, u k, H, W]`` (or
    ``[B, u k, n]``) and ``v [B, u V, H, W]`` (eq. 1, Table 11: softmax over the context positions, in float32 at
    least as autocast computes a softmax). Without keys: ``(shared, None)``."""
    if keys is None:
        return shared, None
    b, n = v.shape[0], v.shape[2] * v.shape[3]
    u = keys.shape[1] // k
    kn = normalized_keys(keys.reshape(b, u, k, n), key_norm)
    if u == 1:
        vt = v.reshape(b, v.shape[1], n).transpose(1, 2)  # [B, n, V]
        content = _products(torch.bmm, kn[:, 0], vt) if shared is None else _products(torch.baddbmm, shared,
                                                                                           kn[:, 0], vt)
    else:  # sum over |u|: one GEMM of depth |u| |n|
        v4 = v.reshape(b, u, v.shape[1] // u, n)
        content = _products(torch.bmm, kn.transpose(1, 2).reshape(b, k, u * n),
                            v4.transpose(2, 3).reshape(b, u * n, v4.shape[2]))
        content = content if shared is None else content + shared
    return content, kn


def _products(op, *args: Tensor) -> Tensor:
    """``op`` (a matmul) of ``args``; a bfloat16 CPU call where oneDNN has no bfloat16 instructions (an AVX2-only CPU:
    its bfloat16 matmul is its reference code: 17 ms for the 8 M multiply-adds of a content-lambda gradient at
    512 ch 64x64) computes it in float32 and rounds the result once: what a bfloat16 matmul computes."""
    if args[-1].dtype == torch.bfloat16 and args[-1].is_cpu and not _plan.native_bf16():
        return op(*(a.float() for a in args)).to(torch.bfloat16)
    return op(*args)


def normalized_keys(keys: Tensor, key_norm: str) -> Tensor:
    """:func:`normalize_keys` in the keys' dtype, a 16-bit softmax computed in float32 (as under
    autocast)."""
    if key_norm == 'softmax' and keys.dtype in (torch.float16, torch.bfloat16):
        return torch.softmax(keys, -1, dtype=torch.float32).to(keys.dtype)
    return normalize_keys(keys, key_norm)


def _keys_grad(gkn: Tensor, keys: Tensor, kn: Tensor, key_norm: str) -> Tensor:
    """The keys' gradient (in ``gkn``'s shape, ``kn``'s layout) from the normalised keys' ``gkn``."""
    if key_norm == 'softmax':
        if keys.dtype in (torch.float16, torch.bfloat16):
            return torch._softmax_backward_data(gkn.float(), kn.float(), -1, torch.float32).to(keys.dtype)
        return torch._softmax_backward_data(gkn, kn, -1, keys.dtype)
    if key_norm == 'l2':  # F.normalize's: y = x / max(|x|, eps); autograd is off inside an operator's backward
        norm = keys.reshape(gkn.shape).norm(dim=-1, keepdim=True)
        inner = torch.where(norm >= 1e-12, (gkn * kn).sum(-1, keepdim=True), 0)  # (clamp_min passes at |x| >= eps)
        return (gkn - kn * inner) / norm.clamp_min(1e-12)
    return gkn


@functools.lru_cache(maxsize=64)
def _pool_index(kh: int, kw: int, device: torch.device) -> Tensor:
    """Gather index of :func:`pooled_table`: ``[9 (K_h + 2) (K_w + 2)]``, entry ``(d, e)`` the flat table position of
    offset ``e - d`` (``d = (dy, dx)`` in 3x3, ``e`` in the pooled scope), or ``K_h K_w`` (a zero slot) outside."""
    d = torch.arange(3)
    ey, ex = torch.arange(kh + 2), torch.arange(kw + 2)
    ty = ey[None, :] - d[:, None]  # [dy, ey]
    tx = ex[None, :] - d[:, None]
    inside = ((ty >= 0) & (ty < kh))[:, None, :, None] & ((tx >= 0) & (tx < kw))[None, :, None, :]
    index = torch.where(inside, ty[:, None, :, None] * kw + tx[None, :, None, :], kh * kw)
    with torch.inference_mode(False):
        return index.reshape(-1).to(device)


def pooled_table(table: Tensor) -> Tensor:
    """The table of a stride-2 layer's query patches: ``[k, u, K_h, K_w] -> [9 k, u, K_h + 2, K_w + 2]``, rows
    ``(k, dy, dx)`` (the order of ``F.unfold``'s channels), ``out[(k, d), u, e] = table[k, u, e - d]`` (zero outside).
    One pad and one gather (and a copy for |u| > 1)."""
    k, u, kh, kw = table.shape
    flat = F.pad(table.reshape(k, u, kh * kw), [0, 1])
    out = flat.index_select(2, _pool_index(kh, kw, table.device)).view(k, u, 9, kh + 2, kw + 2)
    return out.transpose(1, 2).reshape(9 * k, u, kh + 2, kw + 2)


def _pooled_table_grad(g: Tensor, kh: int, kw: int) -> Tensor:
    """The table's gradient from :func:`pooled_table`'s ``g [9 k, u, K_h + 2, K_w + 2]``."""
    k, u = g.shape[0] // 9, g.shape[1]
    e = g.shape[2] * g.shape[3]
    g = g.view(k, 9, u, e).transpose(1, 2).reshape(k, u, 9 * e)
    out = g.new_zeros(k, u, kh * kw + 1).index_add_(2, _pool_index(kh, kw, g.device), g)
    return out[:, :, :kh * kw].reshape(k, u, kh, kw)


# the stride-2 windows' in-image counts per size, dtype and device ([Ho, Wo] each): at most 8 MiB and 32 entries
IN_IMAGE_COUNTS = SizeCache(max_bytes=8 << 20, max_entries=32)


def in_image_counts(height: int, width: int, like: Tensor) -> Tensor:
    """``[Ho, Wo]``: the in-image inputs of each stride-2 output's 3x3 window (whole numbers, exact in every dtype),
    built once a size, dtype and device (:data:`IN_IMAGE_COUNTS`; inside the operator, never traced)."""
    def build():
        with torch.inference_mode(False):  # a later training step saves it for backward
            return _count_in_image(height, width, like.device, like.dtype)
    return IN_IMAGE_COUNTS.get((height, width, like.device, like.dtype), build)


def _count_in_image(height: int, width: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    ho, wo = (height + 1) // 2, (width + 1) // 2
    oy, ox = torch.arange(ho, device=device), torch.arange(wo, device=device)
    in_rows = 3 - (oy == 0).to(dtype) - (2 * oy + 1 >= height).to(dtype)
    in_cols = 3 - (ox == 0).to(dtype) - (2 * ox + 1 >= width).to(dtype)
    return in_rows[:, None] * in_cols[None, :]


def patched(k: int, dv: int, kh: int, kw: int) -> bool:
    """Whether a stride-2 call runs on the queries' 3x3 patches at the output resolution (fewer multiply-adds a
    pooled output: ``9 |k| (K_h + 2)(K_w + 2)`` logits and ``(K_h + 2)(K_w + 2) |v|`` value products against the
    full map's ``4 K_h K_w (|k| + |v|)``: c5 of LambdaResNet-101 at 1024 px, 170k against 305k) rather than on the
    full map, pooled after (a small map's reached table or a small |v|: the 4x4 map of 16 channels, 7x7 offsets,
    12k against 4k)."""
    return 9 * k * (kh + 2) * (kw + 2) + (kh + 2) * (kw + 2) * dv < 4 * kh * kw * (k + dv)


def _patches(q: Tensor, heads: int, height: int, width: int) -> Tensor:
    """``q [B, h k, H, W] -> [B, h, 9 k, Ho, Wo]``: the 3x3 patches (padding 1, stride 2) of the queries, channels
    ``(k, dy, dx)`` (``F.unfold``'s): one copy of the windows' strided view of the zero-padded map (F.unfold took
    3.4x its time in bfloat16 on a CPU)."""
    b, c = q.shape[0], q.shape[1]
    padded = F.pad(q, [1, 1, 1, 1])
    s = padded.stride()
    ho, wo = (height + 1) // 2, (width + 1) // 2
    windows = padded.as_strided((b, c, 3, 3, ho, wo), (s[0], s[1], s[2], s[3], 2 * s[2], 2 * s[3]))
    return windows.reshape(b, heads, 9 * c // heads, ho, wo)


def _repeat9(content: Optional[Tensor]) -> Optional[Tensor]:
    """The content lambda for the patches' channels ``(k, d)``: ``[B, k, V] -> [B, 9 k, V]``."""
    if content is None:
        return None
    b, k, dv = content.shape
    return content.unsqueeze(2).expand(b, k, 9, dv).reshape(b, 9 * k, dv)


def reach(table: Tensor, height: int, width: int, global_scope: bool) -> Tensor:
    """The offsets of ``table [k, u, R_h, R_w]`` that an ``height x width`` map reaches, ``|dy| <= H - 1``, ``|dx|
    <= W - 1``: a centred window (a view) of ``min(R, 2 H - 1)`` rows and ``min(R, 2 W - 1)`` columns; the offsets
    past it meet only zero padding. A global table covers at most its ``max_size`` (else a ValueError naming it); a
    local one any size (its window: at most the scope, the same result with less work on maps smaller than it,
    e.g. 7x7 of a 23x23 scope at c5 of a 224 px image)."""
    kh, kw = table.shape[2], table.shape[3]
    ch, cw = (kh - 1) // 2, (kw - 1) // 2
    if global_scope:
        check_max_size(height, width, ch + 1, cw + 1)
    rh, rw = min(ch, height - 1), min(cw, width - 1)
    if rh != ch:
        table = table.narrow(2, ch - rh, 2 * rh + 1)
    return table if rw == cw else table.narrow(3, cw - rw, 2 * rw + 1)


def reach_grad(g: Tensor, table: Tensor) -> Tensor:
    """The whole table's gradient from that of its window :func:`reach` (zero outside)."""
    py, px = (table.shape[2] - g.shape[2]) // 2, (table.shape[3] - g.shape[3]) // 2
    return F.pad(g, [px, px, py, py]) if py or px else g


def check_kernel_arguments(name: str, q: Tensor, v: Tensor, table: Tensor, step: int, content: Optional[Tensor] = None,
                           gy: Optional[Tensor] = None) -> None:
    """What the tiled kernels read, checked against each other before a launch (as the CPU kernel's entry points
    do): ``q [B, h, c, Ho, Wo]`` with ``Ho, Wo = ceil(H / step), ceil(W / step)``, ``v [B, u V, H, W]``, ``table [c,
    u, K_h, K_w]`` with odd sides, ``content [B, c, V]`` or None, ``gy [B, h V, Ho, Wo]``, one floating dtype, one
    device, step 1 or 2: a ValueError or TypeError naming the argument."""
    if step not in (1, 2):
        raise ValueError(f'{name}: step must be 1 or 2, got {step!r}')
    for what, x, rank in (('q', q, 5), ('v', v, 4), ('table', table, 4), ('content', content, 3), ('gy', gy, 4)):
        if x is None:
            continue
        if x.dim() != rank:
            raise ValueError(f'{name}: {what} must be {rank}-D, got shape {list(x.shape)}')
        if x.dtype != q.dtype or not x.is_floating_point():
            raise TypeError(f'{name}: {what} must be floating and of q\'s dtype ({q.dtype}), got {x.dtype}')
        if x.device != q.device:
            raise TypeError(f'{name}: {what} must be on q\'s device ({q.device}), got {x.device}')
    b, h, c, ho, wo = q.shape
    _, u, kh, kw = table.shape
    height, width = v.shape[2], v.shape[3]
    if table.shape[0] != c or u < 1 or kh % 2 == 0 or kw % 2 == 0:
        raise ValueError(f"{name}: table must be [c, u, K_h, K_w] with q's c and odd sides, got table "
                         f'{list(table.shape)}, q {list(q.shape)}')
    if v.shape[0] != b or v.shape[1] < u or v.shape[1] % u:
        raise ValueError(f"{name}: v must be [B, u V, H, W] with q's B and a multiple of the table's u, got v "
                         f'{list(v.shape)}, q {list(q.shape)}')
    if (ho, wo) != (-(-height // step), -(-width // step)):
        raise ValueError(f"{name}: q's map must be v's at step {step}, got q {list(q.shape)}, v {list(v.shape)}")
    dv = v.shape[1] // u
    if content is not None and tuple(content.shape) != (b, c, dv):
        raise ValueError(f'{name}: content must be [B, c, V] = {[b, c, dv]}, got {list(content.shape)}')
    if gy is not None and tuple(gy.shape) != (b, h * dv, ho, wo):
        raise ValueError(f"{name}: gy must be the output's gradient {[b, h * dv, ho, wo]}, got {list(gy.shape)}")


class Tiled(Backend):
    """A backend that computes the tiled form by its kernels (the layouts of :meth:`tiled_forward`); this class does
    the rest of the operator around them."""
    forms = ('tiled',)

    def decide(self, call: Call) -> Decision:
        """The stride-2 variant (:func:`patched`), the dtype the kernels compute in (:meth:`kernel_dtype`) and their
        tiling for the kernel call the variant makes (:meth:`kernel_tiling`)."""
        variant = _variant(call)
        step, c, kw = (2, 9 * call.k, call.kw + 2) if variant == 'patched' else (1, call.k, call.kw)
        return Decision(variant, self.kernel_dtype(call.dtype),
                        self.kernel_tiling(call.device, call.dtype, step, c, kw))

    def kernel_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the kernels compute a call of ``dtype`` in (default: itself)."""
        return dtype

    def kernel_tiling(self, device: str, dtype: torch.dtype, step: int, c: int, kw: int) -> Tuple[int, ...]:
        """The kernels' tiling, chunking and path for a kernel call in ``dtype`` at ``step`` with query depth ``c``
        against a table window ``kw`` wide (its own ints; default none)."""
        return ()

    def tiled_forward(self, plan, q: Tensor, v: Tensor, table: Tensor, step: int,
                      content: Optional[Tensor]) -> Tensor:
        """The position term plus ``q lambda^c``: ``q [B, h, c, Ho, Wo]`` (a stride-2 layer's 3x3 query patches, c = 9
        |k|), ``v [B, u V, H, W]``, ``table [c, u, K_h, K_w]``, an optional content lambda ``[B, c, V]`` applied to
        the same queries -> ``[B, h V, Ho, Wo]`` contiguous, in ``q``'s dtype."""
        raise NotImplementedError

    def tiled_backward(self, plan, gy: Tensor, q: Tensor, v: Tensor, table: Tensor, step: int,
                       content: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """The gradients of q, v, the table and the content lambda (an empty tensor without one), in the inputs'
        dtypes."""
        raise NotImplementedError

    def forward(self, plan, q: Tensor, keys: Optional[Tensor], v: Tensor, table: Tensor,
                shared: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """``(y [B, h V, Ho, Wo] contiguous, the content lambda [B, k, V], the normalised keys [B, u, k, n])`` (None
        for what there is none). (Each view or reshape here costs about a microsecond of host time: the maps go to
        the kernels as they are.)"""
        b, k = q.shape[0], table.shape[0]
        height, width = q.shape[2], q.shape[3]
        h = q.shape[1] // k
        content, kn = content_lambda(keys, v, shared, plan.key_norm, k)
        table = reach(table, height, width, plan.global_scope)
        if plan.variant != 'patched':
            y = self.tiled_forward(plan, q.reshape(b, h, k, height, width), v, table, 1, content)
            return (y if plan.stride == 1 else pool(y, plan.count_include_pad)), content, kn
        y = self.tiled_forward(plan, _patches(q, h, height, width), v, pooled_table(table), 2, _repeat9(content))
        y = y.div_(9) if plan.count_include_pad else y.div_(in_image_counts(height, width, y))
        return y, content, kn

    def backward(self, plan, gy: Tensor, q: Tensor, keys: Optional[Tensor], v: Tensor, table: Tensor,
                 shared: Optional[Tensor], content: Optional[Tensor], kn: Optional[Tensor]) -> List[Optional[Tensor]]:
        """The gradients of ``q``, ``keys``, ``v``, ``table`` and ``shared`` (None for an input that is None) from
        what :meth:`forward` returned besides its output (``content``, ``kn``: recomputed where None)."""
        b, k, u = q.shape[0], table.shape[0], table.shape[1]
        height, width = q.shape[2], q.shape[3]
        h, dv = q.shape[1] // k, v.shape[1] // u
        if content is None and (keys is not None or shared is not None):
            content, kn = content_lambda(keys, v, shared, plan.key_norm, k)
        whole = table
        table = reach(table, height, width, plan.global_scope)
        if plan.variant != 'patched':
            if plan.stride == 2:
                gy = pool_backward(gy, height, width, plan.count_include_pad)
            gq, gv, gtable, gcontent = self.tiled_backward(plan, gy, q.reshape(b, h, k, height, width), v, table, 1,
                                                           content)
        else:
            gy = gy / 9 if plan.count_include_pad else gy / in_image_counts(height, width, gy)
            gp, gv, gtable, gcontent = self.tiled_backward(plan, gy, _patches(q, h, height, width), v,
                                                           pooled_table(table), 2, _repeat9(content))
            gq = F.fold(gp.reshape(b, h * 9 * k, gp.shape[3] * gp.shape[4]), (height, width), 3, padding=1, stride=2)
            gtable = _pooled_table_grad(gtable, table.shape[2], table.shape[3])
            if content is not None:
                gcontent = gcontent.view(b, k, 9, dv).sum(2)
        return content_grads(gq, gv, reach_grad(gtable, whole), gcontent, q, keys, v, shared, kn, plan.key_norm)


def content_grads(gq: Tensor, gv: Tensor, gtable: Tensor, gcontent: Optional[Tensor], q: Tensor,
                  keys: Optional[Tensor], v: Tensor, shared: Optional[Tensor], kn: Optional[Tensor],
                  key_norm: str) -> List[Optional[Tensor]]:
    """The five inputs' gradients from the position term's and the content lambda's ``gcontent [B, k, V]``: the
    keys' and the values' part through ``lambda^c = sum_u K_u V_u^T`` (eq. 1) added."""
    gkeys = None
    if keys is not None:
        b, k, u = keys.shape[0], gcontent.shape[1], keys.shape[1] // gcontent.shape[1]
        dv, n = v.shape[1] // u, v.shape[2] * v.shape[3]
        if kn is None:  # (key_norm='none': the keys themselves, not kept)
            kn = normalized_keys(keys.reshape(b, u, k, n), key_norm)
        if u == 1:
            kn = kn[:, 0]  # [B, k, n]
            gkn = _products(torch.bmm, gcontent, v.reshape(b, dv, n))
            gv = _products(torch.baddbmm, gv.reshape(b, dv, n), gcontent.transpose(1, 2), kn)
        else:
            gkn = _products(torch.matmul, gcontent.unsqueeze(1), v.reshape(b, u, dv, n))
            gv = gv.reshape(b, u, dv, n) + _products(torch.matmul, gcontent.transpose(1, 2).unsqueeze(1), kn)
        gkeys = _as(_keys_grad(gkn, keys, kn, key_norm), keys.shape)
    return [_as(gq, q.shape), gkeys, _as(gv, v.shape), gtable, None if shared is None else gcontent]


def _variant(call: Call) -> str:
    if call.stride == 1:
        return ''
    return 'patched' if patched(call.k, call.dv, call.kh, call.kw) else 'pooled'


def _as(x: Tensor, shape) -> Tensor:
    """``x`` in ``shape`` (no call where it already is)."""
    return x if x.shape == shape else x.reshape(shape)


def pool(y: Tensor, count_include_pad: bool) -> Tensor:
    """The 3x3 stride-2 average pooling (padding 1) of a contiguous map (the kernels' outputs: the NCHW kernels, see
    :mod:`..pooling`)."""
    return F.avg_pool2d(y, 3, 2, 1, count_include_pad=count_include_pad)


def pool_backward(gy: Tensor, height: int, width: int, count_include_pad: bool) -> Tensor:
    """The gradient of the full ``height x width`` map from that of its 3x3 stride-2 average pooling."""
    full = gy.new_empty(gy.shape[0], gy.shape[1], height, width)
    return torch.ops.aten.avg_pool2d_backward(gy, full, [3, 3], [2, 2], [1, 1], False, count_include_pad, None)
