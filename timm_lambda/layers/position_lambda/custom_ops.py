"""The dense and tiled forms as custom operators (``torch.library.custom_op``) for eager mode and ``torch.compile``.

Each has a backward operator that recomputes the logits instead of saving them (or, for ``create_graph=True``,
differentiates the plain-op form), a fake kernel, an autocast rule and a FLOP formula. The dense operator is two
batched GEMMs (the ``gemm`` backend); the tiled operator's forward and backward run by the backend that the table of
:mod:`.backends` chooses for the call (the CPU kernel, Triton's kernels, or the GEMM path of :mod:`.gemm`). In eager
mode both run the same code from an ``autograd.Function``, without the operators' Python dispatch (:func:`_register`).
"""
import functools
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from . import backends
from .execution import compiled_copy, warn_once
from .plain_ops import dense_plain, operator_content_term, tile, tiled_plain, to_blocks

__all__ = ['dense_op', 'tiled_op']

_LIB = torch.library.Library('timm_lambda', 'FRAGMENT')  # the autocast rules' registrations


def _backward_fake(gy, q, v, table, *args):
    return q.new_empty(q.shape), v.new_empty(v.shape), table.new_empty(table.shape)  # contiguous, as the real ones


def _autograd_rules(backward_fn, plain, tensors: Sequence[int]):
    """``(setup_context, backward)`` of an operator whose inputs at positions ``tensors`` get gradients (an optional
    one may be None), in the order ``backward_fn(gy, *inputs)`` returns them; a higher-order gradient
    differentiates ``plain`` (the same arguments as the operator) instead. Shared by the custom operator's
    registration and its eager path (:func:`_register`)."""

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
            grads = backward_fn(gy, *inputs)
        out: List[Optional[Tensor]] = [None] * passed
        for i, g, need in zip(tensors, grads, needs):
            if need:
                out[i] = g
        return tuple(out)

    return setup, backward


def _autocast_inputs(args, dtype: torch.dtype) -> list:
    """The operators' autocast rule: every floating input but float64 in autocast's ``dtype``."""
    return [a.to(dtype) if isinstance(a, Tensor) and a.is_floating_point() and a.dtype != torch.float64 else a
            for a in args]


def _eager(device: str) -> bool:
    """Not traced by torch.compile, under no dispatch mode (FlopCounterMode, fake tensors) and on CPU or CUDA
    tensors (the meta device has no autocast state to read): an operator's eager path may run."""
    return (device in ('cpu', 'cuda') and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0)


def _register(op, backward_op, impl, backward_impl, plain, flops, tensors: Sequence[int] = (0, 1, 2)) -> Callable:
    """The autograd (:func:`_autograd_rules`), FLOP and autocast registrations of ``op`` (whose body is ``impl``)
    and the FLOPs of its ``backward_op`` (body ``backward_impl``; ``flops`` of the same inputs with
    ``backward=True``). Returns the entry point: ``op``, or in eager mode (:func:`_eager`) an ``autograd.Function``
    that runs ``impl`` and ``backward_impl`` by the same rules without the operators' Python dispatch (the operator,
    its autograd and backend kernels and their redispatches: about 0.12 ms of host time a layer training step on this
    project's CPU, as much as a dozen small aten launches: tools/host_time.py)."""
    setup, backward = _autograd_rules(backward_op, plain, tensors)
    op.register_autograd(backward, setup_context=setup)
    register_flop_formula(getattr(torch.ops.timm_lambda, op._name))(flops)
    register_flop_formula(getattr(torch.ops.timm_lambda, op._name + '_backward'))(
        lambda gy, *inputs, out_shape=None: flops(*inputs, backward=True))

    def in_autocast_dtype(*args):
        # torch.library.register_autocast (torch >= 2.7) fixes the dtype at registration; autocast's dtype is
        # chosen at run time (bfloat16 or float16, on either device), so this rule reads it as a matmul does
        device = args[0].device.type
        with torch.autocast(device, enabled=False):
            return op(*_autocast_inputs(args, torch.get_autocast_dtype(device)))

    for key in ('AutocastCPU', 'AutocastCUDA'):
        _LIB.impl(op._name, in_autocast_dtype, key)

    eager_setup, eager_backward = _autograd_rules(backward_impl, plain, tensors)

    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            out = impl(*args)
            eager_setup(ctx, args, out)
            return out

        @staticmethod
        def backward(ctx, gy):
            return eager_backward(ctx, gy)

    def run(*args):
        device = args[0].device.type
        if not _eager(device):
            return op(*args)
        if not torch.is_autocast_enabled(device):
            return Eager.apply(*args)
        with torch.autocast(device, enabled=False):
            return Eager.apply(*_autocast_inputs(args, torch.get_autocast_dtype(device)))

    return run


@torch.jit.unused
def _plain_vjp(plain, inputs: list, tensors: Sequence[int], grad: Tensor, needs: Sequence[bool]):
    """A differentiable vector-Jacobian product of ``plain(*inputs)`` with respect to ``inputs[i]`` for ``i`` in
    ``tensors`` where ``needs``: the operators' backward when a higher-order gradient is requested
    (``create_graph=True``).

    An input that ``plain`` does not reach gets None, as autograd gives it for the plain-op form: a backward's None
    is autograd's zero gradient, and the input's gradient stays None where nothing else reaches it (zeros would
    leave ``.grad`` a tensor and make ``torch.autograd.grad`` without ``allow_unused`` return where the plain-op form
    raises). tests/test_position_lambda.py compares with the plain-op forms."""
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


