"""The execution context of the layers (eager, compiled, recorded, transformed) and the one-time warnings about it
(docs/execution_modes.md); the plan that reads it: :mod:`.position_lambda.plan`."""
import warnings

import torch

from .._compat import DYNAMO_FOLDS_FUNCTORCH_FLAG

__all__ = ['is_exporting', 'functorch_active', 'contiguous', 'compiled_copy', 'compiled_fresh_copy', 'compiling',
           'warn_once', 'mode', 'MODES', 'BackendUnusable']


@torch.jit.ignore
def is_exporting() -> bool:
    """``torch.compiler.is_exporting()`` (public since torch 2.6; False on 2.4-2.5, where an export then records
    the custom operators). Read from the flag it returns: dynamo before pytorch/pytorch#176499 (torch <= 2.11)
    folds the call itself to True inside every torch.compile trace, which took the export branches there."""
    flag = getattr(torch.compiler, '_is_exporting_flag', None)
    if flag is not None:
        return bool(flag)
    flag = getattr(torch.compiler, 'is_exporting', None)
    return bool(flag()) if flag is not None else False


@torch.jit.ignore
def functorch_active() -> bool:
    """True inside a ``torch.func`` transform (grad, vmap, jacrev, jvp, ...).

    Private API: torch has no public query for an active transform; ``torch._C._are_functorch_transforms_active``
    exists since torch 2.0. Dynamo folds it to a constant from torch 2.5; torch 2.4's dynamo stops at it, so there
    code being compiled reads False (timm_lambda/_compat.py)."""
    if not DYNAMO_FOLDS_FUNCTORCH_FLAG and torch.compiler.is_compiling():
        return False
    return bool(torch._C._are_functorch_transforms_active())


def contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x.contiguous()``, and a copy in every case inside ``torch.export``: ``contiguous()`` first asks whether
    ``x`` already is, and torch.export answers that for a permuted view with a guard on a size of 1 (``Ne(s0*s1,
    1)`` for ``H W``; torch 2.14, also under ``backed_size_oblivious``), which a copy never asks. Inside
    torch.compile a copy too (:func:`compiled_copy`). Eager mode and the other tracers: ``contiguous()`` (no copy of
    a contiguous tensor)."""
    if not torch.jit.is_scripting():
        if is_exporting():
            return x.clone(memory_format=torch.contiguous_format)
    return compiled_copy(x).contiguous()


def compiled_copy(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a contiguous copy of it while torch.compile traces (not torch.export): the compiled forward saves
    tensors for backward, and inductor orders a saved view's strides by sympy comparisons it cannot decide at
    symbolic sizes (``1 < H W`` where the sizes are conv output sizes, FloorDivs of the input's: an InductorError at
    a second input size or with ``dynamic=True``; torch 2.14.1, issue 39). A copy is never a view."""
    if not torch.jit.is_scripting():
        if torch.compiler.is_compiling() and not is_exporting():
            return x.clone(memory_format=torch.contiguous_format)
    return x


def compiled_fresh_copy(x: torch.Tensor) -> torch.Tensor:
    """``x [B, C, H, W]``, or while torch.compile traces (not torch.export) a new contiguous copy of it that
    inductor keeps. :func:`compiled_copy` of a tensor that already is contiguous, a contiguous view included, is
    removed by inductor as a no-op (a clone with its input's strides), and the view is then saved for backward
    with the strides inductor cannot order (``32*s18*s71 < 32`` at batch 1; issue 51). Here the copy goes through
    a channels-last one, whose strides differ from both; inductor fuses the two copies."""
    if not torch.jit.is_scripting():
        if torch.compiler.is_compiling() and not is_exporting():
            return x.clone(memory_format=torch.channels_last).clone(memory_format=torch.contiguous_format)
    return x


@torch.jit.ignore
def compiling() -> bool:
    """torch.compile traces the code (not torch.export)."""
    return torch.compiler.is_compiling() and not is_exporting()


MODES = ('eager', 'dispatch', 'compile', 'trace', 'export', 'func', 'fx')


@torch.jit.ignore
def mode(x: torch.Tensor) -> str:
    """The execution mode of a call on ``x``, read once a call (:func:`.position_lambda.plan.make_plan`):

    * ``'trace'``: ``torch.jit.trace`` (also the legacy ONNX exporter), ``'export'``: ``torch.export`` (also the
      dynamo ONNX exporter), ``'func'``: a ``torch.func`` transform: graph recorders and transforms, whose graphs hold
      plain tensor ops only (the operator has no batching rule);
    * ``'compile'``: torch.compile traces the code (the registered operator goes into the graph);
    * ``'fx'``: ``torch.fx`` symbolic tracing (timm's feature extraction): the operator call is a leaf that plans when
      the graph runs;
    * ``'dispatch'``: a dispatch mode is active (FlopCounterMode, fake tensors) or ``x`` is on neither CPU nor CUDA
      (the meta device): the registered operator runs;
    * ``'eager'``: the operator's eager path runs (an autograd function, without the operator's dispatch).

    (TorchScript, ``'script'``, never calls this: the layers take their plain-op branch there.)"""
    if torch.jit.is_tracing():
        return 'trace'
    if is_exporting():
        return 'export'
    if functorch_active():
        return 'func'
    if torch.compiler.is_compiling():
        return 'compile'
    if _fx_tracing():
        return 'fx'
    if x.device.type not in ('cpu', 'cuda') or torch._C._len_torch_dispatch_stack():
        return 'dispatch'
    return 'eager'


# torch.fx symbolic tracing (not torch.export, whose graphs is_fx_tracing also reports in recent torch)
_fx_tracing = getattr(torch.fx._symbolic_trace, 'is_fx_symbolic_tracing', torch.fx._symbolic_trace.is_fx_tracing)


class BackendUnusable(RuntimeError):
    """A backend of the position lambdas cannot run on this machine (a Triton that cannot compile kernels here, a CPU
    kernel that did not build): the lambda operator hands the call to the next backend
    (:func:`.position_lambda.backends.fail`), or raises in strict mode."""


_WARNED = set()


@torch.jit.ignore
def warn_once(key: str, message: str) -> None:
    """One RuntimeWarning per process and ``key``, pointing to docs/execution_modes.md."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f'timm_lambda: {message} (docs/execution_modes.md)', RuntimeWarning, stacklevel=3)
