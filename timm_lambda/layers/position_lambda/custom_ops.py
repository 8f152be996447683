"""The lambda computation after the norms as one custom operator (``torch.library.custom_op``) for eager mode and
``torch.compile``: ``timm_lambda::lambda_layer`` and its backward ``timm_lambda::lambda_layer_backward``, with fake
kernels, the autograd rule, an autocast rule and FLOP formulas: a boundary that checks every argument against its
tensors (:func:`check_call`) before any backend runs. What they compute: the plan's backend (:mod:`.backends`,
:mod:`.fused`); the plan (:mod:`.plan`) travels in their arguments, so that the backward runs what the forward ran.

The operator also returns the content lambda and the normalised keys (small: ``[B, k, V]`` and the keys' size),
which its backward takes instead of recomputing them; the backward recomputes the logits instead of saving them, or
for a higher-order gradient (``create_graph=True``) differentiates the plain-op form (:class:`.plain_ops.Plain`).
In eager mode the same code runs from an ``autograd.Function`` (:func:`lambda_op`), without the operator's Python
dispatch (about 0.12 ms of host time a layer training step on this project's CPU); everything its backward reads
goes through ``save_for_backward`` (activation checkpointing, ``save_on_cpu`` and any ``saved_tensors_hooks`` see
it). Under a dispatch mode (FlopCounterMode, fake tensors) and torch.compile the operator runs.
"""
import functools
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from ..execution import BackendUnusable, warn_once
from . import backends
from .fused import content_lambda
from .plain_ops import KEY_NORMS
from .plan import Plan

__all__ = ['lambda_op', 'check_call', 'flops']

_LIB = torch.library.Library('timm_lambda', 'FRAGMENT')  # the autocast rule's registration
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_NAMES = ('q', 'keys', 'v', 'table', 'shared')
_DTYPE_NAMES = {d: str(d)[6:] for d in _FLOATS}  # ('torch.float32' -> 'float32': served_backends' keys)


# ----------------------------------------------------------------------------------------------------------------------
# The boundary: every argument against the tensors, one error naming it, on every backend, device and mode
def _shape(x: Tensor) -> list:
    return list(x.shape)


def _meta(x):
    return None if x is None else (x.shape, x.dtype, x.device)


_CHECKED: dict = {}  # the keys of calls found consistent (:func:`check_call`'s host time: a dict lookup once seen)


def check_call(q, keys, v, table, shared, stride, count_include_pad, key_norm, global_scope, form, backend, variant,
               compute_dtype, tiling, gy=None, content=None, kn=None) -> None:
    """:func:`_check_call`, once for each combination of the tensors' shapes, dtypes and devices, the arguments and the
    registry's :func:`.backends.version` (symbolic sizes and non-tensors: every time)."""
    try:
        key = (_meta(q), _meta(keys), _meta(v), _meta(table), _meta(shared), stride, count_include_pad, key_norm,
               global_scope, form, backend, variant, compute_dtype, tuple(tiling), _meta(gy), _meta(content),
               _meta(kn), backends.VERSION[0], type(stride), type(count_include_pad), type(global_scope))  # (1 == True)
        if key in _CHECKED:
            return
    except (AttributeError, TypeError):  # not a tensor (the full check names it), or symbolic sizes (unhashable)
        key = None
    _check_call(q, keys, v, table, shared, stride, count_include_pad, key_norm, global_scope, form, backend, variant,
                compute_dtype, tiling, gy, content, kn)
    if key is not None:
        if len(_CHECKED) >= 4096:
            _CHECKED.clear()
        _CHECKED[key] = None


