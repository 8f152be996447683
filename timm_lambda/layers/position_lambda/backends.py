"""The position lambdas' backend table: which form computes a call and which backend runs it, in one place.

Forms (what is computed; docs/lambda_layer.md): ``einsum`` (the lambda form, Fig. 3: eq. 1, then eq. 2), ``conv``
(the lambda convolution, section 3.4), ``dense`` (logits of every query-context pair, then one GEMM with the
values), ``tiled`` (each query against exactly its ``K_h x K_w`` scope). ``'auto'`` picks one (:func:`choose_form`).

Backends (how a form runs; docs/execution_modes.md), in the order ``'auto'`` tries them (:data:`BACKENDS`):

============  ============  ======  ========================================================================
backend       forms         device  dtypes
============  ============  ======  ========================================================================
cpu_kernel    tiled         CPU     float32, float64; bfloat16 natively with AVX-512 BF16, else 16-bit in float32
triton_tc     tiled         CUDA    float16, bfloat16 (float32 sums); float32 on TF32 where torch's matmuls may
                                    use it (``torch.backends.cuda.matmul.allow_tf32``), else exact
triton_fma    tiled         CUDA    float16, bfloat16, float32, float64 on the CUDA cores (``'auto'``: float64)
gemm          dense, tiled  any     any: the custom operators' batched GEMMs
plain         every form    any     any: plain tensor ops, the only backend graph recorders and transforms record
============  ============  ======  ========================================================================

Each backend says why it cannot serve a call (:func:`why_not`); ``'auto'`` also skips a backend that can serve a call
but measured slower there (its reason starts with ``'auto: '``). Forward and backward read the same table.
The operator backends run in eager mode and under torch.compile; torch.export, jit.trace, the ONNX exporters,
TorchScript and torch.func transforms record ``plain`` whatever the choice (their graphs hold plain tensor ops).

Choose one as timm's ``set_fused_attn`` does: :func:`set_backend` or ``TIMM_LAMBDA_BACKEND`` (``auto`` or a backend's
name). A chosen backend that cannot serve a call raises, naming the reason. :func:`served_backends` counts the calls
each backend served (each new combination is logged once at INFO). Strict mode (``set_backend(strict=True)`` or
``TIMM_LAMBDA_STRICT=1``): a backend that fails at run time (a Triton that cannot compile here, a CPU kernel that
did not build) raises instead of handing the call to the next one with a warning.
"""
import collections
import logging
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ..._env import env_choice, env_flag
from ..execution import warn_once
from . import cpu_kernel, gemm, tiled_triton

__all__ = ['FORMS', 'BACKENDS', 'Call', 'set_backend', 'get_backend', 'is_strict', 'why_not', 'choose',
           'choose_form', 'check_form', 'explain', 'note', 'record', 'served_backends', 'tiled_kernels', 'fail',
           'version']

_logger = logging.getLogger(__name__)

FORMS = ('auto', 'einsum', 'conv', 'dense', 'tiled')
BACKENDS = ('cpu_kernel', 'triton_tc', 'triton_fma', 'gemm', 'plain')  # the order 'auto' tries them in
_FORMS_OF = dict(cpu_kernel=('tiled',), triton_tc=('tiled',), triton_fma=('tiled',), gemm=('dense', 'tiled'),
                 plain=('einsum', 'conv', 'dense', 'tiled'))
SMALL_CALL = 4096  # queries (images x output positions) up to which 'auto' runs triton_fma (measured on an H200)

_backend = env_choice('TIMM_LAMBDA_BACKEND', ('auto',) + BACKENDS, 'auto', flags=False)
_strict = env_flag('TIMM_LAMBDA_STRICT', False)
_failed: Dict[str, str] = {}  # backend -> why it failed at run time in this process (not in strict mode)
_SERVED: 'collections.Counter[Tuple[str, str, str, str]]' = collections.Counter()
_VERSION = [0]  # bumped by every change of the above (:func:`version`)
_WHY: Dict[Tuple[str, str, str, str], str] = {}  # why a backend serves a combination (:func:`note`)


