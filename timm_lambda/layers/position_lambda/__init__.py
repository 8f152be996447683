"""The lambda computation after the query and value norms (LambdaNetworks eq. 1-2, sections 3.1-3.3, appendix F.2).

``y_n^h = (lambda^c + lambda^p_n)^T q_n^h`` with ``lambda^p_n = sum_{u, m} R[m - n, u] v_{m, u}^T`` (``E_nm = R[m -
n]``, |u| summed, appendix C.4), in one of the forms of :data:`FORMS` (docs/lambda_layer.md compares them). A call's
plan (:mod:`.plan`) decides the form and the backend once: the operator of :mod:`.custom_ops` (eager mode and
torch.compile; what it computes: :mod:`.fused`) or plain tensor ops (:mod:`.plain_ops`: TorchScript, the graph
recorders, torch.func, the ``plain`` backend). :func:`set_backend` overrides the backend table of :mod:`.backends`,
:func:`served_backends` says which ran.
"""
from typing import List, Optional

from timm.layers import register_notrace_function
from torch import Tensor

from ..batch_one import reshape_normed
from .backends import BACKENDS, FORMS, choose_form, get_backend, served_backends, set_backend
from .custom_ops import lambda_op
from .plain_ops import KEY_NORMS, content_term, lambdas_plain, normalize_keys
from .plan import plan_for

__all__ = ['POSITION_IMPLS', 'FORMS', 'BACKENDS', 'KEY_NORMS', 'position_lambdas', 'lambdas', 'key_views',
           'content_term', 'normalize_keys', 'choose_form', 'set_backend', 'get_backend', 'served_backends']

POSITION_IMPLS = FORMS  # the layer's ``impl`` argument: a form or 'auto'


def position_lambdas(q: Tensor, v: Tensor, table: Tensor, height: int, width: int, impl: str,
                     global_scope: bool, stride: int = 1, count_include_pad: bool = False,
                     table_size: Optional[List[int]] = None, content: Optional[Tensor] = None,
                     keys: Optional[Tensor] = None, key_norm: str = 'softmax') -> Tensor:
    """``y_n^h = (lambda^c + lambda^p_n)^T q_n^h`` for every query: ``q [B, h, k, n], v [B, u, V, n] -> [B, h V, Ho,
    Wo]`` (contiguous from the operator; possibly a strided view from plain ops). ``table``: the relative embedding
    ``[k, u, R_h, R_w]``; ``impl``: one of :data:`POSITION_IMPLS`; ``stride=2``: the result average-pooled (3x3,
    stride 2, padding 1; ``count_include_pad`` as ``nn.AvgPool2d``), ``[B, h V, ceil(H/2), ceil(W/2)]``.
    ``table_size``: the table's ``[R_h, R_w]`` as Python ints (see :func:`~..relative_embedding.block_embedding`).
    ``keys [B, u, k, n]``: the layer's keys, normalised over ``n`` (``key_norm``, Table 11) into the content lambda
    (eq. 1); ``content [B, k, V]``: a part of every ``lambda_n`` given as it is (added to the keys' content lambda).
    :func:`lambdas` on the same tensors as maps."""
    b, h, k = q.shape[0], q.shape[1], q.shape[2]
    u, dv = v.shape[1], v.shape[2]
    return lambdas(q.reshape(b, h * k, height, width), None if keys is None else keys.reshape(b, u * k, height, width),
                   v.reshape(b, u * dv, height, width), table, content, b, h, height, width, impl, global_scope,
                   stride, count_include_pad, table_size, key_norm)


def lambdas(q: Tensor, keys: Optional[Tensor], v: Tensor, table: Tensor, shared: Optional[Tensor], batch: int,
            heads: int, height: int, width: int, impl: str, global_scope: bool, stride: int = 1,
            count_include_pad: bool = False, table_size: Optional[List[int]] = None,
            key_norm: str = 'softmax') -> Tensor:
    """:func:`position_lambdas` on the layer's maps (what :class:`~..lambda_layer.LambdaLayer` calls): ``q [B, h k, H,
    W]``, ``keys [B, u k, H, W]`` or ``[B, u k, n]`` (:func:`key_views`) or None, ``v [B, u V, H, W]``, ``shared [B,
    k, V]`` or None -> ``[B, h V, Ho, Wo]``; ``batch``, ``heads``: B and h. The operator takes the maps as they are;
    plain ops their views (the norms' outputs through :func:`~..batch_one.reshape_normed`)."""
    p = plan_for(impl, q, height, width, table.shape[-2], table.shape[-1], global_scope, stride)
    if p.backend == 'plain':  # (the batch and heads as the caller has them: a traced graph reads them from x)
        k, u, n = table.shape[0], table.shape[1], height * width
        return lambdas_plain(reshape_normed(q, [batch, heads, k, n]), None if keys is None else key_views(keys, u, k),
                             reshape_normed(v, [batch, u, v.shape[1] // u, n]), table, shared, height, width, p.form,
                             stride, count_include_pad, key_norm, global_scope, table_size)
    return lambda_op(q, keys, v, table, shared, height, width, p.form, p.backend, stride, count_include_pad, key_norm,
                     global_scope)


def key_views(keys: Tensor, u: int, k: int) -> Tensor:
    """The keys ``[B, u k, n]`` (a channel slice of the projection: unflattened, as a reshape of that slice made
    torch.export guard on sizes of 1) or ``[B, u k, H, W]`` as ``[B, u, k, n]``."""
    if keys.dim() == 3:
        return keys.unflatten(1, [u, k])
    return keys.reshape(keys.shape[0], u, k, keys.shape[2] * keys.shape[3])


# An FX leaf (its Python size logic runs at call time) for timm's feature extraction; modules that call it also declare
# torch.fx.wrap('position_lambdas') (it patches the caller's global name) so that torch.fx.symbolic_trace works too.
register_notrace_function(position_lambdas)
register_notrace_function(lambdas)
