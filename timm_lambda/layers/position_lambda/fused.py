"""The lambda computation after the query and value norms as one operator's forward and backward (sections 3.1-3.3):
key normalisation, the content lambda (eq. 1), the position lambdas applied to the queries (eq. 2) with the content
term in the same accumulators, and at stride 2 the 3x3 average pooling (appendix F.2), by the backend of the call's
plan (:mod:`.plan`). :mod:`.custom_ops` registers these as ``timm_lambda::lambda_layer`` and its backward.

Inputs (the layer's own maps): ``q [B, h k, H, W]``, ``keys [B, u k, H, W]`` (not normalised; None without the
content lambda), ``v [B, u V, H, W]``, the relative embedding ``table [k, u, R_h, R_w]``, ``shared [B, k, V]`` (a part
of every ``lambda_n`` added to the content lambda, or standing for it without keys; None: none). Output ``[B, h V, Ho,
Wo]``; the gradients in the inputs' shapes. (Maps, not views of them: under torch.compile a view that the backward
saves made inductor compare symbolic strides it cannot order at batch 1, issue 51.)

Stride 2 (the tiled form) runs at the output resolution where that is fewer multiply-adds (:func:`patched`; else on
the full map, pooled after): pooling is linear, so output ``o`` is the sum over its 3x3
window of the inputs' terms divided by the window's in-image count (or 9): the queries' 3x3 patches (one im2col,
channels ``(k, dy, dx)``) meet a table of the nine shifted tables (:func:`pooled_table`) and the content lambda
repeated nine times, so that the kernel computes the window sum of both terms at once, 4x fewer queries than the map.
The dense form (the ``gemm`` backend): the logits of every (query, context) pair, then one GEMM with the values
(:func:`.plain_ops.dense_plain`), its backward by four more.
"""
import functools
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import pooling
from ..checks import check_max_size
from ..relative_embedding import dense_embedding, dense_index_for
from ..size_cache import SizeCache
from . import backends
from .plain_ops import normalize_keys

__all__ = ['forward', 'backward', 'views', 'content_lambda', 'patched', 'pooled_table', 'in_image_counts']


