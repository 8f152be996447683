"""The position lambdas in plain tensor ops: the two reference forms and the plain-op execution of the two fast ones.

Shape arithmetic only (no data-dependent Python branches), so that every tracer, exporter and transform records them
(:mod:`..execution` says which execution runs where).
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import pooling  # a module, not its name: pooling imports .execution from this package
from ..execution import compiled_copy, contiguous, is_exporting
from ..relative_embedding import block_embedding, dense_embedding, table_for_input
from .backends import FORMS, Backend
from .fused import KEY_NORMS, normalize_keys

__all__ = ['Plain', 'KEY_NORMS', 'normalize_keys', 'lambdas_plain', 'content_lambda_plain', 'content_term',
           'operator_content_term', 'operator_content_grads', 'einsum_form', 'conv_form', 'dense_plain', 'tile',
           'tiled_plain', 'to_blocks']

def content_lambda_plain(keys: Tensor, v: Tensor, key_norm: str) -> Tensor:
    """lambda^c ``[B, k, V]`` (eq. 1) of the keys ``[B, u, k, n]`` (normalised here) and values ``[B, u, V, n]``: one
    bmm per |u| (torch.matmul's 4-D decomposition reshapes the transposed values: torch.export would guard on
    ``H W != 1``); |u| = 1 by views. (Compiled: copies, as the views bmm saves for backward broke inductor at symbolic
    sizes: :func:`~..execution.compiled_copy`.)"""
    keys = normalize_keys(keys, key_norm)
    if keys.shape[1] == 1:  # squeezes, as the layer had them before the operator (a select's backward is a fill)
        return torch.bmm(compiled_copy(keys.squeeze(1)), compiled_copy(v.squeeze(1).transpose(1, 2)))
    out = torch.bmm(compiled_copy(keys[:, 0]), compiled_copy(v[:, 0].transpose(1, 2)))
    for i in range(1, keys.shape[1]):
        out = out + torch.bmm(compiled_copy(keys[:, i]), compiled_copy(v[:, i].transpose(1, 2)))
    return out


def lambdas_plain(q: Tensor, keys: Optional[Tensor], v: Tensor, table: Optional[Tensor], shared: Optional[Tensor],
                  height: int, width: int, form: str, stride: int, count_include_pad: bool, key_norm: str,
                  global_scope: bool, table_size: Optional[List[int]]) -> Tensor:
    """The lambda computation after the norms (the operator of :mod:`.fused`) in plain tensor ops, for every form:
    ``q [B, h, k, n]``, ``keys [B, u, k, n]`` or None, ``v [B, u, V, n]``, ``table [k, u, R_h, R_w]`` or None (no
    position lambdas), ``shared [B, k, V]`` or None -> ``[B, h V, Ho, Wo]``. The full map, then 3x3 average pooling
    at stride 2 (the pooled contraction's logits matmul, 9 |k| deep on small per-query GEMMs, costs more in
    onnxruntime than the 4x larger full-resolution one plus AveragePool)."""
    content = shared
    if keys is not None:
        lam = content_lambda_plain(keys, v, key_norm)
        content = lam if content is None else lam + content
    if table is None:
        assert content is not None, 'the content lambda, the position lambdas or both'
        return content_term(content, q, height, width, stride, count_include_pad)  # eq. 2
    cut = table_for_input(table, height, width, global_scope)
    y = position_plain(q, v, cut, height, width, form, global_scope, None if global_scope else table_size)
    if stride == 2:
        y = pooling.avg_pool_3x3_s2(y, count_include_pad)
    # the contiguous term first: the sum takes its layout (y may be a permuted view), which the reshapes after the
    # layer rely on (a permuted sum made torch.export guard on sizes)
    return y if content is None else content_term(content, q, height, width, stride, count_include_pad) + y


def position_plain(q: Tensor, v: Tensor, table: Tensor, height: int, width: int, form: str, global_scope: bool,
                   table_size: Optional[List[int]]) -> Tensor:
    """The position term (eq. 2 with lambda^p) of ``form`` at stride 1: ``[B, h V, H, W]`` (possibly a strided
    view); ``table``: cut to the input (:func:`table_for_input`)."""
    b, h = q.shape[0], q.shape[1]
    dv = v.shape[2]
    if form == 'tiled':
        return _tiled_blocks(q, v, table, height, width, table_size)
    if form == 'dense':
        n = height * width
        u = v.shape[1]
        k = q.shape[2]
        # copies and views: a reshape of a permuted view makes torch.export guard on n != 1, B != 1
        emb = dense_embedding(table, height, width, not global_scope).permute(2, 0, 1, 3)
        y = dense_plain(contiguous(q.permute(3, 0, 1, 2)).view(n, b * h, k),
                        contiguous(v.transpose(2, 3)).view(b, u * n, dv), contiguous(emb).view(n, k, u * n), h)
        return y.reshape(b, height, width, h * dv).permute(0, 3, 1, 2)
    if form == 'einsum':
        y = einsum_form(q, v, table, height, width, not global_scope)
    elif form == 'conv':
        y = conv_form(q, v, table, height, width)
    else:
        raise ValueError("form must be one of 'auto', 'einsum', 'conv', 'dense', 'tiled', got '" + form + "'")
    return y.reshape(b, h * dv, height, width)


def _tiled_blocks(q: Tensor, v: Tensor, table: Tensor, height: int, width: int,
                  table_size: Optional[List[int]]) -> Tensor:
    """The tiled form by query blocks (:func:`to_blocks`, :func:`tiled_plain`): ``[B, h V, H, W]``."""
    b, h, k = q.shape[0], q.shape[1], q.shape[2]
    u, dv = v.shape[1], v.shape[2]
    kh, kw = (table.shape[-2], table.shape[-1]) if table_size is None else (table_size[0], table_size[1])
    t = tile()
    blocks_y, blocks_x = (height + t - 1) // t, (width + t - 1) // t
    if not torch.jit.is_scripting() and is_exporting():
        # torch.export (2.14) guards on a block count of 1 and would specialise the export to inputs with the same
        # 'one block or more' answer in every layer: at least 2 blocks (the extra one all padding, same results)
        # (torch.sym_max of two ints is unsupported in strict export before torch 2.14: max() for static sizes)
        blocks_y = torch.sym_max(blocks_y, 2) if isinstance(blocks_y, torch.SymInt) else max(blocks_y, 2)
        blocks_x = torch.sym_max(blocks_x, 2) if isinstance(blocks_x, torch.SymInt) else max(blocks_x, 2)
    qb, vp = to_blocks(q.reshape(b, h, k, height, width), v.reshape(b, u * dv, height, width), kh, kw, t, 1,
                       blocks_y, blocks_x)
    oy, ox = torch.arange(height, device=q.device), torch.arange(width, device=q.device)
    y = tiled_plain(qb, vp, table, t, 1, blocks_y, blocks_x, table_size)
    row = (((oy // t) * blocks_x)[:, None] * (t * t) + (oy % t)[:, None] * t
           + ((ox // t) * (t * t) + ox % t)[None, :])
    # one gather of whole rows, indexed by the 2-D row map (a permute would make torch.export guard on 'one
    # block', a reshape to [.., ho, wo] on ho * wo != 1)
    return y.reshape(b, blocks_y * blocks_x * t * t, h * dv)[:, row].permute(0, 3, 1, 2)


def content_term(content: Tensor, q: Tensor, height: int, width: int, stride: int = 1,
                 count_include_pad: bool = False) -> Tensor:
    """``y_n^h = (lambda^c)^T q_n^h`` (eq. 2) for the content lambda ``content [B, k, V]`` and ``q [B, h, k, n]`` ->
    ``[B, h V, H_out, W_out]``. Linear in the query: a stride-2 layer applies it to the pooled queries (|h||k|
    channels, not |h||v|), pooled as :func:`position_lambdas` pools its result."""
    b, h, k = q.shape[0], q.shape[1], q.shape[2]
    ho, wo = (height + stride - 1) // stride, (width + stride - 1) // stride
    if stride == 2:
        q = pooling.avg_pool_3x3_s2(q.reshape(b, h * k, height, width), count_include_pad).reshape(b, h, k, ho * wo)
    return torch.matmul(content.transpose(1, 2).unsqueeze(1), compiled_copy(q)).reshape(b, h * content.shape[2], ho, wo)


def operator_content_term(q: Tensor, content: Tensor) -> Tensor:
    """:func:`content_term` of the kernels' queries ``q [B, h, c, Ho, Wo]``: ``[B, h V, Ho, Wo]`` (inside the
    operator: never traced)."""
    b, h, c, ho, wo = q.shape
    return torch.matmul(content.transpose(1, 2).unsqueeze(1), q.reshape(b, h, c, ho * wo)).reshape(
        b, h * content.shape[2], ho, wo)


def operator_content_grads(gy: Tensor, q: Tensor, content: Tensor) -> Tuple[Tensor, Tensor]:
    """The content term's gradients ``(dq [B, h, c, Ho, Wo], dcontent [B, c, V])`` for the output gradient ``gy``."""
    b, h, c, ho, wo = q.shape
    gy4 = gy.reshape(b, h, content.shape[2], ho * wo)
    gcontent = torch.matmul(q.reshape(b, h, c, ho * wo), gy4.transpose(2, 3)).sum(1).to(content.dtype).contiguous()
    return torch.matmul(content.unsqueeze(1), gy4).view(b, h, c, ho, wo), gcontent

