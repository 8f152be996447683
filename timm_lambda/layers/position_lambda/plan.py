"""One plan a call: the form that computes a lambda layer's call and the backend that runs it, decided once, here.

:func:`plan_for` reads the call's shape, dtype (autocast's where it applies), device, execution mode
(:func:`~..execution.recorder`) and the switches of :mod:`.backends` (``set_backend``, strict mode) and answers a
:class:`Plan`, cached per combination in eager mode (256 plans of a few ints). The operator's forward runs the
plan's backend and its backward the same one (:mod:`.custom_ops` keeps it for the backward); under torch.compile,
where the graph is traced before any tensor exists, the operator asks :func:`backend_at_run_time` (the same cached
answer) when it runs.
"""
import functools
from typing import NamedTuple

import torch
from torch import Tensor

from ..execution import recorder, warn_once
from . import backends

__all__ = ['Plan', 'plan_for', 'backend_at_run_time']


class Plan(NamedTuple):
    """``form``: ``'einsum'``, ``'conv'``, ``'dense'`` or ``'tiled'``. ``backend``: one of
    :data:`.backends.BACKENDS` (``'plain'``: plain tensor ops, not the operator), or ``''`` under torch.compile
    (:func:`backend_at_run_time` when the operator runs)."""
    form: str
    backend: str


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the operator computes ``x``'s call in: autocast's where it is on for ``x``'s device (float64 stays)."""
    device = x.device.type
    if device in ('cpu', 'cuda') and torch.is_autocast_enabled(device) and x.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return x.dtype


def plan_for(impl: str, q: Tensor, height: int, width: int, table_h: int, table_w: int, global_scope: bool,
         stride: int) -> Plan:
    """The plan of a call of the position lambdas on ``q [B, h, k, n]`` from a ``height x width`` map with a
    ``table_h x table_w`` table (``impl``: the layer's, a form or ``'auto'``). TorchScript, graph recorders
    (jit.trace, the ONNX exporters, torch.export) and torch.func transforms get plain tensor ops (the operator has no
    batching rule), as does the ``plain`` backend and the einsum and conv forms."""
    if torch.jit.is_scripting():
        return Plan(backends.choose_form(impl, height, width, table_h, table_w, global_scope), 'plain')
    return _plan(impl, q, height, width, table_h, table_w, global_scope, stride)


@torch.jit.ignore
def _plan(impl: str, q: Tensor, height: int, width: int, table_h: int, table_w: int, global_scope: bool,
          stride: int) -> Plan:
    context = recorder()
    if torch.compiler.is_compiling():  # symbolic sizes: no cache; the backend when the operator runs
        p = _decide(impl, height, width, table_h, table_w, global_scope, stride, '', q.dtype, 0, context,
                    backends.version(), False)
        return p
    device = q.device.type
    batch = q.shape[0] if device == 'cuda' else 0  # (the CUDA rule reads the queries)
    p = _decided(impl, height, width, table_h, table_w, global_scope, stride, device, compute_dtype(q), batch,
                 context, backends.version(), True)
    if p.backend == 'plain':
        backends.record(p.form, 'plain', q)
    return p


def _decide(impl: str, height: int, width: int, table_h: int, table_w: int, global_scope: bool, stride: int,
            device: str, dtype: torch.dtype, batch: int, context, version: int, choose: bool) -> Plan:
    form = backends.choose_form(impl, height, width, table_h, table_w, global_scope,
                                context in ('jit.trace', 'torch.export'))
    chosen = backends.get_backend()
    backends.check_form(form)
    if context == 'torch.func' and form in ('dense', 'tiled') and chosen != 'plain':
        warn_once('functorch', 'inside torch.func transforms the position lambdas run as plain tensor ops (the '
                               'custom operators have no batching rules): correct, but slower and with more memory')
    if form not in ('dense', 'tiled') or chosen == 'plain' or context is not None:
        return Plan(form, 'plain')
    if not choose:
        return Plan(form, '')
    ho, wo = (height + stride - 1) // stride, (width + stride - 1) // stride
    call = backends.Call(form, device, dtype, stride, batch * ho * wo, height <= table_h and width <= table_w)
    chosen = backends.choose(call)
    backends.note(form, chosen, device, dtype, backends.explain(call, chosen))
    return Plan(form, chosen)


_decided = functools.lru_cache(maxsize=256)(_decide)


@torch.jit.ignore
def backend_at_run_time(form: str, q: Tensor, height: int, width: int, table_h: int, table_w: int,
                        stride: int) -> str:
    """The backend of a compiled graph's operator call (its form fixed when the graph was traced)."""
    device = q.device.type
    return _decided(form, height, width, table_h, table_w, False, stride, device, q.dtype,
                    q.shape[0] if device == 'cuda' else 0, None, backends.version(), True).backend