def content_lambda(keys: Optional[Tensor], v: Tensor, shared: Optional[Tensor], key_norm: str, k: int) -> Tuple[
        Optional[Tensor], Optional[Tensor]]:
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
        lam = torch.bmm(kn[:, 0], vt) if shared is None else torch.baddbmm(shared, kn[:, 0], vt)
    else:  # sum over |u|: one GEMM of depth |u| |n|
        v4 = v.reshape(b, u, v.shape[1] // u, n)
        lam = torch.bmm(kn.transpose(1, 2).reshape(b, k, u * n), v4.transpose(2, 3).reshape(b, u * n, v4.shape[2]))
        lam = lam if shared is None else lam + shared
    return lam, kn


def normalized_keys(keys: Tensor, key_norm: str) -> Tensor:
    """:func:`.plain_ops.normalize_keys` in the keys' dtype, a 16-bit softmax computed in float32 (as under
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
    built once a size, dtype and device in eager mode (:data:`IN_IMAGE_COUNTS`)."""
    if torch.compiler.is_compiling():
        return _count_in_image(height, width, like.device, like.dtype)

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
    ``(k, dy, dx)``: one im2col."""
    cols = F.unfold(q, 3, padding=1, stride=2)
    return cols.view(q.shape[0], heads, cols.shape[1] // heads, (height + 1) // 2, (width + 1) // 2)


def _repeat9(lam: Optional[Tensor]) -> Optional[Tensor]:
    """The content lambda for the patches' channels ``(k, d)``: ``[B, k, V] -> [B, 9 k, V]``."""
    if lam is None:
        return None
    b, k, dv = lam.shape
    return lam.unsqueeze(2).expand(b, k, 9, dv).reshape(b, 9 * k, dv)


def _reach(table: Tensor, height: int, width: int, global_scope: bool) -> Tensor:
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


def _reach_grad(g: Tensor, table: Tensor) -> Tensor:
    """The whole table's gradient from that of its window :func:`_reach` (zero outside)."""
    py, px = (table.shape[2] - g.shape[2]) // 2, (table.shape[3] - g.shape[3]) // 2
    return F.pad(g, [px, px, py, py]) if py or px else g


def forward(backend: str, form: str, q: Tensor, keys: Optional[Tensor], v: Tensor, table: Tensor,
            shared: Optional[Tensor], height: int, width: int, stride: int, count_include_pad: bool, key_norm: str,
            global_scope: bool, saved: Optional[dict] = None) -> Tensor:
    """The layer's output after its norms, ``[B, h V, Ho, Wo]`` (contiguous), by ``backend`` in ``form``. ``saved``: a
    dict that keeps the content lambda and the normalised keys for :func:`backward` (else it recomputes them). (Each
    view or reshape here costs about a microsecond of host time: the maps go to the kernels as they are.)"""
    b, k, u = q.shape[0], table.shape[0], table.shape[1]
    h, dv = q.shape[1] // k, v.shape[1] // u
    lam, kn = content_lambda(keys, v, shared, key_norm, k)
    if saved is not None:
        saved['lam'], saved['kn'] = lam, kn
    table = _reach(table, height, width, global_scope)
    if form == 'dense':
        q, _, v = views(q, None, v, table, height, width)
        qd, vd, emb, _ = _dense_operands(q, v, table, height, width, global_scope)
        y = torch.bmm(_dense_logits(qd, emb, b, h), vd)  # [B, n h, V]
        y = y.view(b, height * width, h * dv).transpose(1, 2).reshape(b, h, dv, height * width)
        if lam is not None:  # + (lambda^c)^T q_n^h (eq. 2)
            y = torch.matmul(lam.transpose(1, 2).unsqueeze(1), q).add_(y)
        y = y.view(b, h * dv, height, width)
        return pooling.avg_pool_3x3_s2(y, count_include_pad) if stride == 2 else y
    kernel = backends.tiled_kernels(backend)[0]
    if stride == 1 or not patched(k, dv, table.shape[2], table.shape[3]):
        y = kernel(q.reshape(b, h, k, height, width), v, table, 1, lam)
        return y if stride == 1 else pooling.avg_pool_3x3_s2(y, count_include_pad)
    y = kernel(_patches(q, h, height, width), v, pooled_table(table), 2, _repeat9(lam))
    return y.div_(9) if count_include_pad else y.div_(in_image_counts(height, width, y))


def backward(backend: str, form: str, gy: Tensor, q: Tensor, keys: Optional[Tensor], v: Tensor, table: Tensor,
             shared: Optional[Tensor], height: int, width: int, stride: int, count_include_pad: bool, key_norm: str,
             global_scope: bool, saved: Optional[dict] = None) -> List[Optional[Tensor]]:
    """The gradients of ``q``, ``keys``, ``v``, ``table`` and ``shared`` (None for an input that is None); ``saved``:
    what :func:`forward` kept."""
    b, k, u = q.shape[0], table.shape[0], table.shape[1]
    h, dv, n = q.shape[1] // k, v.shape[1] // u, height * width
    lam, kn = (saved['lam'], saved['kn']) if saved else content_lambda(keys, v, shared, key_norm, k)
    if kn is None and keys is not None:  # (key_norm='none': the keys themselves, not kept)
        kn = normalized_keys(keys.reshape(b, u, k, n), key_norm)
    whole = table
    table = _reach(table, height, width, global_scope)
    if form == 'dense':
        qv, _, vv = views(q, None, v, table, height, width)
        gq, gv, gtable, glam = _dense_backward(gy, qv, vv, table, lam, height, width, stride, count_include_pad,
                                               global_scope)
    elif stride == 1 or not patched(k, dv, table.shape[2], table.shape[3]):
        if stride == 2:
            gy = _pool_backward(gy, height, width, count_include_pad)
        gq, gv, gtable, glam = backends.tiled_kernels(backend)[1](gy, q.reshape(b, h, k, height, width), v, table, 1,
                                                                   lam)
    else:
        gy = gy / 9 if count_include_pad else gy / in_image_counts(height, width, gy)
        gp, gv, gtable, glam = backends.tiled_kernels(backend)[1](gy, _patches(q, h, height, width), v,
                                                                   pooled_table(table), 2, _repeat9(lam))
        gq = F.fold(gp.reshape(b, h * 9 * k, gp.shape[3] * gp.shape[4]), (height, width), 3, padding=1, stride=2)
        gtable = _pooled_table_grad(gtable, table.shape[2], table.shape[3])
        if lam is not None:
            glam = glam.view(b, k, 9, dv).sum(2)
    gtable = _reach_grad(gtable, whole)
    gkeys = None
    if keys is not None:  # lambda^c = sum_u K_u V_u^T (eq. 1)
        if u == 1:
            kn = kn[:, 0]  # [B, k, n]
            gkn = torch.bmm(glam, v.reshape(b, dv, n))
            gv = torch.baddbmm(gv.reshape(b, dv, n), glam.transpose(1, 2), kn)
        else:
            gkn = torch.matmul(glam.unsqueeze(1), v.reshape(b, u, dv, n))
            gv = gv.reshape(b, u, dv, n) + torch.matmul(glam.transpose(1, 2).unsqueeze(1), kn)
        gkeys = _as(_keys_grad(gkn, keys, kn, key_norm), keys.shape)
    return [_as(gq, q.shape), gkeys, _as(gv, v.shape), gtable, None if shared is None else glam]


def _as(x: Tensor, shape) -> Tensor:
    """``x`` in ``shape`` (no call where it already is)."""
    return x if x.shape == shape else x.reshape(shape)


def views(q: Tensor, keys: Optional[Tensor], v: Tensor, table: Tensor, height: int, width: int):
    """The maps as ``q [B, h, k, n]``, ``keys [B, u, k, n]``, ``v [B, u, V, n]`` (views)."""
    b, k, u, n = q.shape[0], table.shape[0], table.shape[1], height * width
    return (q.reshape(b, q.shape[1] // k, k, n), None if keys is None else keys.reshape(b, u, k, n),
            v.reshape(b, u, v.shape[1] // u, n))


def _pool_backward(gy: Tensor, height: int, width: int, count_include_pad: bool) -> Tensor:
    """The gradient of the full ``height x width`` map from that of its 3x3 stride-2 average pooling."""
    full = gy.new_empty(gy.shape[0], gy.shape[1], height, width)
    return torch.ops.aten.avg_pool2d_backward(gy, full, [3, 3], [2, 2], [1, 1], False, count_include_pad, None)


def _dense_operands(q: Tensor, v: Tensor, table: Tensor, height: int, width: int, global_scope: bool):
    """The dense form's GEMM operands: ``q [n, B h, k]``, ``v [B, u m, V]``, the embeddings ``E [n, k, u m]``
    (``E_nm = R[m - n]``, zero outside a local scope) and their gather index."""
    b, h, k, n = q.shape
    u, dv = v.shape[1], v.shape[2]
    masked = not global_scope
    index = dense_index_for(height, width, table.shape[2], table.shape[3], masked, table.device)
    emb = dense_embedding(table, height, width, masked, index).permute(2, 0, 1, 3).reshape(n, k, u * n)
    return (q.permute(3, 0, 1, 2).reshape(n, b * h, k), v.transpose(2, 3).reshape(b, u * n, dv), emb, index)


def _dense_logits(qd: Tensor, emb: Tensor, b: int, h: int) -> Tensor:
    """``[B, n h, u m]``: the logits of every (query, context) pair."""
    n = qd.shape[0]
    m = emb.shape[2]
    return torch.bmm(qd, emb).view(n, b, h, m).transpose(0, 1).reshape(b, n * h, m)


def _dense_backward(gy: Tensor, q: Tensor, v: Tensor, table: Tensor, lam: Optional[Tensor], height: int, width: int,
                    stride: int, count_include_pad: bool, global_scope: bool):
    """The dense form's gradients of ``q``, ``v``, the (reached) table and the content lambda."""
    b, h, k, n = q.shape
    u, dv = v.shape[1], v.shape[2]
    if stride == 2:
        gy = _pool_backward(gy, height, width, count_include_pad)
    gy4 = gy.reshape(b, h, dv, n)
    glam = None
    gq = None
    if lam is not None:  # the content term's
        glam = torch.matmul(q, gy4.transpose(2, 3)).sum(1)
        gq = torch.matmul(lam.unsqueeze(1), gy4)
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
    return gq, gv, gtable, glam