def einsum_form(q: Tensor, v: Tensor, table: Tensor, height: int, width: int, masked: bool) -> Tensor:
    """The lambda form of Fig. 3: ``lambda^p_n = sum_m E_nm v_m^T`` (eq. 1), then ``(lambda^p_n)^T q_n`` (eq. 2).

    ``q [B, h, k, n]``, ``v [B, u, V, n]``, ``table [k, u, R_h, R_w]`` (cut to the input, :func:`table_for_input`)
    -> ``[B, h, V, n]``. Materialises ``E [k, u, n, m]``."""
    emb = dense_embedding(table, height, width, masked).to(v.dtype)  # [k, u, n, m]
    lambdas = torch.einsum('kunm,buvm->bnkv', [emb, v])
    return torch.einsum('bhkn,bnkv->bhvn', [q, lambdas.to(q.dtype)])


def conv_form(q: Tensor, v: Tensor, table: Tensor, height: int, width: int) -> Tensor:
    """The lambda convolution (section 3.4, appendix C.1): ``lambda^p`` as a 3-D convolution of the values with the
    table, the value depth an extra axis; shapes as :func:`einsum_form`."""
    b, u, dv = v.shape[0], v.shape[1], v.shape[2]
    k, th, tw = table.shape[0], table.shape[-2], table.shape[-1]
    # explicit padding: a global table's size follows the input, and a tracer records F.pad's amounts but
    # freezes conv3d's padding argument
    vp = F.pad(v.reshape(b, u, dv, height, width), [(tw - 1) // 2, (tw - 1) // 2, (th - 1) // 2, (th - 1) // 2])
    lambdas = F.conv3d(vp, table.unsqueeze(2).to(v.dtype))  # [B, k, V, H, W]
    return torch.einsum('bhkn,bkvn->bhvn', [q, lambdas.reshape(b, k, dv, height * width).to(q.dtype)])


def dense_plain(q: Tensor, v: Tensor, emb: Tensor, heads: int) -> Tensor:
    """The dense form: logits ``a[n, (b, h), m] = q_n^h . E_nm`` for all pairs, then ``y = a v``: ``|h| (|k| + |v|)``
    multiply-adds per pair instead of the lambda form's ``|k| |v|``.

    ``q [n, B h, k]``, ``v [B, u m, V]``, ``emb [n, k, u m]`` -> ``[B, n h, V]``: two batched GEMMs."""
    n = q.shape[0]
    b, m = v.shape[0], v.shape[1]
    logits = contiguous(torch.bmm(q, emb.to(q.dtype)).view(n, b, heads, m).transpose(0, 1)).view(b, n * heads, m)
    return torch.bmm(logits, v.to(logits.dtype))


def tile() -> int:
    """Query block side of the tiled form's blocked executions (the plain ops and the GEMM path): 8, the tile of the
    committed sweeps (a function: TorchScript reads no module-level ints)."""
    return 8


def tiled_plain(q: Tensor, vp: Tensor, table: Tensor, tile: int, step: int, blocks_y: int, blocks_x: int,
                table_size: Optional[List[int]] = None) -> Tensor:
    """The tiled form: each ``T x T`` query block against its context window.

    ``q [G, h, T, T, c]`` query blocks (``G = B by bx``), ``vp [B, H', W', u V]`` padded values (channels last),
    ``table [c, u, K_h, K_w]`` -> ``[G, T T h, V]``. Block ``(b, by, bx)`` sees the window
    ``vp[b, s T by + (0..M_h), s T bx + (0..M_w)]``, ``M = s (T - 1) + K``, query ``(qy, qx)`` at window position
    ``(s qy, s qx)`` (``s = step``). Windows by one gather of whole channel vectors, logits by one matmul with the
    block embedding (the same for every block, section 3.3), then one batched GEMM. ``table_size``: ``[K_h, K_w]``
    as Python ints where they are fixed (see :func:`~..relative_embedding.block_embedding`)."""
    g, h, c = q.shape[0], q.shape[1], q.shape[4]
    b, hv, cv = vp.shape[0], vp.shape[1], vp.shape[3]
    u = table.shape[1]
    kh, kw = (table.shape[2], table.shape[3]) if table_size is None else (table_size[0], table_size[1])
    mh, mw = step * (tile - 1) + kh, step * (tile - 1) + kw
    # every window position of every block as one index into the flattened values, in block order (a permute of
    # gathered windows would make torch.export guard on the number of blocks being 1)
    dev = vp.device
    rows = (torch.arange(blocks_y, device=dev) * (step * tile))[:, None, None, None] \
        + torch.arange(mh, device=dev)[None, None, :, None]  # [by, 1, my, 1]
    cols = (torch.arange(blocks_x, device=dev) * (step * tile))[None, :, None, None] \
        + torch.arange(mw, device=dev)[None, None, None, :]  # [1, bx, 1, mx]
    index = (rows * vp.shape[2] + cols).reshape(blocks_y * blocks_x * mh * mw)
    windows = vp.reshape(b, hv * vp.shape[2], cv).index_select(1, index).reshape(g, mh * mw * u, cv // u)
    emb = block_embedding(table, tile, step, table_size).to(q.dtype)  # [T T, c, M u]
    logits = torch.matmul(q.reshape(g, h, tile * tile, c).transpose(1, 2), emb).reshape(g, tile * tile * h, mh * mw * u)
    return torch.bmm(logits, windows.to(logits.dtype))


def to_blocks(q: Tensor, v: Tensor, kh: int, kw: int, tile: int, step: int, blocks_y: int,
              blocks_x: int) -> Tuple[Tensor, Tensor]:
    """The layer's maps as :func:`tiled_plain`'s operands: ``q [B, h, c, Ho, Wo]`` into ``blocks_y x blocks_x``
    query blocks ``[G, h, T, T, c]`` (zero queries past the map), ``v [B, u V, H, W]`` into the padded values
    ``[B, H', W', u V]`` (a channels-last view) that hold every block's window, the image from row ``(K_h - 1) // 2``
    and column ``(K_w - 1) // 2``. Pads on the contiguous maps, then one permute each (a pad of a permuted tensor
    makes torch.export guard on sizes of 1 and specialise the input size)."""
    b, h, c, ho, wo = q.shape
    height, width = v.shape[2], v.shape[3]
    qb = F.pad(q, [0, blocks_x * tile - wo, 0, blocks_y * tile - ho])
    qb = qb.reshape(b, h, c, blocks_y, tile, blocks_x, tile).permute(0, 3, 5, 1, 4, 6, 2)  # [B, by, bx, h, T, T, c]
    pad_y, pad_x = (kh - 1) // 2, (kw - 1) // 2  # values before the first query's window
    mh, mw = step * (tile - 1) + kh, step * (tile - 1) + kw
    vp = F.pad(v, [pad_x, step * tile * (blocks_x - 1) + mw - width - pad_x,
                   pad_y, step * tile * (blocks_y - 1) + mh - height - pad_y])
    return qb.reshape(b * blocks_y * blocks_x, h, tile, tile, c), vp.permute(0, 2, 3, 1)


class Plain(Backend):
    """``plain``: plain tensor ops, every form, any device and dtype. Not an operator backend: the layer runs them in
    the caller's graph (what graph recorders, transforms and TorchScript record; autograd differentiates them). Where
    the operator is called with it (``torch.ops.timm_lambda.lambda_layer(..., backend='plain', ...)``) it runs them
    inside the operator, and the operator's higher-order gradients (``create_graph=True``) differentiate them."""
    name = 'plain'
    forms = FORMS
    operator = False

    @staticmethod
    def run(plan, q: Tensor, keys: Optional[Tensor], v: Tensor, table: Tensor, shared: Optional[Tensor]) -> Tensor:
        """:func:`lambdas_plain` on the operator's maps (``q [B, h k, H, W]``, ...) -> ``[B, h V, Ho, Wo]``."""
        k, u = table.shape[0], table.shape[1]
        b, height, width = q.shape[0], q.shape[2], q.shape[3]
        n = height * width
        return lambdas_plain(q.reshape(b, q.shape[1] // k, k, n), None if keys is None else keys.reshape(b, u, k, n),
                             v.reshape(b, u, v.shape[1] // u, n), table, shared, height, width, plan.form,
                             plan.stride, plan.count_include_pad, plan.key_norm, plan.global_scope, None)

    def forward(self, plan, q, keys, v, table, shared):
        return self.run(plan, q, keys, v, table, shared).contiguous(), None, None

    def backward(self, plan, gy, q, keys, v, table, shared, content, kn, create_graph: bool = False):
        """The vector-Jacobian product of :meth:`run` (``create_graph``: differentiable, for higher-order gradients:
        the inputs are then the operator's own, with their graph). An input the plain ops do not reach gets None, as
        autograd gives it."""
        inputs = [q, keys, v, table, shared]
        if not create_graph:
            inputs = [None if x is None else x.detach().requires_grad_() for x in inputs]
        wrt = [x for x in inputs if x is not None and x.requires_grad]
        with torch.enable_grad():
            y = self.run(plan, *inputs)
        got = iter(torch.autograd.grad(y, wrt, gy, create_graph=create_graph, allow_unused=True))
        return [next(got) if x is not None and x.requires_grad else None for x in inputs]