def _check_call(q, keys, v, table, shared, stride, count_include_pad, key_norm, global_scope, form, backend, variant,
                compute_dtype, tiling, gy=None, content=None, kn=None) -> None:
    """Raise a ValueError (a shape, size or choice) or TypeError (a type, dtype or device) naming the argument, what
    it got and what is accepted, unless the operator's arguments are consistent: ``q [B, h k, H, W]``, ``keys [B, u
    k, H, W]`` or None, ``v [B, u V, H, W]``, ``table [k, u, R_h, R_w]`` (odd sides; a global one covering ``2 H - 1
    x 2 W - 1``), ``shared [B, k, V]`` or None, one floating dtype and one device; ``stride`` 1 or 2; a key norm of
    Table 11; a plan that the backend itself would make for the call (:meth:`.backends.Backend.decide`). The
    backward's ``gy`` has the output's shape, ``content`` and ``kn`` the forward's (or are empty)."""
    tensors = dict(q=q, keys=keys, v=v, table=table, shared=shared)
    for name, x in tensors.items():
        if x is None and name in ('keys', 'shared'):
            continue
        if not isinstance(x, Tensor):
            raise TypeError(f'{name} must be a Tensor{" or None" if name in ("keys", "shared") else ""}, '
                            f'got {type(x).__name__}')
        if x.dtype not in _FLOATS:
            raise TypeError(f'{name} must be a floating tensor (float16, bfloat16, float32 or float64), got {x.dtype}')
        if x.dtype != q.dtype:
            raise TypeError(f'{name} must have the dtype of q ({q.dtype}; under autocast every input but float64 is '
                            f'cast to its dtype), got {x.dtype}')
        if x.device != q.device:
            raise TypeError(f'{name} must be on the device of q ({q.device}), got {x.device}')
    if q.dim() != 4:
        raise ValueError(f'q must be [B, h k, H, W] (4-D), got shape {_shape(q)}')
    if table.dim() != 4 or table.shape[0] < 1 or table.shape[1] < 1:
        raise ValueError(f'table must be [k, u, R_h, R_w] (4-D, k and u >= 1), got shape {_shape(table)}')
    b, hk, height, width = q.shape
    k, u, rh, rw = table.shape
    if height < 1 or width < 1:
        raise ValueError(f'q must have a map of at least 1x1, got shape {_shape(q)}')
    if rh % 2 == 0 or rw % 2 == 0:
        raise ValueError(f'table must have odd sides R_h and R_w (offsets -(R-1)/2 .. (R-1)/2), got shape '
                         f'{_shape(table)}')
    if hk < 1 or hk % k:
        raise ValueError(f'q must have h k channels, a multiple of the table\'s k={k}, got {hk} (shape {_shape(q)})')
    if v.dim() != 4 or v.shape[0] != b or tuple(v.shape[2:]) != (height, width) or v.shape[1] < 1 or v.shape[1] % u:
        raise ValueError(f'v must be [B, u V, H, W] = [{b}, a multiple of u={u}, {height}, {width}] (as q and the '
                         f'table), got shape {_shape(v)}')
    dv = v.shape[1] // u
    if keys is not None and tuple(keys.shape) != (b, u * k, height, width):
        raise ValueError(f'keys must be None or [B, u k, H, W] = {[b, u * k, height, width]}, got shape '
                         f'{_shape(keys)}')
    if shared is not None and tuple(shared.shape) != (b, k, dv):
        raise ValueError(f'shared must be None or [B, k, V] = {[b, k, dv]}, got shape {_shape(shared)}')
    # (a plan carried across a graph break reaches a compiled graph's operator as symbols: each is one int, guarded)
    stride = int(stride) if isinstance(stride, torch.SymInt) else stride
    tiling = tuple(int(t) if isinstance(t, torch.SymInt) else t for t in tiling)
    _check_choices(stride, count_include_pad, key_norm, global_scope, form, backend, variant, compute_dtype, tiling)
    if global_scope and (rh < 2 * height - 1 or rw < 2 * width - 1):
        raise ValueError(f'a global table of {rh}x{rw} covers maps up to {(rh + 1) // 2}x{(rw + 1) // 2} '
                         f'(max_size), got a map of {height}x{width}')
    check = _check_plan if type(height) is int and type(width) is int and type(b) is int else \
        _check_plan.__wrapped__  # (symbolic sizes: not hashable, and guarded where compared)
    check(form, backend, variant, compute_dtype, tiling, q.device.type, q.dtype, stride, height, width,
          min(rh, 2 * height - 1), min(rw, 2 * width - 1), k, u, dv, hk // k, b, backends.VERSION[0])
    if gy is not None:
        out = [b, hk // k * dv, (height + stride - 1) // stride, (width + stride - 1) // stride]
        if not isinstance(gy, Tensor) or list(gy.shape) != out or gy.dtype != q.dtype or gy.device != q.device:
            got = f'shape {_shape(gy)}, {gy.dtype} on {gy.device}' if isinstance(gy, Tensor) else type(gy).__name__
            raise ValueError(f"gy must be the output's gradient: shape {out}, {q.dtype} on {q.device}; got {got}")
        for name, x, want in (('content', content, [b, k, dv]), ('kn', kn, [b, u, k, height * width])):
            if x.numel() and (list(x.shape) != want or x.dtype != q.dtype and name == 'kn' or x.device != q.device):
                raise ValueError(f"{name} must be empty or what the forward returned: shape {want} on {q.device}, "
                                 f"got shape {_shape(x)}, {x.dtype} on {x.device}")


@functools.lru_cache(maxsize=256, typed=True)  # (typed: 2.0 and True are no stride, though 2.0 == 2, True == 1)
def _check_choices(stride, count_include_pad, key_norm, global_scope, form, backend, variant, compute_dtype,
                   tiling) -> None:
    if not isinstance(stride, int) or isinstance(stride, bool) or stride not in (1, 2):
        raise ValueError(f'stride must be 1 or 2, got {stride!r}')
    for name, flag in (('count_include_pad', count_include_pad), ('global_scope', global_scope)):
        if not isinstance(flag, bool):
            raise TypeError(f'{name} must be True or False, got {flag!r}')
    if key_norm not in KEY_NORMS:
        raise ValueError(f'key_norm must be one of {KEY_NORMS}, got {key_norm!r}')
    if form not in backends.FORMS:
        raise ValueError(f'form must be one of {backends.FORMS}, got {form!r}')
    if backend not in backends.REGISTRY or not backends.REGISTRY[backend].operator:
        raise ValueError(f'backend must be an operator backend, one of '
                         f'{tuple(n for n, b in backends.REGISTRY.items() if b.operator)}, got {backend!r}'
                         + (' (plain tensor ops run in the caller\'s graph, not inside the operator)'
                            if backend in backends.REGISTRY else ''))
    if variant not in (('',) if stride == 1 else ('patched', 'pooled', '')):
        raise ValueError(f"variant must be '' at stride 1 and 'patched' or 'pooled' at stride 2 (the backend's), got "
                         f'{variant!r} at stride {stride}')
    if compute_dtype not in _FLOATS:
        raise TypeError(f'compute_dtype must be a floating dtype, got {compute_dtype!r}')


@functools.lru_cache(maxsize=1024)
def _check_plan(form, backend, variant, compute_dtype, tiling, device, dtype, stride, height, width, kh, kw, k, u, dv,
                heads, batch, version) -> None:
    """The plan's backend serves the call, and its decisions are the ones the backend makes for it (``version``: the
    registry's, :func:`.backends.version`, so that a changed rule is checked anew)."""
    queries = batch * ((height + stride - 1) // stride) * ((width + stride - 1) // stride) if device == 'cuda' else 0
    call = backends.Call(form, device, dtype, stride, queries, 2 * height - 1 <= kh and 2 * width - 1 <= kw, height,
                         width, kh, kw, k, u, dv, heads)
    reasons = backends.get(backend).cannot_compute(call)  # (not the machine's: _run hands an unusable one on)
    if reasons:
        raise ValueError(f"backend {backend!r} cannot run {backends.describe(call)}: {'; '.join(reasons)}")
    want = backends.get(backend).decide(call)
    if (variant, compute_dtype, tuple(tiling)) != (want.variant, want.compute_dtype or dtype, tuple(want.tiling)):
        raise ValueError(f'the plan (variant={variant!r}, compute_dtype={compute_dtype}, tiling={list(tiling)}) is '
                         f'not the one backend {backend!r} makes for {backends.describe(call)}: '
                         f'variant={want.variant!r}, compute_dtype={want.compute_dtype or dtype}, '
                         f'tiling={list(want.tiling)}')


# ----------------------------------------------------------------------------------------------------------------------
# The one place a backend runs
def _run(plan: Plan, direction: str, tensors: Sequence, extra: Sequence = ()) -> Tuple[tuple, Plan]:
    """``(result, the plan that ran)``: the plan's backend's forward (``tensors``: q, keys, v, table, shared) or
    backward (``extra``: gy, content, kn). A backend that cannot run on this machine (:class:`BackendUnusable`: a
    Triton that cannot compile kernels here, a CPU kernel gone since the plan) raises in strict mode or where it was
    chosen by name, else hands the call to the backend the registry chooses without it (:func:`.backends.fail`):
    handled here, once a call. A backward runs without autocast (``.backward()`` called inside an autocast region
    keeps it on): it computes in the plan's dtypes, as its forward did."""
    device = tensors[0].device.type
    if direction != 'forward' and torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):
            return _run(plan, direction, tensors, extra)
    backend = backends.REGISTRY[plan.backend]
    try:
        out = backend.forward(plan, *tensors) if direction == 'forward' else \
            backend.backward(plan, extra[0], *tensors, *extra[1:])
    except BackendUnusable as e:
        backends.fail(plan.backend, e)
        plan, backend = _replan(plan, tensors)
        out = backend.forward(plan, *tensors) if direction == 'forward' else \
            backend.backward(plan, extra[0], *tensors, *extra[1:])
    q = tensors[0]
    key = (plan.form, plan.backend, q.device.type, _DTYPE_NAMES.get(q.dtype) or str(q.dtype)[6:], direction)
    if key in backends.SERVED:  # (counted here: the first of each combination is logged by record)
        backends.SERVED[key] += 1
    else:
        backends.record(plan.form, plan.backend, q.device.type, q.dtype, direction)
    return out, plan


def _replan(plan: Plan, tensors: Sequence):
    """The plan of the backend the registry chooses now (the failed one passed over), for the same call."""
    q, table, v = tensors[0], tensors[3], tensors[2]
    b, hk, height, width = q.shape
    k, u = table.shape[0], table.shape[1]
    stride = plan.stride
    kh, kw = min(table.shape[2], 2 * height - 1), min(table.shape[3], 2 * width - 1)
    queries = b * ((height + stride - 1) // stride) * ((width + stride - 1) // stride)
    call = backends.Call(plan.form, q.device.type, q.dtype, stride, queries if q.is_cuda else 0,
                         2 * height - 1 <= kh and 2 * width - 1 <= kw, height, width, kh, kw, k, u, v.shape[1] // u,
                         hk // k)
    name = backends.choose(call)
    backend = backends.get(name)
    d = backend.decide(call)
    return plan._replace(backend=name, variant=d.variant, compute_dtype=d.compute_dtype or q.dtype,
                         tiling=tuple(d.tiling)), backend


def _plan_args(plan: Plan) -> tuple:
    return (plan.stride, plan.count_include_pad, plan.key_norm, plan.global_scope, plan.form, plan.backend,
            plan.variant, plan.compute_dtype, list(plan.tiling))


def _plan_of(stride, count_include_pad, key_norm, global_scope, form, backend, variant, compute_dtype, tiling,
             mode='compile') -> Plan:
    return Plan(form, backend, mode, variant, compute_dtype, compute_dtype, tuple(tiling), False, stride,
                count_include_pad, key_norm, global_scope)  # (dtype: unread inside the operator)


# ----------------------------------------------------------------------------------------------------------------------
# The registered operators
@torch.library.custom_op('timm_lambda::lambda_layer', mutates_args=())
def _op(q: Tensor, keys: Optional[Tensor], v: Tensor, table: Tensor, shared: Optional[Tensor], stride: int,
        count_include_pad: bool, key_norm: str, global_scope: bool, form: str, backend: str, variant: str,
        compute_dtype: torch.dtype, tiling: List[int]) -> Tuple[Tensor, Tensor, Tensor]:
    """``(y, lambda^c, the normalised keys)``: the output and, for the backward (not differentiable), the content
    lambda ``[B, k, V]`` and the normalised keys ``[B, u, k, n]`` (empty where there are no keys, and the keys of
    ``key_norm='none'``: the backward reads the inputs then)."""
    args = (stride, count_include_pad, key_norm, global_scope, form, backend, variant, compute_dtype, tiling)
    check_call(q, keys, v, table, shared, *args)
    (y, content, kn), _ = _run(_plan_of(*args), 'forward', (q, keys, v, table, shared))
    y = y.contiguous()  # (as the fake kernel says: a compiled graph checks the strides)
    if keys is None:
        return y, q.new_empty(0), q.new_empty(0)
    if content is None:  # (a backend that keeps nothing for its backward: the outputs are the fake kernel's still)
        content, kn = content_lambda(keys, v, shared, key_norm, table.shape[0])
    return y, content, q.new_empty(0) if key_norm == 'none' else kn


@_op.register_fake
def _(q, keys, v, table, shared, stride, count_include_pad, key_norm, global_scope, form, backend, variant,
      compute_dtype, tiling):
    check_call(q, keys, v, table, shared, stride, count_include_pad, key_norm, global_scope, form, backend, variant,
               compute_dtype, tiling)
    k, u = table.shape[0], table.shape[1]
    b, hk, height, width = q.shape
    channels = hk // k * (v.shape[1] // u)  # |h| |v|
    y = v.new_empty(b, channels, (height + stride - 1) // stride, (width + stride - 1) // stride)
    if keys is None:
        return y, q.new_empty(0), q.new_empty(0)
    content = v.new_empty(b, k, v.shape[1] // u)
    return y, content, q.new_empty(0) if key_norm == 'none' else keys.new_empty(b, u, k, height * width)


@torch.library.custom_op('timm_lambda::lambda_layer_backward', mutates_args=())
def _op_backward(gy: Tensor, q: Tensor, keys: Optional[Tensor], v: Tensor, table: Tensor, shared: Optional[Tensor],
                 content: Tensor, kn: Tensor, stride: int, count_include_pad: bool, key_norm: str, global_scope: bool,
                 form: str, backend: str, variant: str, compute_dtype: torch.dtype,
                 tiling: List[int]) -> List[Tensor]:
    """The gradients of q, keys, v, table and shared (an empty tensor for an input that is None), contiguous;
    ``content``, ``kn``: what the forward returned besides its output (not recomputed; empty: recomputed)."""
    args = (stride, count_include_pad, key_norm, global_scope, form, backend, variant, compute_dtype, tiling)
    check_call(q, keys, v, table, shared, *args, gy=gy, content=content, kn=kn)
    kept = (content if content.numel() else None, kn if kn.numel() else None)
    grads, _ = _run(_plan_of(*args), 'backward', (q, keys, v, table, shared), (gy,) + kept)
    return [q.new_empty(0) if g is None else g.contiguous() for g in grads]


@_op_backward.register_fake
def _(gy, q, keys, v, table, shared, content, kn, *args):
    check_call(q, keys, v, table, shared, *args, gy=gy, content=content, kn=kn)
    return [gy.new_empty(0) if x is None else x.new_empty(x.shape) for x in (q, keys, v, table, shared)]


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:5], output[1], output[2])
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)  # (no zero-filled gradients made for them: two launches)
    ctx.args = tuple(inputs[5:])  # the plan: ints, strings, flags, a dtype


def _backward(ctx, gy: Tensor, *_):
    q, keys, v, table, shared, content, kn = ctx.saved_tensors
    inputs = (q, keys, v, table, shared)
    if torch.is_grad_enabled():  # create_graph=True
        grads = _higher_order(_plan_of(*ctx.args), gy, inputs)
    else:
        grads = _op_backward(gy, *inputs, content, kn, *ctx.args)
        grads = [None if x is None else g for g, x in zip(grads, inputs)]
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:5])) + (None,) * 9


