"""One plan a call: everything about how a lambda layer's call runs, decided once, here.

:func:`make_plan` reads the call's execution mode (once: :func:`~..execution.mode`), its sizes, the dtype it
computes in (autocast's where it applies), its device and the registry's switches (:mod:`.backends`), and answers a
:class:`Plan`: the form, the backend, the stride-2 variant, the dtype the backend computes in, the backend's tiling
and chunking, and the call's own parameters. The forward and the backward run what it says: in eager mode the
operator keeps it for the backward; under torch.compile it is made while the graph is traced (the machine's part by
a function dynamo calls once and guards by :func:`.backends.version`, the sizes' part as traced arithmetic, guarded
like any size branch) and travels in the operator's arguments to both directions. In eager mode plans are cached per
combination (256 plans of a few ints).
"""
import functools
import os
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ..execution import mode as execution_mode
from ..execution import warn_once
from . import backends

__all__ = ['Spec', 'Plan', 'make_plan', 'choose_form', 'call_dtype', 'SMALL_CALL']

SMALL_CALL = 4096  # queries (images x output positions) up to which a call counts as small (backends' rules read it)
RECORDERS = ('trace', 'export', 'func', 'script')  # modes whose graphs hold plain tensor ops only


class Spec(NamedTuple):
    """A layer's position lambdas, fixed when it is built: the form asked for (``'auto'`` or one of
    :data:`.backends.FORMS`), |k|, |u|, |v|, |h|, the relative table's ``R_h x R_w``, the scope (global or local),
    the stride (2: 3x3 average pooling after, appendix F.2), the pooling's ``count_include_pad`` and the key
    normalisation (Table 11)."""
    form: str
    k: int
    u: int
    dv: int
    heads: int
    table_h: int
    table_w: int
    global_scope: bool
    stride: int = 1
    count_include_pad: bool = False
    key_norm: str = 'softmax'


class Plan(NamedTuple):
    """How one call runs. ``form``: the form computed; ``backend``: the registered backend that runs it (``'plain'``:
    plain tensor ops in the caller's graph, no operator); ``mode``: the execution mode (``'eager'``, ``'dispatch'``
    (a dispatch mode such as FlopCounterMode, or fake tensors: the registered operator runs), ``'compile'``,
    ``'trace'``, ``'export'``, ``'func'``, ``'fx'``); ``variant``: at stride 2 ``'patched'`` (the kernels run on
    the queries' 3x3 patches at the output resolution) or ``'pooled'`` (on the full map, pooled after), ``''`` at
    stride 1; ``dtype``: the call's (autocast's where ``autocast``: the inputs are cast to it); ``compute_dtype``: what
    the backend computes in; ``tiling``: the backend's tiles and chunks (its own ints); then the call's parameters."""
    form: str
    backend: str
    mode: str
    variant: str
    dtype: torch.dtype
    compute_dtype: torch.dtype
    tiling: Tuple[int, ...]
    autocast: bool
    stride: int
    count_include_pad: bool
    key_norm: str
    global_scope: bool


# ONEDNN_MAX_CPU_ISA values that leave oneDNN its bfloat16 instructions (AVX512_CORE_BF16 and every set above it:
# AVX512_CORE_FP16, AVX10_1_512 ..., AVX512_CORE_AMX, AVX10_1_512_AMX ...)
_BF16_CAPS = ('AVX512_CORE_BF16', 'AVX512_CORE_FP16', 'AVX10_', 'AMX')


@torch.compiler.assume_constant_result  # (under torch.compile: a constant read while tracing)
def native_bf16() -> bool:
    """Whether oneDNN computes bfloat16 products natively here: the CPU has AVX-512 BF16 or AMX tiles (``torch.cpu``'s
    cpuinfo checks) and ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``) does not cap oneDNN below AVX-512 BF16. Read
    once a process. Where not, a bfloat16 CPU call's projection and content-lambda products compute in float32
    (layers/projection.py, fused._products): oneDNN's bfloat16 convolution and matmul are its reference code there."""
    return _native_bf16()


@functools.lru_cache(maxsize=None)
def _native_bf16() -> bool:
    cap = (os.environ.get('ONEDNN_MAX_CPU_ISA') or os.environ.get('DNNL_MAX_CPU_ISA') or 'ALL').upper()
    checks = [getattr(torch.cpu, name, None) for name in ('_is_avx512_bf16_supported', '_is_amx_tile_supported')]
    has = any(check is not None and check() for check in checks)  # (private in torch.cpu; absent: no matmul)
    return has and (cap == 'ALL' or any(name in cap for name in _BF16_CAPS))



def call_dtype(x: Tensor) -> Tuple[torch.dtype, bool]:
    """``(the dtype a call on x computes in, whether autocast is on)``: autocast's where it is on for ``x``'s device
    (float64 stays), else ``x``'s."""
    device = x.device.type
    if device in ('cpu', 'cuda') and torch.is_autocast_enabled(device):
        return (x.dtype if x.dtype == torch.float64 else torch.get_autocast_dtype(device)), True
    return x.dtype, False


