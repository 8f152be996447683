"""The backends of the position lambdas as self-describing objects in one registry (as xformers' attention operators
declare theirs), and the switches that choose among them.

Forms (what is computed; docs/lambda_layer.md): ``einsum`` (the lambda form, Fig. 3: eq. 1, then eq. 2), ``conv``
(the lambda convolution, section 3.4), ``dense`` (logits of every query-context pair, then one GEMM with the
values), ``tiled`` (each query against exactly its ``K_h x K_w`` scope).

A backend (:class:`Backend`) declares the forms, devices and dtypes it computes, why it cannot serve a call
(:meth:`Backend.not_supported_reasons`), why ``'auto'`` passes over it although it could (:meth:`Backend.declines`,
measured slower there), its decisions for a call (:meth:`Backend.decide`: the stride-2 variant, the dtype it
computes in, its tiling and chunking) and the operator's forward and backward. The registry's order is the order
``'auto'`` tries them in (:func:`names`); :func:`register` adds one (a test adds its own from the test file alone).
The built-in backends (``cpu_kernel``, ``triton_tc``, ``triton_fma``, ``gemm``, ``plain``) are registered by the
package (:mod:`timm_lambda.layers.position_lambda`); each lives in the module of its kernels.

Choose one as timm's ``set_fused_attn`` does: :func:`set_backend` or ``TIMM_LAMBDA_BACKEND`` (``auto`` or a backend's
name). A chosen backend that cannot serve a call raises, naming the reason. :func:`served_backends` counts the calls
each backend computed, forward and backward (each new combination is logged once at INFO). Strict mode
(``set_backend(strict=True)`` or ``TIMM_LAMBDA_STRICT=1``): a backend that fails at run time (a Triton that cannot
compile here, a CPU kernel that went away) raises instead of handing the call to the next one with a warning
(:func:`fail`, the one place that handles it).
"""
import collections
import logging
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..._env import env_choice, env_flag
from ..execution import warn_once

__all__ = ['FORMS', 'REGISTRY', 'SERVED', 'VERSION', 'Backend', 'Call', 'Decision', 'register', 'unregister',
           'names', 'get', 'set_backend', 'get_backend', 'is_strict', 'why_not', 'choose', 'describe', 'explain',
           'note', 'unusable', 'fail', 'record', 'served_backends', 'invalidate', 'version', 'dtype_name']

_logger = logging.getLogger(__name__)

FORMS = ('einsum', 'conv', 'dense', 'tiled')


class Call(NamedTuple):
    """What a backend needs to know of a call. Choosing a backend (:func:`choose`) reads the first six: the form, the
    device type, the dtype the call computes in (autocast's under autocast), the stride (2: a 3x3 average pool after,
    appendix F.2), the queries (images x output positions, on CUDA; 0 where no rule reads them) and whether the map
    is no larger than the scope (every query sees the whole map). :meth:`Backend.decide` also reads the sizes: the
    map's ``height x width``, the table window it reaches ``kh x kw`` (at most ``2 H - 1 x 2 W - 1``), |k|, |u|, |v|
    and |h| (0 where unknown)."""
    form: str
    device: str
    dtype: torch.dtype
    stride: int = 1
    queries: int = 0
    map_in_scope: bool = False
    height: int = 0
    width: int = 0
    kh: int = 0
    kw: int = 0
    k: int = 0
    u: int = 0
    dv: int = 0
    heads: int = 0


class Decision(NamedTuple):
    """A backend's decisions for a call: ``variant`` (stride 2: ``'patched'``, the queries' 3x3 patches at the
    output resolution, or ``'pooled'``, the full map pooled after; ``''`` at stride 1), the dtype it computes in and
    its ``tiling`` (its own ints: tiles, chunk sizes; empty where it has none)."""
    variant: str = ''
    compute_dtype: Optional[torch.dtype] = None
    tiling: Tuple[int, ...] = ()


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace('torch.', '')