_op.register_autograd(_backward, setup_context=_setup)


def _higher_order(plan: Plan, gy: Tensor, inputs: Sequence) -> list:
    """A differentiable vector-Jacobian product of the plain-op form (``create_graph=True``)."""
    warn_once('create_graph', 'higher-order gradients (create_graph=True) differentiate the plain-op form of the '
                              'lambda layer: correct, but slower and with more memory than the custom operator')
    return backends.get('plain').backward(plan, gy, *inputs, None, None, create_graph=True)


def _in_autocast_dtype(*args):
    # torch.library.register_autocast (torch >= 2.7) fixes the dtype at registration; autocast's dtype is chosen at
    # run time (bfloat16 or float16, on either device), so this rule reads it as a matmul does; a plan made for the
    # inputs' dtype gets the backend's decisions for autocast's; the inputs' dtype and the output's: _input_dtype
    # (lambda_op's rule in eager mode).
    device = args[0].device.type
    dtype, call_dtype = args[0].dtype, torch.get_autocast_dtype(device)
    if dtype == torch.float64:  # (float64 stays)
        call_dtype = dtype
    compute = args[12] if call_dtype == dtype else call_dtype  # (inputs in autocast's dtype: the plan's already)
    q, table, v, backend = args[0], args[3], args[2], args[10]
    if call_dtype != dtype and backend in backends.REGISTRY and backends.REGISTRY[backend].operator:
        b, hk, height, width = q.shape
        k, u = table.shape[0], table.shape[1]
        kh, kw = min(table.shape[2], 2 * height - 1), min(table.shape[3], 2 * width - 1)
        call = backends.Call(args[9], q.device.type, call_dtype, args[5], 0,
                             2 * height - 1 <= kh and 2 * width - 1 <= kw, height, width, kh, kw, k, u,
                             v.shape[1] // u, hk // k)
        d = backends.REGISTRY[backend].decide(call)
        compute = d.compute_dtype or call_dtype
        args = list(args)
        args[11:14] = [d.variant, compute, list(d.tiling)]
    args = _autocast_inputs(args, _input_dtype(dtype, call_dtype, compute))
    with torch.autocast(device, enabled=False):
        y, content, kn = _op(*args)
        return y.to(call_dtype), content, kn


for _key in ('AutocastCPU', 'AutocastCUDA'):
    _LIB.impl(_op._name, _in_autocast_dtype, _key)


def _input_dtype(dtype: torch.dtype, call: torch.dtype, compute: torch.dtype) -> torch.dtype:
    """The dtype an autocast call's inputs go in, ``q``'s ``dtype`` given: autocast's (``call``), but where the
    backend computes the call in float32 (``compute``) and ``q`` is float32 already, float32 (a bfloat16 call whose
    projection computed in float32: layers/projection.py; no rounding to 16 bits and back). The output is rounded to
    ``call``."""
    return compute if dtype == compute else call


def _autocast_inputs(args, dtype: torch.dtype) -> list:
    """The operator's autocast rule: every floating input but float64 in autocast's ``dtype``."""
    return [a.to(dtype) if isinstance(a, Tensor) and a.is_floating_point() and a.dtype != torch.float64 else a
            for a in args]


# ----------------------------------------------------------------------------------------------------------------------
# The eager path
class _Eager(torch.autograd.Function):
    """The operator's eager path: the same forward and backward; the plan that ran the forward runs the backward."""

    @staticmethod
    def forward(ctx, plan, q, keys, v, table, shared):
        (y, content, kn), ctx.plan = _run(plan, 'forward', (q, keys, v, table, shared))
        ctx.save_for_backward(q, keys, v, table, shared, content, kn)
        return y

    @staticmethod
    def backward(ctx, gy):
        q, keys, v, table, shared, content, kn = ctx.saved_tensors
        inputs = (q, keys, v, table, shared)
        if torch.is_grad_enabled():
            grads = _higher_order(ctx.plan, gy, inputs)
        else:
            grads, _ = _run(ctx.plan, 'backward', inputs, (gy, content, kn))
        return (None,) + tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad[1:6]))