def choose_form(spec: Spec, height: int, width: int, recording: bool = False) -> str:
    """The form ``spec.form`` resolves to on an ``height x width`` map (a form by name is itself). ``recording``: a
    graph recorder records the call (its graph must hold at every size).

    ``'auto'``: a global scope dense. Recorded, or a kernel backend chosen by name: tiled. Else dense computes
    ``|n|^2`` (query, context) pairs, tiled ``n_pad x K_h K_w`` (queries padded to whole 8x8 blocks, each against its
    scope: the CPU kernel) at about a quarter of the cost per pair plus a per-query overhead worth 32 pairs: dense
    while ``4 |n|^2 <= n_pad (K_h K_w + 32)`` (measured: docs/lambda_layer.md, "The form='auto' rule")."""
    if spec.form != 'auto':
        return spec.form
    if spec.global_scope:
        return 'dense'
    if recording or (not torch.jit.is_scripting() and _kernel_chosen()):
        return 'tiled'
    t = 8  # plain_ops.tile(), the query blocks of the committed sweeps
    padded = ((height + t - 1) // t) * ((width + t - 1) // t) * t * t
    return 'dense' if 4 * (height * width) ** 2 <= padded * (spec.table_h * spec.table_w + 32) else 'tiled'


@torch.jit.ignore
def _kernel_chosen() -> bool:
    """A backend chosen by name that computes the tiled form but not the dense one (a kernel backend)."""
    chosen = backends.get_backend()
    if chosen in ('auto', 'plain') or chosen not in backends.names():
        return False
    forms = backends.get(chosen).forms
    return 'tiled' in forms and 'dense' not in forms


def make_plan(spec: Spec, x: Tensor, mode: Optional[str] = None) -> Plan:
    """The plan of a call on ``x [B, C, H, W]`` (the layer's input, or any map of the call: its batch, size, device
    and dtype are the call's); ``mode``: :func:`~..execution.mode` of the call where the caller has read it."""
    mode = mode or execution_mode(x)
    height, width = x.shape[-2], x.shape[-1]
    dtype, autocast = call_dtype(x)
    device = x.device.type
    queries = 0
    if device == 'cuda':  # (a CUDA rule reads the call's queries: triton_fma's, for small calls)
        queries = x.shape[0] * ((height + spec.stride - 1) // spec.stride) * ((width + spec.stride - 1) // spec.stride)
    if mode == 'compile':  # traced: a size enters the plan as a guarded branch, never as a specialised constant
        if queries:
            queries = 0 if queries <= SMALL_CALL else SMALL_CALL + 1
        return _plan(spec, height, width, device, dtype, autocast, queries, mode, backends.VERSION[0])
    if type(height) is not int or type(width) is not int:  # (torch.export's symbolic sizes: not a cache key)
        return _plan(spec, height, width, device, dtype, autocast, 0, mode, backends.VERSION[0])
    return _cached_plan(spec, height, width, device, dtype, autocast, queries, mode, backends.VERSION[0])


def _window(spec: Spec, height: int, width: int) -> Tuple[int, int]:
    """The table window an ``height x width`` map reaches: ``min(R, 2 H - 1) x min(R, 2 W - 1)`` (the offsets past it
    meet only zero padding)."""
    return min(spec.table_h, 2 * height - 1), min(spec.table_w, 2 * width - 1)


def _plan(spec: Spec, height: int, width: int, device: str, dtype: torch.dtype, autocast: bool, queries: int,
          mode: str, version: int) -> Plan:
    form = choose_form(spec, height, width, mode in ('trace', 'export'))
    if form not in backends.FORMS:
        raise ValueError(f"form must be 'auto' or one of {backends.FORMS}, got {spec.form!r}")
    rest = (spec.stride, spec.count_include_pad, spec.key_norm, spec.global_scope)
    if mode in RECORDERS:  # (before any arithmetic on the sizes: a recorder's are traced values)
        if mode == 'func' and form in ('dense', 'tiled') and backends.get_backend() != 'plain':
            warn_once('functorch', 'inside torch.func transforms the position lambdas run as plain tensor ops (the '
                                   'custom operators have no batching rules): correct, but slower and with more memory')
        return Plan(form, 'plain', mode, '', dtype, dtype, (), autocast, *rest)
    kh, kw = _window(spec, height, width)
    in_scope = True if 2 * height - 1 <= kh and 2 * width - 1 <= kw else False  # (compiled: a guarded branch)
    name = _choose(form, device, dtype, spec.stride, queries, in_scope, version)
    backend = backends.get(name)
    if not backend.operator:
        return Plan(form, name, mode, '', dtype, dtype, (), autocast, *rest)
    call = backends.Call(form, device, dtype, spec.stride, queries, in_scope, height, width, kh, kw, spec.k, spec.u,
                         spec.dv, spec.heads)
    d = backend.decide(call)
    return Plan(form, name, mode, d.variant, dtype, d.compute_dtype or dtype, tuple(d.tiling), autocast, *rest)


_cached_plan = functools.lru_cache(maxsize=256)(_plan)


@torch.compiler.assume_constant_result
def _choose(form: str, device: str, dtype: torch.dtype, stride: int, queries: int, map_in_scope: bool,
            version: int) -> str:
    """The backend of a call (:func:`.backends.choose`), with why noted for the INFO line. Under torch.compile dynamo
    calls it once while tracing and keeps the answer (it reads the machine: a kernel's build, Triton), guarded by
    ``version`` (:func:`.backends.version`: a backend chosen, failed or registered since makes a new graph)."""
    call = backends.Call(form, device, dtype, stride, queries, map_in_scope)
    named = backends.get_backend()
    if named != 'auto' and form not in backends.get(named).forms:
        forms = backends.get(named).forms
        raise ValueError(f"timm_lambda: the position-lambda backend {named!r} computes the {' and '.join(forms)} "
                         f"form{'s' if len(forms) > 1 else ''}, not {form!r}: choose the layer's form accordingly, or "
                         "set_backend('auto')")
    chosen = backends.choose(call)
    how = backends.get(chosen).computes_as(call)
    backends.note(call, chosen, backends.explain(call, chosen) + (f'; {how}' if how else ''))
    return chosen
