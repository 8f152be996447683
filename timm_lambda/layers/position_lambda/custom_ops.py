"""The lambda computation after the norms as one custom operator (``torch.library.custom_op``) for eager mode and
``torch.compile``: ``timm_lambda::lambda_layer`` and its backward ``timm_lambda::lambda_layer_backward``, with fake
kernels, the autograd rule, an autocast rule and FLOP formulas. What they compute: :mod:`.fused`; which backend runs
them: the call's plan (:mod:`.plan`).

The operator also returns the content lambda and the normalised keys (small: ``[B, k, V]`` and the keys' size), which
its backward takes instead of recomputing them; the backward recomputes the logits instead of saving them, or for a
higher-order gradient (``create_graph=True``) differentiates the plain-op form (:func:`.plain_ops.lambdas_plain`). In
eager mode the same code runs from an ``autograd.Function`` (:func:`lambda_op`), without the operator's Python dispatch
(the operator, its autograd and backend kernels and their redispatches: about 0.12 ms of host time a layer training step
on this project's CPU, tools/host_time.py); under a dispatch mode (FlopCounterMode, fake tensors) and torch.compile the
operator runs.
"""
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from ..execution import BackendUnusable, compiled_copy, warn_once
from . import backends, fused, plan
from .plain_ops import lambdas_plain

__all__ = ['lambda_op']

_LIB = torch.library.Library('timm_lambda', 'FRAGMENT')  # the autocast rule's registration
_TENSORS = (0, 1, 2, 3, 4)  # q, keys, v, table, shared: the inputs with gradients


def _run(backward: bool, backend: str, args: Sequence, saved: Optional[dict] = None) -> tuple:
    """``(result, backend)``: :func:`.fused.forward` (``args``: the operator's) or :func:`.fused.backward` (``gy``
    first) by ``backend`` (``''``: the plan's at run time). A backend that cannot run on this machine
    (:class:`BackendUnusable`) raises in strict mode or where it was chosen by name, else hands the call to the next
    backend of the table (:func:`.backends.fail`)."""
    inputs = args[1:] if backward else args
    q, form, height, width, table, stride = inputs[0], inputs[7], inputs[5], inputs[6], inputs[3], inputs[9]
    while True:
        if not backend:
            backend = plan.backend_at_run_time(form, q, height, width, table.shape[-2], table.shape[-1], stride)
        try:
            out = (fused.backward if backward else fused.forward)(backend, *_fused_args(args, backward), saved=saved)
        except BackendUnusable as e:
            backends.fail(backend, e)
            backend = ''
            continue
        if not backward:
            backends.record(form, backend, q)
        return out, backend


def _fused_args(args: Sequence, backward: bool) -> list:
    """The operator's arguments (``gy`` first for the backward) in :mod:`.fused`'s order: the form first, the backend
    left out."""
    a = list(args)
    i = 1 if backward else 0
    q, keys, v, table, shared, height, width, form, _, stride, cip, key_norm, global_scope = a[i:]
    return [form] + a[:i] + [q, keys, v, table, shared, height, width, stride, cip, key_norm, global_scope]