class Backend:
    """A way to run the position lambdas. Subclasses set the class attributes and override what differs.

    ``operator``: runs inside the custom operator (``timm_lambda::lambda_layer``), below autograd (its backward
    computes the gradients without it); False for plain tensor ops that the caller's graph records (the ``plain``
    backend, which the operator refuses). The operator's :meth:`forward` takes the layer's maps
    ``q [B, h k, H, W]``, ``keys [B, u k, H, W]`` or None, ``v [B, u V, H, W]``, the relative embedding ``table [k,
    u, R_h, R_w]`` and ``shared [B, k, V]`` or None (a part of every ``lambda_n`` given as it is) and returns ``(y
    [B, h V, Ho, Wo], the content lambda [B, k, V], the normalised keys [B, u, k, n])`` (the last two for the
    backward, empty tensors where there is none); :meth:`backward` the gradients of the five inputs (None for an
    input that is None)."""
    name: str = ''
    forms: Tuple[str, ...] = ()
    devices: Optional[Tuple[str, ...]] = None  # None: any device
    dtypes: Tuple[torch.dtype, ...] = _FLOATS
    operator: bool = True

    def unavailable(self) -> Optional[str]:
        """Why this backend cannot run on this machine (a kernel not built, no Triton): None where it can."""
        return None

    def supports(self, call: Call) -> List[str]:
        """Why this backend cannot compute ``call``'s form, device and dtype at all (beyond the declarations)."""
        return []

    def not_supported_reasons(self, call: Call) -> List[str]:
        """Every reason this backend cannot serve ``call`` (empty: it can): :meth:`cannot_compute`'s, else why it
        cannot run on this machine (:meth:`unavailable`, or a failure in this process)."""
        reasons = self.cannot_compute(call)
        if not reasons:
            missing = _failed.get(self.name) or self.unavailable()
            if missing:
                reasons.append(missing)
        return reasons

    def cannot_compute(self, call: Call) -> List[str]:
        """Why this backend cannot compute ``call`` at all: its form, device or dtype, or :meth:`supports`."""
        reasons = []
        if call.form not in self.forms:
            reasons.append(f"computes the {' and '.join(self.forms)} form{'s' if len(self.forms) > 1 else ''}")
        if self.devices is not None and call.device not in self.devices:
            reasons.append(f"needs {' or '.join(d.upper() for d in self.devices)} tensors")
        if call.dtype not in self.dtypes:
            names_ = [dtype_name(d) for d in self.dtypes]
            reasons.append('computes ' + (', '.join(names_[:-1]) + ' and ' if len(names_) > 1 else '') + names_[-1])
        if not reasons:
            reasons += self.supports(call)
        return reasons

    def declines(self, call: Call) -> Optional[str]:
        """Why ``'auto'`` passes over this backend for ``call`` although it could compute it (a reason starting
        ``'auto: '``, measured slower there), or None."""
        return None

    def computes_as(self, call: Call) -> str:
        """How this backend computes ``call`` (a sentence for the INFO line and ``served_backends(why=True)``; ''
        where there is nothing to say)."""
        return ''

    def decide(self, call: Call) -> Decision:
        """The backend's decisions for ``call`` (a pure function of it: the plan caches it)."""
        return Decision(compute_dtype=call.dtype)

    def forward(self, plan, q, keys, v, table, shared):
        """The forward on the operator's arguments: ``(y, content, kn)`` (abstract: every backend defines it)."""
        raise NotImplementedError

    def backward(self, plan, gy, q, keys, v, table, shared, content, kn):
        """The backward: the gradients of ``q, keys, v, table, shared`` (abstract: every backend defines it)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f'<{type(self).__name__} backend {self.name!r}>'


REGISTRY: Dict[str, Backend] = {}  # name -> backend, in the order 'auto' tries them (read it; change it by register)
_backend = 'auto'
_strict = env_flag('TIMM_LAMBDA_STRICT', False)
_failed: Dict[str, str] = {}  # backend -> why it failed at run time in this process (not in strict mode)
SERVED: 'collections.Counter[Tuple[str, str, str, str, str]]' = collections.Counter()
_WHY: Dict[Tuple[str, str, str, str], str] = {}  # why a backend serves a combination (:func:`record`)
VERSION = [0]  # bumped by every change of the above that may change a plan (:func:`version`)


def register(*backends: Backend, before: Optional[str] = None) -> None:
    """Add ``backends`` to the registry, at its end or ``before`` the backend of that name (the order ``'auto'``
    tries them in). A name already registered is replaced in place."""
    for b in backends:
        if not (isinstance(b, Backend) and isinstance(b.name, str) and b.name.isidentifier()):
            raise ValueError(f'register takes Backend instances with a name that is an identifier, got {b!r}')
        if b.name == 'auto':
            raise ValueError("'auto' is not a backend's name: it chooses one")
    if before is not None and before not in REGISTRY:
        raise ValueError(f'before must name a registered backend ({", ".join(REGISTRY)}), got {before!r}')
    items = [(n, b) for n, b in REGISTRY.items() if n not in {b.name for b in backends}]
    at = len(items) if before is None else [n for n, _ in items].index(before)
    items[at:at] = [(b.name, b) for b in backends]
    REGISTRY.clear()
    REGISTRY.update(items)
    VERSION[0] += 1


def unregister(name: str) -> None:
    """Remove the backend ``name`` (``'auto'`` is chosen where it was the chosen one)."""
    global _backend
    get(name)
    del REGISTRY[name]
    _failed.pop(name, None)
    if _backend == name:
        _backend = 'auto'
    VERSION[0] += 1


def names() -> Tuple[str, ...]:
    """The registered backends' names, in the order ``'auto'`` tries them."""
    return tuple(REGISTRY)