def _dense_impl(q: Tensor, v: Tensor, emb: Tensor, heads: int) -> Tensor:
    backends.record('dense', 'gemm', q)
    return dense_plain(q.contiguous(), v.contiguous(), emb.contiguous(), heads).contiguous()


@torch.library.custom_op('timm_lambda::dense_position_lambdas', mutates_args=())
def _dense(q: Tensor, v: Tensor, emb: Tensor, heads: int) -> Tensor:
    return _dense_impl(q, v, emb, heads)


@_dense.register_fake
def _(q, v, emb, heads):
    return v.new_empty(v.shape[0], q.shape[0] * heads, v.shape[2])


def _dense_backward_impl(gy: Tensor, q: Tensor, v: Tensor, emb: Tensor, heads: int) -> Tuple[Tensor, Tensor, Tensor]:
    q, v, emb, gy = q.contiguous(), v.contiguous(), emb.contiguous(), gy.contiguous()
    n, bh, _ = q.shape
    b, m = v.shape[0], v.shape[1]
    logits = torch.bmm(q, emb).view(n, b, heads, m).transpose(0, 1).reshape(b, n * heads, m)  # recomputed
    gv = torch.bmm(logits.transpose(1, 2), gy)
    glogits = torch.bmm(gy, v.transpose(1, 2)).view(b, n, heads, m).transpose(0, 1).reshape(n, bh, m)
    gq, gemb = torch.bmm(glogits, emb.transpose(1, 2)), torch.bmm(q.transpose(1, 2), glogits)
    return gq.contiguous(), gv.contiguous(), gemb.contiguous()  # bmm may hand back a transposed layout


@torch.library.custom_op('timm_lambda::dense_position_lambdas_backward', mutates_args=())
def _dense_backward(gy: Tensor, q: Tensor, v: Tensor, emb: Tensor, heads: int) -> Tuple[Tensor, Tensor, Tensor]:
    return _dense_backward_impl(gy, q, v, emb, heads)


def _dense_flops(q, v, emb, heads, out_shape=None, backward=False) -> int:
    """Logits ``n (B h) k (u m)`` and output ``B (n h) (u m) V`` multiply-adds; the backward: the logits again,
    their gradient and the gradients of ``q``, ``v``, ``emb`` (``3 k + 2 V`` instead of ``k + V``)."""
    (n, bh, k), (_, um, dv) = q, v
    return 2 * n * bh * um * ((3 * k + 2 * dv) if backward else (k + dv))


_dense_backward.register_fake(_backward_fake)
_run_dense = _register(_dense, _dense_backward, _dense_impl, _dense_backward_impl, dense_plain, _dense_flops)


@torch.jit.unused
def dense_op(q: Tensor, v: Tensor, emb: Tensor, heads: int) -> Tensor:
    """:func:`.plain_ops.dense_plain` by the custom operator (in eager mode without its dispatch: :func:`_register`)."""
    q, v, emb = compiled_copy(q), compiled_copy(v), compiled_copy(emb)  # compiled: copies, not views
    return _run_dense(q, v.to(q.dtype), emb.to(q.dtype), heads)


# ----------------------------------------------------------------------------------------------------------
# tiled: q [B, h, c, Ho, Wo], v [B, u V, H, W], table [c, u, K_h, K_w] -> y [B, h V, Ho, Wo]: the layer's own layouts
# (query (oy, ox) meets the values from (step oy - (K_h - 1) // 2, step ox - (K_w - 1) // 2) on, zero outside the
# image). The CPU kernel reads and writes them directly; the GEMM path below works on the query blocks and padded
# windows of :func:`.plain_ops.to_blocks` (blocks of tile() // step queries a side). An optional content lambda
# [B, c, V] is applied to the same queries and added (eq. 2): in the kernel's accumulators, elsewhere by a matmul.


@torch.library.custom_op('timm_lambda::tiled_position_lambdas', mutates_args=())
def _tiled(q: Tensor, v: Tensor, table: Tensor, step: int, content: Optional[Tensor] = None) -> Tensor:
    return backends.run_tiled(False, q, v, table, step, content)


@_tiled.register_fake
def _(q, v, table, step, content=None):
    return v.new_empty(q.shape[0], q.shape[1] * (v.shape[1] // table.shape[1]), q.shape[3], q.shape[4])


@torch.library.custom_op('timm_lambda::tiled_position_lambdas_backward', mutates_args=())
def _tiled_backward(gy: Tensor, q: Tensor, v: Tensor, table: Tensor, step: int,
                    content: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of q, v, table and content (an empty tensor without content)."""
    return backends.run_tiled(True, gy, q, v, table, step, content)


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
    return y if content is None else operator_content_term(q, content) + y


_run_tiled = _register(_tiled, _tiled_backward, functools.partial(backends.run_tiled, False),
                       functools.partial(backends.run_tiled, True), _tiled_plain_as_op, _tiled_flops,
                       tensors=(0, 1, 2, 4))


@torch.jit.unused
def tiled_op(q: Tensor, v: Tensor, table: Tensor, step: int, content: Optional[Tensor] = None) -> Tensor:
    """:func:`.plain_ops.tiled_plain` by the custom operator (in eager mode without its dispatch: :func:`_register`),
    in the layer's layouts: ``q [B, h, c, Ho, Wo]``, ``v [B, u V, H, W]``, ``table [c, u, K_h, K_w]``, optionally a
    content lambda ``[B, c, V]`` applied to the same queries -> ``[B, h V, Ho, Wo]`` (see the comment above
    ``_tiled``)."""
    q, v = compiled_copy(q), compiled_copy(v)  # compiled: copies, not views
    return _run_tiled(q, v.to(q.dtype), table.to(q.dtype), step, None if content is None else content.to(q.dtype))