def set_backend(backend: str = 'auto', strict: Optional[bool] = None) -> None:
    """Run the position lambdas by ``backend`` (one of :data:`BACKENDS`) or let ``'auto'`` pick per call; ``strict``
    (None: unchanged): a backend that fails raises instead of handing the call on. Overrides
    ``TIMM_LAMBDA_BACKEND`` and ``TIMM_LAMBDA_STRICT``."""
    global _backend, _strict
    name = backend.lower() if isinstance(backend, str) else backend  # the spellings TIMM_LAMBDA_BACKEND accepts
    if name not in ('auto',) + BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {', '.join(map(repr, BACKENDS))} (any case), "
                         f"got {backend!r}")
    _backend = name
    if strict is not None:
        _strict = bool(strict)
    _VERSION[0] += 1


def get_backend() -> str:
    """The backend chosen by :func:`set_backend` or ``TIMM_LAMBDA_BACKEND``: ``'auto'`` or a backend's name."""
    return _backend


def is_strict() -> bool:
    """Whether a backend that fails raises (:func:`set_backend`'s ``strict``, ``TIMM_LAMBDA_STRICT``)."""
    return _strict


class Call(NamedTuple):
    """What the table needs to know of a call: the form, the device type, the dtype the operator computes in (the
    autocast dtype under autocast), the step (2: a stride-2 layer's pooled queries), the queries (images x output
    positions) and whether the map is no larger than the scope."""
    form: str
    device: str
    dtype: torch.dtype
    step: int = 1
    queries: int = 0
    map_in_scope: bool = False


_16_BIT = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace('torch.', '')


def _forms_of(backend: str) -> str:
    forms = _FORMS_OF[backend]
    return ' and '.join(forms) + (' forms' if len(forms) > 1 else ' form')


def _unusable(backend: str, call: Call) -> Optional[str]:
    """Why ``backend``, which computes ``call``'s form, dtype and device, cannot run on this machine (its kernel not
    built, Triton unable to compile here, a failure earlier in this process); None: it can."""
    if backend in _failed:
        return _failed[backend]
    if backend == 'cpu_kernel':
        return cpu_kernel.unavailable()  # (looked up once per process by cpu_kernel)
    if backend in ('triton_tc', 'triton_fma'):
        return tiled_triton.unavailable()
    return None


def _cannot(backend: str, call: Call) -> Optional[str]:
    """Why ``backend`` cannot compute ``call`` at all (None: it can)."""
    if call.form not in _FORMS_OF[backend]:
        return f'computes the {_forms_of(backend)}'
    if backend == 'cpu_kernel':
        if call.device != 'cpu':
            return 'needs CPU tensors'
        if call.dtype not in _FLOATS:
            return 'computes float16, bfloat16, float32 and float64'
    elif backend in ('triton_tc', 'triton_fma'):
        if call.device != 'cuda' and not tiled_triton.INTERPRETED:
            return "needs CUDA tensors (or Triton's interpreter, TRITON_INTERPRET=1)"
        dtypes = (torch.float16, torch.bfloat16, torch.float32) if backend == 'triton_tc' else _FLOATS
        if call.dtype not in dtypes:
            return f"computes {', '.join(map(_dtype_name, dtypes))}"
    return _unusable(backend, call)


def _declines(backend: str, call: Call) -> Optional[str]:
    """Why ``'auto'`` passes over ``backend`` for ``call`` although it could compute it (measured slower there)."""
    if backend == 'cpu_kernel':
        return cpu_kernel.declines(call.dtype, call.step)
    if backend == 'triton_fma' and not (call.queries <= SMALL_CALL or call.map_in_scope):
        return (f'auto: a call of more than {SMALL_CALL} queries on a map larger than the scope runs faster as the '
                'gemm backend\'s GEMMs (docs/benchmarks.md, "GPU")')
    return None