@torch.jit.unused
def lambda_op(plan: Plan, q: Tensor, keys: Optional[Tensor], v: Tensor, table: Tensor,
              shared: Optional[Tensor]) -> Tensor:
    """``timm_lambda::lambda_layer`` by ``plan`` on the layer's maps ``q [B, h k, H, W]``, ``keys [B, u k, H, W]``,
    ``v [B, u V, H, W]``, ``table [k, u, R_h, R_w]``, ``shared [B, k, V]`` -> ``[B, h V, Ho, Wo]``: in eager mode
    without the operator's dispatch, else the registered operator."""
    if plan.mode != 'eager':
        if plan.mode == 'compile':  # copies, not views (inductor cannot order a saved view's symbolic strides)
            q, keys, v = (None if x is None else x.clone(memory_format=torch.contiguous_format) for x in (q, keys, v))
        return _op(q, keys, v, table, shared, *_plan_args(plan))[0]
    if plan.autocast:
        device = q.device.type
        target = _input_dtype(q.dtype, plan.dtype, plan.compute_dtype)
        q, keys, v, table, shared = _autocast_inputs((q, keys, v, table, shared), target)
        with torch.autocast(device, enabled=False):
            return _eager_call(plan, q, keys, v, table, shared).to(plan.dtype)
    return _eager_call(plan, q, keys, v, table, shared)


def _eager_call(plan: Plan, q, keys, v, table, shared) -> Tensor:
    check_call(q, keys, v, table, shared, *_plan_args(plan))
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, keys, v, table, shared)):
        return _Eager.apply(plan, q, keys, v, table, shared)
    return _run(plan, 'forward', (q, keys, v, table, shared))[0][0]  # nothing to differentiate: no autograd node


# ----------------------------------------------------------------------------------------------------------------------
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


def flops(q, keys, v, table, shared, stride, cip, key_norm, global_scope, form, *plan, out_shape=None,
          backward=False) -> int:
    """The FLOPs of an operator call (the forward, or with ``backward`` the backward) from its arguments' shapes
    (tensors' shapes in place of tensors; None where None): see above; torch's FlopCounterMode counts them."""
    (b, hk, height, width), (_, uv, _, _), (k, u) = q, v, table[:2]
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


register_flop_formula(torch.ops.timm_lambda.lambda_layer)(flops)
register_flop_formula(torch.ops.timm_lambda.lambda_layer_backward)(
    lambda gy, q, keys, v, table, shared, content, kn, *args, out_shape=None: flops(q, keys, v, table, shared, *args,
                                                                                  backward=True))