@torch.library.custom_op('timm_lambda::lambda_layer', mutates_args=())
def _op(q: Tensor, keys: Optional[Tensor], v: Tensor, table: Tensor, shared: Optional[Tensor], height: int,
        width: int, form: str, backend: str, stride: int, count_include_pad: bool, key_norm: str,
        global_scope: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``(y, lambda^c, the normalised keys)``: the output and, for the backward (not differentiable), the content
    lambda ``[B, k, V]`` and the normalised keys ``[B, u, k, n]`` (empty where there are no keys, and the keys of
    ``key_norm='none'``: the backward reads the inputs then)."""
    kept = {}
    y = _run(False, backend, (q, keys, v, table, shared, height, width, form, backend, stride, count_include_pad,
                              key_norm, global_scope), kept)[0]
    y = y.contiguous()  # (as the fake kernel says: a compiled graph checks the strides)
    if keys is None:
        return y, q.new_empty(0), q.new_empty(0)
    return y, kept['lam'], q.new_empty(0) if key_norm == 'none' else kept['kn']


@_op.register_fake
def _(q, keys, v, table, shared, height, width, form, backend, stride, count_include_pad, key_norm, global_scope):
    k, u = table.shape[0], table.shape[1]
    channels = q.shape[1] // k * (v.shape[1] // u)  # |h| |v|
    y = v.new_empty(q.shape[0], channels, (height + stride - 1) // stride, (width + stride - 1) // stride)
    if keys is None:
        return y, q.new_empty(0), q.new_empty(0)
    lam = v.new_empty(q.shape[0], k, v.shape[1] // u)
    return y, lam, q.new_empty(0) if key_norm == 'none' else keys.new_empty(q.shape[0], u, k, height * width)


def _kept(keys: Optional[Tensor], lam: Tensor, kn: Tensor, key_norm: str) -> Optional[dict]:
    """What the forward kept for the backward (:func:`.fused.backward`'s ``saved``), from the operator's outputs."""
    if keys is None:
        return None  # (the content lambda is the shared part, if any: read from the inputs)
    return dict(lam=lam, kn=None if key_norm == 'none' else kn)


@torch.library.custom_op('timm_lambda::lambda_layer_backward', mutates_args=())
def _op_backward(gy: Tensor, q: Tensor, keys: Optional[Tensor], v: Tensor, table: Tensor, shared: Optional[Tensor],
                 lam: Tensor, kn: Tensor, height: int, width: int, form: str, backend: str, stride: int,
                 count_include_pad: bool, key_norm: str, global_scope: bool) -> List[Tensor]:
    """The gradients of q, keys, v, table and shared (an empty tensor for an input that is None), contiguous;
    ``lam``, ``kn``: what the forward returned besides its output (not recomputed)."""
    grads = _run(True, backend, (gy, q, keys, v, table, shared, height, width, form, backend, stride,
                                 count_include_pad, key_norm, global_scope), _kept(keys, lam, kn, key_norm))[0]
    return [q.new_empty(0) if g is None else g.contiguous() for g in grads]


@_op_backward.register_fake
def _(gy, q, keys, v, table, shared, *args):
    return [gy.new_empty(0) if x is None else x.new_empty(x.shape) for x in (q, keys, v, table, shared)]


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*(inputs[i] for i in _TENSORS), output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)  # (no zero-filled gradients made for them: two launches)
    ctx.args = list(inputs[5:])  # the ints, strings and flags


def _higher_order(ctx, gy: Tensor, inputs: list) -> tuple:
    """A differentiable vector-Jacobian product of the plain-op form (``create_graph=True``). An input that the plain
    ops do not reach gets None, as autograd gives it for the plain-op form."""
    warn_once('create_graph', 'higher-order gradients (create_graph=True) differentiate the plain-op form of the '
                              'lambda layer: correct, but slower and with more memory than the custom operator')
    height, width, form, _, stride, cip, key_norm, global_scope = ctx.args
    needs = [ctx.needs_input_grad[i] and inputs[i] is not None for i in _TENSORS]
    with torch.enable_grad():
        q, keys, v = fused.views(inputs[0], inputs[1], inputs[2], inputs[3], height, width)
        out = lambdas_plain(q, keys, v, inputs[3], inputs[4], height, width, form, stride, cip, key_norm,
                            global_scope, None)
    wrt = [x for x, need in zip(inputs, needs) if need]
    got = iter(torch.autograd.grad(out, wrt, gy, create_graph=True, allow_unused=True))
    return tuple(next(got) if need else None for need in needs)


def _backward(ctx, gy: Tensor, *_):
    saved = list(ctx.saved_tensors)
    inputs, kept = saved[:5], saved[5:]
    if torch.is_grad_enabled():  # create_graph=True
        grads = _higher_order(ctx, gy, inputs)
    else:
        grads = _op_backward(gy, *inputs, *kept, *ctx.args)
        grads = [None if x is None else g for g, x in zip(grads, inputs)]
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:5])) + (None,) * 8


_op.register_autograd(_backward, setup_context=_setup)


def _in_autocast_dtype(*args):
    # torch.library.register_autocast (torch >= 2.7) fixes the dtype at registration; autocast's dtype is chosen at
    # run time (bfloat16 or float16, on either device), so this rule reads it as a matmul does
    device = args[0].device.type
    with torch.autocast(device, enabled=False):
        return _op(*_autocast_inputs(args, torch.get_autocast_dtype(device)))


for _key in ('AutocastCPU', 'AutocastCUDA'):
    _LIB.impl(_op._name, _in_autocast_dtype, _key)


def _autocast_inputs(args, dtype: torch.dtype) -> list:
    """The operator's autocast rule: every floating input but float64 in autocast's ``dtype``."""
    return [a.to(dtype) if isinstance(a, Tensor) and a.is_floating_point() and a.dtype != torch.float64 else a
            for a in args]


class _Eager(torch.autograd.Function):
    """The operator's eager path: the same forward and backward, the plan's backend kept for the backward."""

    @staticmethod
    def forward(ctx, *args):
        ctx.kept = {}  # the content lambda and the normalised keys, not recomputed in the backward
        out, backend = _run(False, args[8], args, ctx.kept)
        ctx.save_for_backward(*(args[i] for i in _TENSORS))
        ctx.args = list(args[5:])
        ctx.args[3] = backend  # the backward runs the backend that ran the forward
        return out

    @staticmethod
    def backward(ctx, gy):
        inputs = list(ctx.saved_tensors)
        if torch.is_grad_enabled():
            grads = _higher_order(ctx, gy, inputs)
        else:
            grads = _run(True, ctx.args[3], [gy] + inputs + ctx.args, ctx.kept)[0]
        return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:5])) + (None,) * 8


def _eager(device: str) -> bool:
    """Not traced by torch.compile, under no dispatch mode (FlopCounterMode, fake tensors) and on CPU or CUDA tensors
    (the meta device has no autocast state to read): the eager path may run."""
    return (device in ('cpu', 'cuda') and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0)


@torch.jit.unused
def lambda_op(q: Tensor, keys: Optional[Tensor], v: Tensor, table: Tensor, shared: Optional[Tensor], height: int,
              width: int, form: str, backend: str, stride: int, count_include_pad: bool, key_norm: str,
              global_scope: bool) -> Tensor:
    """``timm_lambda::lambda_layer`` (:mod:`.fused`: the layer's maps ``q [B, h k, H, W]``, ``keys [B, u k, H, W]``,
    ``v [B, u V, H, W]``), in eager mode without its dispatch. ``backend``: the plan's (``''``: decided when the
    operator runs)."""
    args = [q, keys, v, table, shared, height, width, form, backend, stride, count_include_pad, key_norm,
            global_scope]
    device = q.device.type
    if not _eager(device):
        return _op(*[compiled_copy(a) if isinstance(a, Tensor) else a for a in args])[0]  # compiled: copies, not views
    if torch.is_autocast_enabled(device):
        args = _autocast_inputs(args, torch.get_autocast_dtype(device))
        with torch.autocast(device, enabled=False):
            return _eager_call(args)
    return _eager_call(args)


def _eager_call(args: list) -> Tensor:
    if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args[:5]):
        return _Eager.apply(*args)
    return _run(False, args[8], args)[0]  # nothing to differentiate: no autograd node


# FLOPs: the arithmetic the computation needs (not what a backend issues): the content lambda |u| |k| |n| |v| per
# image, the content term |h| |k| |v| per output query; the position term as the tiled kernels compute it (per query
# |h| |u| K_h K_w logits of depth c, a value row of depth |v| per scope offset in the image; a stride-2 layer on its
# 3x3 query patches, c = 9 |k|, against the pooled K_h + 2 table) or as the dense form's two GEMMs; the backward: the
# logits again and the gradients of q and the table (3x c), of the values and of the logits (2x |v|), twice the
# content parts.
def _in_image(size: int, queries: int, step: int, k: int) -> int:
    """Scope offsets along one axis that meet the image, summed over the queries."""
    lo = (k - 1) // 2
    return sum(max(0, min(k, lo + size - step * q) - max(0, lo - step * q)) for q in range(queries))


def _flops(q, keys, v, table, shared, height, width, form, backend, stride, cip, key_norm, global_scope,
           out_shape=None, backward=False) -> int:
    (b, hk, _, _), (_, uv, _, _), (k, u) = q, v, table[:2]
    h, dv, n = hk // k, uv // u, height * width
    ho, wo = (height + stride - 1) // stride, (width + stride - 1) // stride
    content = 0 if keys is None else b * u * k * n * dv
    if keys is not None or shared is not None:
        content += b * ho * wo * h * k * dv
    th, tw = table[2:]
    if global_scope:
        th, tw = 2 * height - 1, 2 * width - 1
    if form == 'dense':
        position = n * b * h * n * u * ((3 * k + 2 * dv) if backward else (k + dv))
    else:
        c, kh, kw = (k, th, tw) if stride == 1 else (9 * k, th + 2, tw + 2)
        logits = b * ho * wo * h * u * kh * kw * c
        values = b * h * u * dv * _in_image(height, ho, stride, kh) * _in_image(width, wo, stride, kw)
        position = (3 * logits + 2 * values) if backward else (logits + values)
    return 2 * position + 2 * content * (2 if backward else 1)


register_flop_formula(torch.ops.timm_lambda.lambda_layer)(_flops)
register_flop_formula(torch.ops.timm_lambda.lambda_layer_backward)(
    lambda gy, q, keys, v, table, shared, lam, kn, *args, out_shape=None: _flops(q, keys, v, table, shared, *args,
                                                                               backward=True))