def why_not(backend: str, call: Call, auto: bool = True) -> Optional[str]:
    """Why ``backend`` does not serve ``call`` (None: it does). ``auto``: also the reasons for which ``'auto'``
    passes over a backend that could compute the call."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    return _cannot(backend, call) or (_declines(backend, call) if auto else None)


def _describe(call: Call) -> str:
    return f'the {call.form} form on {call.device} in {_dtype_name(call.dtype)}' + (
        ' at step 2' if call.step == 2 else '')


def _cause(reason: str) -> str:
    """A reason without what a fallback to the GEMMs would do (the CPU kernel's say it): for messages that raise."""
    return reason.split('; the position lambdas run as batched GEMMs instead', 1)[0]


def choose(call: Call) -> str:
    """The backend that runs ``call`` (an eager or compiled call of the lambda operator, :mod:`.plan`): the chosen
    one, which raises if it cannot, or under ``'auto'`` the first of :data:`BACKENDS` that serves it. Under ``'auto'``
    a kernel backend that computes the call but cannot run on this machine (a CPU kernel not built, a Triton that
    cannot compile) is passed over with one warning, or in strict mode raises, naming the remedy."""
    if _backend != 'auto':
        reason = why_not(_backend, call, auto=False)
        if reason is not None:
            raise RuntimeError(f"timm_lambda: the position-lambda backend {_backend!r} cannot run {_describe(call)} "
                               f"({_cause(reason)}); raising, as it was chosen by name: set_backend('auto') or "
                               "TIMM_LAMBDA_BACKEND=auto picks one that can")
        return _backend
    for backend in BACKENDS:
        reason = why_not(backend, call)
        if reason is None:
            return backend
        missing = _unusable(backend, call)
        if missing is not None and missing == reason:
            if _strict:
                raise RuntimeError(f'timm_lambda: strict mode: the {backend} backend of the position lambdas cannot '
                                   f'run {_describe(call)} on this machine ({_cause(missing)}); raising instead of '
                                   'handing the call to the next backend: fix the cause, or set_backend(strict=False) '
                                   '/ TIMM_LAMBDA_STRICT=0 to let the next backend run it')
            warn_once(backend, missing if backend == 'cpu_kernel' else  # (its reason says what runs instead)
                      f'the {backend} backend of the position lambdas cannot run here ({missing}): the next backend '
                      'of the table runs them instead (correct, slower)')
    raise AssertionError('gemm serves every operator call')


def choose_form(form: str, height: int, width: int, table_h: int, table_w: int, global_scope: bool,
                recording: bool = False) -> str:
    """The form ``form`` resolves to for an ``height x width`` input and a ``table_h x table_w`` table (``'auto'``;
    a form by name is itself). ``recording``: a graph recorder records the call (its graph must hold at every size).

    A global scope: dense. Recorded, or a kernel backend chosen (``cpu_kernel``, ``triton_*``): tiled. Else dense
    computes ``|n|^2`` (query, context) pairs, tiled ``n_pad x K_h K_w`` (queries padded to whole 8x8 blocks, each
    against its scope: the CPU kernel) at about a quarter of the cost per pair plus a per-query overhead worth 32
    pairs: dense while ``4 |n|^2 <= n_pad (K_h K_w + 32)`` (measured: docs/lambda_layer.md, "The impl='auto'
    rule")."""
    if form != 'auto':
        return form
    if global_scope:
        return 'dense'
    if recording or (not torch.jit.is_scripting() and _kernel_chosen()):
        return 'tiled'
    t = 8  # plain_ops.tile(), the query blocks of the committed sweeps
    padded = ((height + t - 1) // t) * ((width + t - 1) // t) * t * t
    return 'dense' if 4 * (height * width) ** 2 <= padded * (table_h * table_w + 32) else 'tiled'


@torch.jit.ignore
def _kernel_chosen() -> bool:
    return _backend in ('cpu_kernel', 'triton_tc', 'triton_fma')


def check_form(form: str) -> None:
    """A backend chosen by name that does not compute ``form`` (the form a layer's ``impl`` resolved to) raises."""
    if _backend not in ('auto', 'plain') and form not in _FORMS_OF[_backend]:
        raise ValueError(f"timm_lambda: the position-lambda backend {_backend!r} computes the "
                         f"{_forms_of(_backend)}, not {form!r}: choose the layer's impl accordingly, or "
                         "set_backend('auto')")


def explain(call: Call, chosen: str) -> str:
    """Why ``chosen`` runs ``call``: chosen by name, or under ``'auto'`` the first of :data:`BACKENDS` that serves it,
    with the reasons of those before it (:func:`why_not`)."""
    if _backend != 'auto':
        return 'chosen by set_backend or TIMM_LAMBDA_BACKEND'
    passed = [f'{b}: {why_not(b, call)}' for b in BACKENDS[:BACKENDS.index(chosen)] if why_not(b, call)]
    return 'auto: the first backend of the table that serves the call' + (
        f" ({'; '.join(passed)})" if passed else '')


def note(form: str, backend: str, device: str, dtype: torch.dtype, reason: str) -> None:
    """Keep why ``backend`` serves ``form`` calls on ``device`` in ``dtype`` (:func:`explain`), for the INFO line and
    :func:`served_backends`."""
    _WHY[(form, backend, device, _dtype_name(dtype))] = reason


def record(form: str, backend: str, x: Tensor) -> None:
    """Count a call of ``form`` that ``backend`` served on ``x``'s device and dtype; the first of each combination is
    logged at INFO, with why that backend (:func:`note`)."""
    key = (form, backend, x.device.type, _dtype_name(x.dtype))
    if key not in _SERVED:
        why = _WHY.get(key, 'plain tensor ops: a graph recorder, a transform, TorchScript, the plain backend or a '
                            'reference form' if backend == 'plain' else 'chosen for the call')
        _logger.info('timm_lambda: the %s form of the position lambdas runs by the %s backend (device %s, %s): %s',
                     *key, why)
    _SERVED[key] += 1


def served_backends(reset: bool = False, why: bool = False) -> Dict[Tuple[str, str, str, str], object]:
    """The calls each backend served in this process, by ``(form, backend, device, dtype)``, optionally reset after
    reading; ``why``: instead of the counts, why that backend served them (the INFO line's reason). A graph recorder
    counts the calls it recorded (once per trace); torch.compile counts the operators' runs, not its traces."""
    out = {k: _WHY.get(k, 'plain tensor ops' if k[1] == 'plain' else 'chosen for the call') for k in _SERVED} \
        if why else dict(_SERVED)
    if reset:
        _SERVED.clear()
    return out


# The tiled form's kernels, by backend: forward (q, v, table, step, content) -> y; backward (gy, q, v, table, step,
# content) -> (dq, dv, dtable, dcontent). q [B, h, c, Ho, Wo] (a stride-2 layer's 3x3 query patches, c = 9 |k|),
# v [B, u V, H, W], table [c, u, K_h, K_w], an optional content lambda [B, c, V] applied to the same queries.
def _triton(backward: bool, tensor_cores: bool) -> Callable:
    def run(*args):
        fn = tiled_triton.backward if backward else tiled_triton.forward
        return fn(*args, tensor_cores=tensor_cores, chunk_elements=tiled_triton.CHUNK_ELEMENTS)
    return run


_TILED: Dict[str, Tuple[Callable, Callable]] = {
    'cpu_kernel': (cpu_kernel.forward, cpu_kernel.backward),
    'triton_tc': (_triton(False, True), _triton(True, True)),
    'triton_fma': (_triton(False, False), _triton(True, False)),
    'gemm': (gemm.forward, gemm.backward),
}


def tiled_kernels(backend: str) -> Tuple[Callable, Callable]:
    """The tiled form's ``(forward, backward)`` kernels of ``backend`` (see the comment above)."""
    return _TILED[backend]


def fail(backend: str, error: Exception) -> None:
    """``backend`` raised :class:`BackendUnusable` (it cannot run on this machine): in strict mode, or where it was
    chosen by name, the error propagates; under ``'auto'`` it is recorded as failed (one warning) and the next plan
    skips it."""
    if _strict or _backend != 'auto':
        raise error
    _failed[backend] = f'failed in this process ({error})'
    _VERSION[0] += 1
    warn_once(backend, f'the {backend} backend of the position lambdas failed ({error}): the next backend of the '
                       "table runs them instead (correct, slower); set_backend(strict=True) raises instead")


def version() -> int:
    """A number that changes whenever the table's answers may change (a backend chosen, strict mode set, a backend
    failed): part of the key of every cached plan (:mod:`.plan`)."""
    return _VERSION[0]