def get(name: str) -> Backend:
    """The backend ``name``; a ValueError naming the registered ones for any other."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"backend must be one of {', '.join(map(repr, REGISTRY))}, got {name!r}") from None


def set_backend(backend: str = 'auto', strict: Optional[bool] = None) -> None:
    """Run the position lambdas by ``backend`` (a registered name, any case) or let ``'auto'`` pick per call;
    ``strict`` (None: unchanged): a backend that fails raises instead of handing the call on. Overrides
    ``TIMM_LAMBDA_BACKEND`` and ``TIMM_LAMBDA_STRICT``."""
    global _backend, _strict
    name = backend.lower() if isinstance(backend, str) else backend
    if name != 'auto' and name not in REGISTRY:
        raise ValueError(f"backend must be 'auto' or one of {', '.join(map(repr, REGISTRY))} (any case), "
                         f"got {backend!r}")
    _backend = name
    if strict is not None:
        _strict = bool(strict)
    VERSION[0] += 1


def set_backend_from_environment() -> None:
    """``TIMM_LAMBDA_BACKEND`` (read once, when the package has registered its backends): a ValueError names the
    variable and the registered names for any other value."""
    set_backend(env_choice('TIMM_LAMBDA_BACKEND', ('auto',) + names(), 'auto', flags=False))


def get_backend() -> str:
    """The backend chosen by :func:`set_backend` or ``TIMM_LAMBDA_BACKEND``: ``'auto'`` or a backend's name."""
    return _backend


def is_strict() -> bool:
    """Whether a backend that fails raises (:func:`set_backend`'s ``strict``, ``TIMM_LAMBDA_STRICT``)."""
    return _strict


def why_not(name: str, call: Call, auto: bool = True) -> Optional[str]:
    """Why the backend ``name`` does not serve ``call`` (None: it does), its reasons joined; ``auto``: also why
    ``'auto'`` passes over it although it could compute the call."""
    backend = get(name)
    reasons = backend.not_supported_reasons(call)
    if reasons:
        return '; '.join(reasons)
    return backend.declines(call) if auto else None


def describe(call: Call) -> str:
    return f'the {call.form} form on {call.device} in {dtype_name(call.dtype)}' + (
        ' at stride 2' if call.stride == 2 else '')


def _cause(reason: str) -> str:
    """A reason without what a fallback to the GEMMs would do (the CPU kernel's say it): for messages that raise."""
    return reason.split('; the position lambdas run as batched GEMMs instead', 1)[0]


def choose(call: Call, chosen: Optional[str] = None) -> str:
    """The backend that runs ``call``: the chosen one (``chosen`` or :func:`get_backend`), which raises if it cannot,
    or under ``'auto'`` the first registered one that serves it. Under ``'auto'`` a backend that computes the call
    but cannot run on this machine (a CPU kernel not built, a Triton that cannot compile) is passed over with one
    warning, or in strict mode raises, naming the remedy."""
    chosen = chosen or _backend
    if chosen != 'auto':
        reason = why_not(chosen, call, auto=False)
        if reason is not None:
            raise RuntimeError(f'timm_lambda: the position-lambda backend {chosen!r} cannot run {describe(call)} '
                               f"({_cause(reason)}); raising, as it was chosen by name: set_backend('auto') or "
                               'TIMM_LAMBDA_BACKEND=auto picks one that can')
        return chosen
    for name, backend in REGISTRY.items():
        reasons = backend.not_supported_reasons(call)
        if not reasons:
            if backend.declines(call) is None:
                return name
            continue
        missing = _failed.get(name) or backend.unavailable()
        if missing is not None and reasons == [missing]:  # it computes the call, but cannot run here
            if _strict:
                raise RuntimeError(f'timm_lambda: strict mode: the {name} backend of the position lambdas cannot '
                                   f'run {describe(call)} on this machine ({_cause(missing)}); raising instead of '
                                   'handing the call to the next backend: fix the cause, or set_backend(strict=False) '
                                   '/ TIMM_LAMBDA_STRICT=0 to let the next backend run it')
            warn_once(name, missing if 'run as batched GEMMs instead' in missing else  # (it says what runs instead)
                      f'the {name} backend of the position lambdas cannot run here ({missing}): the next backend '
                      'of the registry runs them instead (correct, slower)')
    raise RuntimeError(f'timm_lambda: no registered backend serves {describe(call)}: '
                       + '; '.join(f'{n}: {why_not(n, call)}' for n in REGISTRY))


