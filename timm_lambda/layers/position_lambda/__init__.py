"""The lambda computation after the query and value norms (LambdaNetworks eq. 1-2, sections 3.1-3.3, appendix F.2).

``y_n^h = (lambda^c + lambda^p_n)^T q_n^h`` with ``lambda^p_n = sum_{u, m} R[m - n, u] v_{m, u}^T`` (``E_nm = R[m -
n]``, |u| summed, appendix C.4), in one of the forms of :data:`FORMS` (docs/lambda_layer.md compares them). A call's
plan (:mod:`.plan`) decides everything once: the form, the backend of the registry (:mod:`.backends`) and the
backend's own decisions; operator backends run inside the operator of :mod:`.custom_ops` (eager mode and
torch.compile), the ``plain`` backend as plain tensor ops in the caller's graph (TorchScript, the graph recorders,
torch.func). :func:`set_backend` chooses a backend, :func:`served_backends` says which ran, :func:`register_backend`
adds one.
"""
from typing import List, Optional

import torch
from timm.layers import register_notrace_function
from torch import Tensor

from . import backends
from .backends import FORMS, Backend, Call, Decision, get_backend, served_backends, set_backend
from .backends import register as register_backend
from .backends import unregister as unregister_backend
from .cpu_kernel import CpuKernel
from .custom_ops import check_call, lambda_op
from .gemm import Gemm
from .plain_ops import KEY_NORMS, Plain, content_term, lambdas_plain, normalize_keys
from .plan import Plan, Spec, choose_form, make_plan
from .tiled_triton import TritonFMA, TritonTC

__all__ = ['FORMS', 'BACKENDS', 'KEY_NORMS', 'Backend', 'Call', 'Decision', 'Plan', 'Spec', 'position_lambdas',
           'lambdas', 'fx_lambdas', 'content_term', 'normalize_keys', 'choose_form', 'make_plan', 'set_backend',
           'get_backend', 'served_backends', 'register_backend', 'unregister_backend', 'check_call', 'lambdas_plain']

# the built-in backends, in the order 'auto' tries them
register_backend(CpuKernel(), TritonTC(), TritonFMA(), Gemm(), Plain())
BACKENDS = backends.names()  # (the built-in ones; backends.names() is the registry's present list)
backends.set_backend_from_environment()


def lambdas(plan: Optional[Plan], spec: Spec, q: Tensor, keys: Optional[Tensor], v: Tensor, table: Tensor,
            shared: Optional[Tensor]) -> Tensor:
    """The lambda computation after the norms on the layer's maps: ``q [B, h k, H, W]``, ``keys [B, u k, H, W]`` or
    None, ``v [B, u V, H, W]``, the relative embedding ``table [k, u, R_h, R_w]``, ``shared [B, k, V]`` or None ->
    ``[B, h V, Ho, Wo]``, by ``plan`` (None: made here, from ``spec`` and ``q``: a torch.fx graph's call)."""
    if plan is None:
        plan = make_plan(spec, q)
    if plan.backend == 'plain':  # plain tensor ops, in the caller's graph (a recorder's: counted once a trace)
        backends.record(plan.form, 'plain', q.device.type, plan.dtype, 'forward')
        return _plain_maps(spec, plan.form, q, keys, v, table, shared)
    return lambda_op(plan, q, keys, v, table, shared)


def _plain_maps(spec: Spec, form: str, q: Tensor, keys: Optional[Tensor], v: Tensor, table: Tensor,
                shared: Optional[Tensor]) -> Tensor:
    """:func:`.plain_ops.lambdas_plain` on the layer's maps (as :func:`lambdas` takes them), in ``form``."""
    b, height, width = q.shape[0], q.shape[2], q.shape[3]
    k, u, n = spec.k, spec.u, height * width
    table_size: Optional[List[int]] = None if spec.global_scope else [spec.table_h, spec.table_w]
    return lambdas_plain(q.reshape(b, spec.heads, k, n), None if keys is None else keys.reshape(b, u, k, n),
                         v.reshape(b, u, spec.dv, n), table, shared, height, width, form, spec.stride,
                         spec.count_include_pad, spec.key_norm, spec.global_scope, table_size)


def fx_lambdas(spec: Spec, q: Tensor, keys: Optional[Tensor], v: Tensor, table: Tensor,
               shared: Optional[Tensor]) -> Tensor:
    """:func:`lambdas` planned when it runs: a torch.fx graph's leaf (the layer's call in a symbolically traced
    graph); TorchScript, which scripts such a graph (timm's FX + TorchScript), runs the plain ops of
    :func:`choose_form`'s form."""
    if torch.jit.is_scripting():
        return _plain_maps(spec, choose_form(spec, q.shape[2], q.shape[3]), q, keys, v, table, shared)
    return lambdas(None, spec, q, keys, v, table, shared)


def position_lambdas(q: Tensor, v: Tensor, table: Tensor, height: int, width: int, form: str,
                     global_scope: bool, stride: int = 1, count_include_pad: bool = False,
                     table_size: Optional[List[int]] = None, content: Optional[Tensor] = None,
                     keys: Optional[Tensor] = None, key_norm: str = 'softmax') -> Tensor:
    """``y_n^h = (lambda^c + lambda^p_n)^T q_n^h`` for every query: ``q [B, h, k, n], v [B, u, V, n] -> [B, h V, Ho,
    Wo]``. ``table``: the relative embedding ``[k, u, R_h, R_w]``; ``form``: ``'auto'`` or one of :data:`FORMS`;
    ``stride=2``: the result average-pooled (3x3, stride 2, padding 1; ``count_include_pad`` as ``nn.AvgPool2d``),
    ``[B, h V, ceil(H/2), ceil(W/2)]``. ``keys [B, u, k, n]``: the layer's keys, normalised over ``n`` (``key_norm``,
    Table 11) into the content lambda (eq. 1); ``content [B, k, V]``: a part of every ``lambda_n`` given as it is.
    (``table_size``: unread, the table's own shape is used.) :func:`lambdas` on the same tensors as maps."""
    b, h, k = q.shape[0], q.shape[1], q.shape[2]
    u, dv = v.shape[1], v.shape[2]
    spec = Spec(form, k, u, dv, h, table.shape[-2], table.shape[-1], global_scope, stride, count_include_pad, key_norm)
    return fx_lambdas(spec, q.reshape(b, h * k, height, width),
                   None if keys is None else keys.reshape(b, u * k, height, width),
                   v.reshape(b, u * dv, height, width), table, content)


# An FX leaf (its Python size logic runs at call time) for timm's feature extraction; modules that call it also declare
# torch.fx.wrap('fx_lambdas') (it patches the caller's global name) so that torch.fx.symbolic_trace works too.
register_notrace_function(position_lambdas)
register_notrace_function(fx_lambdas)