def explain(call: Call, chosen: str) -> str:
    """Why ``chosen`` runs ``call``: chosen by name, or under ``'auto'`` the first registered backend that serves it,
    with the reasons of those before it (:func:`why_not`)."""
    if _backend != 'auto':
        return 'chosen by set_backend or TIMM_LAMBDA_BACKEND'
    before = list(REGISTRY)[:list(REGISTRY).index(chosen)]
    passed = [f'{b}: {why_not(b, call)}' for b in before if why_not(b, call)]
    return 'auto: the first backend of the registry that serves the call' + (
        f" ({'; '.join(passed)})" if passed else '')


def note(call: Call, chosen: str, reason: str) -> None:
    """Keep why ``chosen`` serves ``call``'s combination, for the INFO line and ``served_backends(why=True)``."""
    _WHY[(call.form, chosen, call.device, dtype_name(call.dtype))] = reason


def record(form: str, backend: str, device: str, dtype: torch.dtype, direction: str) -> None:
    """Count a call of ``form`` that ``backend`` computed on ``device`` in ``dtype`` (the inputs'), ``direction``
    ``'forward'`` or ``'backward'``; the first of each combination is logged at INFO, with why that backend."""
    key = (form, backend, device, dtype_name(dtype), direction)
    if key not in SERVED:
        _logger.info('timm_lambda: the %s form of the position lambdas runs by the %s backend (device %s, %s, %s): '
                     '%s', *key, _why(key))
    SERVED[key] += 1


def _why(key: tuple) -> str:
    return _WHY.get(key[:4], 'plain tensor ops: a graph recorder, a transform, TorchScript, the plain backend or a '
                             'reference form' if key[1] == 'plain' else 'chosen for the call')


def served_backends(reset: bool = False, why: bool = False) -> Dict[Tuple[str, str, str, str, str], object]:
    """The calls each backend computed in this process, by ``(form, backend, device, dtype, direction)``
    (``direction``: ``'forward'`` or ``'backward'``), optionally reset after reading; ``why``: instead of the counts,
    why that backend served them (the INFO line's reason). The operator backends count each direction when it runs
    (under torch.compile too); plain tensor ops count their forward (autograd differentiates them, uncounted),
    graph recorders once per trace."""
    out = {k: _why(k) for k in SERVED} if why else dict(SERVED)
    if reset:
        SERVED.clear()
    return out


def unusable(name: str) -> bool:
    """Whether the backend ``name`` cannot run on this machine now (it failed in this process, or it is not
    available: a kernel gone since the plan)."""
    return name in _failed or get(name).unavailable() is not None


def fail(name: str, error: Exception) -> None:
    """The backend ``name`` raised :class:`~..execution.BackendUnusable` (it cannot run on this machine): in strict
    mode, or where it was chosen by name, the error propagates; under ``'auto'`` it is recorded as failed (one
    warning) and the next plan passes over it."""
    if _strict or _backend != 'auto':
        raise error
    _failed[name] = f'failed in this process ({error})'
    VERSION[0] += 1
    warn_once(name, f'the {name} backend of the position lambdas failed ({error}): the next backend of the '
                    "registry runs them instead (correct, slower); set_backend(strict=True) raises instead")


def invalidate() -> None:
    """Make every plan anew from the next call on: for a rule that changed outside the switches above (a test that
    patched a backend's constant, such as a chunk size)."""
    VERSION[0] += 1


def version() -> int:
    """A number that changes whenever the registry's answers may change (a backend registered or chosen, strict mode
    set, a backend failed): part of the key of every cached plan (:mod:`.plan`), and a guard of every compiled
    graph's plan."""
    return VERSION[0]


def clear_failures(names_: Sequence[str] = ()) -> None:
    """Forget the run-time failures of ``names_`` (all where empty): for tests that make a backend fail."""
    for n in list(names_ or _failed):
        _failed.pop(n, None)
    VERSION[0] += 1
