"""The multi-query lambda layer for 2-D inputs (LambdaNetworks, sections 3.1-3.4, appendix C).

For every query position ``n`` the context is summarised into a linear function (equation 1)::

    lambda_n = sum_m (softmax_m(k)_m + e_nm) v_m^T   = lambda^c + lambda^p_n   in R^{|k| x |v|}

which is applied to ``|h|`` queries (equation 2, section 3.2)::

    y_n = concat_h(lambda_n^T q_n^h)                                          in R^{|h||v|}

The position lambdas: :mod:`.position_lambda`, over the relative embeddings of :mod:`.relative_embedding`.
Intra-depth ``|u|`` (appendix C.4, Fig. 8) adds a dimension to keys, embeddings and values that is summed over.
"""
import warnings
from typing import Callable, List, Optional, Tuple

import torch
from timm.layers import register_notrace_function
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_weights

from .._compat import register_load_state_dict_pre_hook
from .batch_one import reshape_normed
from .checks import (
    check_bool,
    check_choice,
    check_heads,
    check_input,
    check_scope,
    check_stride,
    to_int,
)
from .dilation import batch_to_space, check_dilation, space_to_batch
from .execution import mode as execution_mode
from .execution import warn_once
from .pooling import downsample_pool
from .position_lambda import (
    FORMS,
    KEY_NORMS,
    Spec,
    choose_form,
    content_term,
    fx_lambdas,
    lambdas,
    make_plan,
    normalize_keys,
)
from .position_lambda.backends import record
from .position_lambda.custom_ops import lambda_op
from .position_lambda.plain_ops import content_lambda_plain, lambdas_plain
from .projection import Projection, project
from .relative_embedding import RelativePositionEmbedding

__all__ = ['LambdaLayer', 'normalize_keys', 'KEY_NORMS']


torch.fx.wrap('check_input')
torch.fx.wrap('fx_lambdas')
torch.fx.wrap('space_to_batch')
torch.fx.wrap('batch_to_space')
register_notrace_function(check_input)


class LambdaLayer(nn.Module):
    """Multi-query lambda layer, a drop-in for a ``3 x 3`` convolution on NCHW tensors.

    Args:
        dim: input channels |d|.
        dim_out: output channels (default ``dim``); |v| = dim_out / heads.
        dim_k: query/key depth |k| (default 16).
        heads: number of queries |h| (default 4).
        dim_u: intra-depth |u| (default 1, appendix C.4).
        scope: local position scope (odd int or (h, w), default 23 for 23x23) or 'global'.
        max_size: (H, W) of the largest input, required for ``scope='global'``.
        stride: 1, or 2 for 3x3 average pooling with stride 2 after the layer (appendix F.2); padding 1
            as timm's strided 3x3 convs, borders averaged over in-image positions only (as TF 'SAME').
        dilation: the local scope on a grid dilated by ``d`` (not in the paper; by analogy with atrous convolution,
            for output_stride 16 or 8): query ``n`` uses the contexts ``m = n + d o`` for the scope's offsets ``o``,
            computed on the ``d x d`` interleaved sub-grids (:mod:`.dilation`) with every ``form``; the content
            lambda stays global. Needs a local scope and ``stride=1``.
        pool_count_include_pad: average the stride-2 pooling's border windows over all 9 positions, zero padding
            included (``nn.AvgPool2d(3, 2, 1)``'s default), for checkpoints trained that way (d-li14/lambda.pytorch).
        pool_size: the stride-2 downsampling: 3 (default), the 3x3 pooling above, output ``ceil(H/2) x ceil(W/2)``;
            2, timm's ``nn.AvgPool2d(2, 2)`` on the layer's stride-1 output (:class:`timm.layers.LambdaLayer`), output
            ``floor(H/2) x floor(W/2)`` (an odd map's last row or column is dropped), for timm's checkpoints
            (:mod:`timm_lambda.models.timm_byoanet`). Read only when ``stride=2``.
        position_bias: a learned bias ``b`` of |k| entries added to every position-lambda entry,
            ``lambda^p_n[k, :] += b_k``, so each output gains ``sum_k q_n^h[k] b_k`` in every value channel
            (the bias of a lambda convolution ``Conv3d(|u|, |k|, (1, r, r), bias=True)``). Off by default
            (not in the paper); on for checkpoints that have it (d-li14/lambda.pytorch). Needs ``position``.
        content: use the content lambda (Table 9).
        position: use the position lambdas (Table 9).
        key_norm: 'softmax' (default), 'l2' or 'none': normalisation of the keys over context
            positions (Table 11).
        qv_norm: batch norm on queries and values (default True, section 3.1 "Normalization").
        form: 'auto', 'einsum', 'conv', 'dense' or 'tiled': the form that computes the position lambdas
            (:mod:`timm_lambda.layers.position_lambda`, docs/lambda_layer.md); all give the same result. (``impl``:
            its former name, still accepted with a FutureWarning.)
        pos_embedding: a :class:`RelativePositionEmbedding` to share between layers (Table 4), with the same |k|,
            |u| and scope; counted and saved once (by the first layer that takes it).
        norm_layer: normalisation layer for queries and values (``norm_layer(channels, device=, dtype=)``).
        device, dtype: factory kwargs for every parameter and buffer.

    Shapes: input ``[B, dim, H, W]``, output ``[B, dim_out, ceil(H/stride), ceil(W/stride)]`` (floor with
    ``pool_size=2``).

    timm's :class:`timm.layers.LambdaLayer` (``timm.models.byoanet``): ``num_heads`` = ``heads``, ``dim_head`` =
    ``dim_k``, ``r`` (default 9) = ``scope`` (default 23, the paper's), ``r=None`` with ``feat_size`` =
    ``scope='global'`` with ``max_size``. timm fixes |u| = 1, pools a stride-2 layer 2x2 (``pool_size=2``; 3x3 by
    default here, appendix F.2) and has a bias on its lambda convolution (``position_bias=True``); its layers and
    models convert with :func:`timm_lambda.models.convert_timm_lambda_layers`. Our names are Table 1's.
    """

    def __init__(self, dim: int, dim_out: Optional[int] = None, dim_k: int = 16, heads: int = 4, dim_u: int = 1,
                 scope=23, max_size: Optional[Tuple[int, int]] = None, stride: int = 1, content: bool = True,
                 position: bool = True, key_norm: str = 'softmax', qv_norm: bool = True, form: str = 'auto',
                 pos_embedding: Optional[RelativePositionEmbedding] = None, pool_count_include_pad: bool = False,
                 position_bias: bool = False, dilation: int = 1, norm_layer: Callable[..., nn.Module] = nn.BatchNorm2d,
                 pool_size: int = 3, device=None, dtype=None, impl: Optional[str] = None):
        super().__init__()
        if impl is not None:
            warnings.warn("LambdaLayer's impl= is now called form= (the form of the position lambdas); impl= will "
                          'go in a later release', FutureWarning, stacklevel=2)
            form = impl
        dd = {'device': device, 'dtype': dtype}
        self.dim = to_int(dim, 'dim')
        self.dim_out = to_int(self.dim if dim_out is None else dim_out, 'dim_out')
        self.dim_k = to_int(dim_k, 'dim_k')
        self.heads = check_heads(heads, self.dim_out)  # |v| = dim_out / heads
        self.dim_u = to_int(dim_u, 'dim_u')
        self.dim_v = self.dim_out // self.heads
        self.stride = check_stride(stride)
        self.content = check_bool(content, 'content')
        self.position = check_bool(position, 'position')
        check_bool(qv_norm, 'qv_norm')
        self.pool_count_include_pad = check_bool(pool_count_include_pad, 'pool_count_include_pad')
        check_bool(position_bias, 'position_bias')
        if pool_size not in (2, 3) or isinstance(pool_size, bool):
            raise ValueError(f'pool_size must be 3 (3x3 pooling, padding 1) or 2 (2x2 pooling), got {pool_size!r}')
        if pool_size == 2 and pool_count_include_pad:
            raise ValueError('pool_count_include_pad=True counts the padding of the 3x3 pooling; pool_size=2 pools '
                             'without padding')
        self.pool_size = int(pool_size)
        if not (content or position):
            raise ValueError('at least one of content and position must be True')
        if position_bias and not position:
            raise ValueError('position_bias=True adds a bias to the position lambdas; it needs position=True')
        self.key_norm = check_choice(key_norm, 'key_norm', KEY_NORMS)
        form = check_choice(form, 'form', ('auto',) + FORMS)
        scope = check_scope(scope)
        self.dilation = check_dilation(dilation)
        if self.dilation > 1 and (scope == 'global' or self.stride != 1):
            raise ValueError(f'dilation={dilation} needs a local scope and stride=1 (a dilated layer keeps the '
                             f'resolution; a global scope already sees every position), got scope={scope!r}, '
                             f'stride={self.stride}')
        if scope != 'global' and max_size is not None:
            raise ValueError(f'max_size={max_size!r} only applies to scope=\'global\'; a local scope '
                             f'({scope[0]}x{scope[1]}) serves any input size')

        k, u, v, h = self.dim_k, self.dim_u, self.dim_v, self.heads
        # One 1x1 projection for queries, keys and values (W_Q, W_K, W_V of Table 1).
        self.qkv = Projection(self.dim, h * k + k * u + v * u, **dd)
        self.norm_q = norm_layer(h * k, **dd) if qv_norm else nn.Identity()
        self.norm_v = norm_layer(v * u, **dd) if qv_norm else nn.Identity()

        if pos_embedding is not None:
            if not (position and isinstance(pos_embedding, RelativePositionEmbedding)
                    and (pos_embedding.dim_k, pos_embedding.dim_u, pos_embedding.scope) == (k, u, scope)):
                raise ValueError(f'pos_embedding must be a RelativePositionEmbedding with the layer\'s dim_k={k}, '
                                 f'dim_u={u}, scope={scope}, and position=True; got {pos_embedding!r}, '
                                 f'position={position}')
            if getattr(pos_embedding, '_has_owner', False):  # shared: saved and loaded by its first layer only
                self._register_state_dict_hook(_drop_shared_embedding)
                register_load_state_dict_pre_hook(self, _restore_shared_embedding)
            pos_embedding._has_owner = True
        elif position:
            pos_embedding = RelativePositionEmbedding(k, u, scope, max_size, **dd)
        self.pos_embedding = pos_embedding
        self.scope = scope
        self.global_scope = scope == 'global'
        # the table's [R_h, R_w] as Python ints, also inside jit.trace
        self.table_size: List[int] = list(self.pos_embedding.weight.shape[-2:]) if self.position else [1, 1]
        self.pos_bias = nn.Parameter(torch.empty(k, **dd)) if position_bias else None
        # the downsampling's settings as a module (peer-weight conversions read them); the forward pools with them
        # inside content_term / position_lambdas
        self.pool = downsample_pool(self.stride, self.pool_count_include_pad)
        # timm's convention (pool_size=2): the lambda computation at stride 1, then this pool (in forward)
        self.pool_after = self.pool_size == 2 and self.stride == 2
        if self.pool_after:
            self.pool = nn.AvgPool2d(2, 2)
        # the position lambdas' configuration, what every call's plan starts from (position_lambda.plan)
        self.spec = Spec(form, k, u, v, h, self.table_size[0], self.table_size[1], self.global_scope,
                         1 if self.pool_after else self.stride, self.pool_count_include_pad, self.key_norm)
        self._reparameterized = False
        self.reset_parameters()

    __jit_unused_properties__ = ['form']
    spec: Spec  # (TorchScript reads its type here)

    @property
    def form(self) -> str:
        """The form of the position lambdas asked for (``'auto'`` or one of :data:`FORMS`); settable."""
        return self.spec.form

    @form.setter
    def form(self, value: str) -> None:
        self.spec = self.spec._replace(form=check_choice(value, 'form', ('auto',) + FORMS))

    def reset_parameters(self) -> None:
        """Appendix F.2: W_K, W_V ~ N(0, d^-1/2); W_Q ~ N(0, (|k| d)^-1/2) (std). The optional position bias
        is initialised as PyTorch initialises a Conv3d bias: U(-a, a), a = (|u| x table area)^-1/2."""
        w = self.qkv.weight
        nq = self.heads * self.dim_k
        with torch.no_grad():
            nn.init.normal_(w, std=self.dim ** -0.5)
            nn.init.normal_(w[:nq], std=(self.dim_k * self.dim) ** -0.5)
            if self.pos_bias is not None:
                bound = (self.dim_u * self.table_size[0] * self.table_size[1]) ** -0.5
                nn.init.uniform_(self.pos_bias, -bound, bound)

    @torch.no_grad()
    def reparameterize(self) -> None:
        """For inference (timm's ``reparameterize_model``, ``validate.py --reparam``): the query and value batch norms
        folded into the projection by their running statistics, ``W' = diag(s) W``, bias ``beta - s mu`` with ``s =
        gamma / sqrt(var + eps)`` (computed in float64), and replaced by ``nn.Identity``: an eval forward without its
        two norms (one convolution with a bias, then the lambda operator). One-way: the layer then has no norms to
        train. A norm that is not a batch norm with running statistics (GroupNorm, ``qv_norm=False``) stays."""
        nq, nk = self.heads * self.dim_k, self.dim_k * self.dim_u
        parts = [(self.norm_q, 0, nq), (self.norm_v, nq + nk, self.qkv.out_channels)]
        foldable = [(n, a, b) for n, a, b in parts if _folds(n)]
        if not foldable:
            return
        w = self.qkv.weight.to(torch.float64, copy=True)  # (copies: the old projection is left as it was)
        bias = torch.zeros(w.shape[0], dtype=torch.float64, device=w.device) if self.qkv.bias is None \
            else self.qkv.bias.to(torch.float64, copy=True)
        for norm, a, b in foldable:  # (torch's conv + BN fusion, on the norm's channel slice, in float64)
            gamma, beta = (None if t is None else t.double() for t in (norm.weight, norm.bias))
            w[a:b], bias[a:b] = fuse_conv_bn_weights(w[a:b], bias[a:b], norm.running_mean.double(),
                                                     norm.running_var.double(), norm.eps, gamma, beta)
        old = self.qkv
        self.qkv = Projection(old.in_channels, old.out_channels, bias=True, device=old.weight.device,
                              dtype=old.weight.dtype)
        self.qkv.weight.copy_(w)
        self.qkv.bias.copy_(bias)
        for norm, a, b in foldable:
            setattr(self, 'norm_q' if norm is self.norm_q else 'norm_v', nn.Identity())
        self._reparameterized = True

    @torch.jit.unused
    def train(self, mode: bool = True):
        """``nn.Module.train``; a layer folded by :meth:`reparameterize` (one-way: for inference) warns once when put
        back into training mode, as it would then train without its query and value norms."""
        if mode and self._reparameterized and not getattr(self, '_warned_train', False):
            self._warned_train = True
            warnings.warn('LambdaLayer.reparameterize() folded the query and value batch norms into the projection '
                          '(one-way, for inference): in training mode this layer now trains without them; rebuild or '
                          'reload the model before reparameterize() to train it', RuntimeWarning, stacklevel=2)
        return super().train(mode)

    def extra_repr(self) -> str:
        return (f'dim={self.dim}, dim_out={self.dim_out}, dim_k={self.dim_k}, heads={self.heads}, '
                f'dim_u={self.dim_u}, dim_v={self.dim_v}, scope={self.scope}, stride={self.stride}, '
                f'content={self.content}, position={self.position}, key_norm={self.key_norm!r}, form={self.form!r}'
                + (f', dilation={self.dilation}' if self.dilation > 1 else '')
                + (', position_bias=True' if self.pos_bias is not None else '')
                + (', pool_count_include_pad=True' if self.pool_count_include_pad and self.stride == 2 else '')
                + (', pool_size=2' if self.pool_after else ''))

    @torch.jit.unused
    def __prepare_scriptable__(self):
        if self.position:  # a scripted model must load without this package's custom operators
            warn_once('torchscript', 'TorchScript runs the position lambdas as plain tensor ops: inference is fine, '
                                     'training is slower than in eager mode or under torch.compile')
        return self

    @torch.jit.unused
    def choose_form(self, height: int, width: int) -> str:
        """The form of the position lambdas for a ``height x width`` input (the ``'auto'`` rule), or ``'none'``."""
        if not self.position:
            return 'none'
        d = self.dilation  # the position lambdas run on the d x d sub-grids
        return choose_form(self.spec, (height + d - 1) // d, (width + d - 1) // d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._forward(x) if not torch.jit.is_scripting() else self._script_forward(x)
        return self.pool(y) if self.pool_after else y  # (pool_size=2: timm's 2x2 pooling after the layer)

    def _script_forward(self, x: torch.Tensor) -> torch.Tensor:
        """TorchScript: the plain tensor ops, no operator (a scripted model loads without this package)."""
        check_input(x, self.dim, 'LambdaLayer')
        q, keys, values = self._project(x, 'script')
        return self._after_norms(self.norm_q(q), keys, self.norm_v(values), x, 'script')

    @torch.jit.unused
    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """Eager mode, torch.compile, the graph recorders and transforms: the call's plan (made once, here) says
        how it runs; everything after the norms is one operator where it says so (position_lambda.lambdas)."""
        mode = execution_mode(x)  # (read once a call: the plan takes it)
        check_input(x, self.dim, 'LambdaLayer', mode)
        plan = None
        if self.pos_embedding is not None and self.dilation == 1 and mode != 'fx':
            plan = make_plan(self.spec, x, mode)  # (torch.fx: the operator call is a leaf that plans when it runs)
        q, keys, values = self._project(x, mode)
        q, values = self.norm_q(q), self.norm_v(values)  # [B, h k, H, W], [B, u v, H, W]
        if plan is None and mode != 'fx':
            return self._after_norms(q, keys, values, x, mode)
        if plan is not None and plan.backend == 'plain':  # (a recorder's: counted once a trace)
            record(plan.form, 'plain', x.device.type, plan.dtype, 'forward')
            return self._after_norms(q, keys, values, x, mode, plan.form)
        if plan is None:  # torch.fx: a leaf of the graph, planning when it runs
            return fx_lambdas(self.spec, q, keys if self.content else None, values, self.pos_embedding.weight,
                              self._shared(x.shape[0]))
        return lambda_op(plan, q, keys if self.content else None, values, self.pos_embedding.weight,
                         self._shared(x.shape[0]))

    def _project(self, x: torch.Tensor, mode: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [B, h k, H, W], keys [B, u k, H, W] or [B, u k, n], values [B, u v, H, W])`` from the one 1x1
        projection, each mode its way."""
        k, u, v, h = self.dim_k, self.dim_u, self.dim_v, self.heads
        if mode == 'compile':
            # one 1x1 convolution each (slices of the one weight; in float32 where the Projection's rule says so), no
            # channel-slice views of an activation: inductor orders a saved view's strides by sympy comparisons it
            # cannot decide at symbolic sizes with B = 1 and a square map (``128*s**2 < 128*s``: an InductorError
            # with dynamic=True, issue 51)
            w, b = self.qkv.weight, self.qkv.bias  # (a bias after reparameterize())
            q = project(x, w[:h * k], None if b is None else b[:h * k], matmul=False)
            keys = project(x, w[h * k:h * k + k * u], None if b is None else b[h * k:h * k + k * u], matmul=False)
            values = project(x, w[h * k + k * u:], None if b is None else b[h * k + k * u:], matmul=False)
            return q, keys, values
        if mode in ('eager', 'dispatch', 'fx'):
            # one split of the projection (its backward is one concatenation; three slices were six launches and two
            # sums), each part a view
            q, keys, values = self.qkv(x).split([h * k, k * u, v * u], dim=1)
            return q, keys, values
        # recorded (jit.trace, torch.export, torch.func) and scripted: the split of the flattened projection, back to
        # 4-D (a reshape of a 4-D channel slice makes torch.export guard on sizes of 1 even with
        # backed_size_oblivious: docs/execution_modes.md)
        H, W = x.shape[2], x.shape[3]
        q, keys, values = self.qkv(x).flatten(2).split([h * k, k * u, v * u], dim=1)  # keys stay [B, u k, n]
        q, values = q.unflatten(2, [H, W]), values.unflatten(2, [H, W])
        if mode == 'func':
            # torch <= 2.13: torch.func.vmap of group_norm fails on a channel slice ("Expected X.is_contiguous"),
            # and .contiguous() is no copy there (the slice is contiguous per sample)
            q = q.clone(memory_format=torch.contiguous_format)
            values = values.clone(memory_format=torch.contiguous_format)
        return q, keys, values

    def _shared(self, batch: int) -> Optional[torch.Tensor]:
        """``lambda^p_n[k, :] += b_k`` for every n: the position bias as a part of ``lambda_n`` shared by every n,
        ``[B, k, V]`` (None without it)."""
        if self.pos_bias is None:
            return None
        return self.pos_bias.unsqueeze(1).expand(self.dim_k, self.dim_v).unsqueeze(0).expand(batch, self.dim_k,
                                                                                            self.dim_v)

    def _after_norms(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, x: torch.Tensor, mode: str,
                     form: str = '') -> torch.Tensor:
        """The lambda computation after the norms in plain tensor ops (TorchScript, graph recorders, transforms, the
        plain backend), and the content lambda alone or a dilated scope in every mode. (The sizes from the layer's
        input ``x``: a recorded graph reads them from its input, so that they stay dynamic in an ONNX file.)"""
        B, H, W = x.shape[0], x.shape[2], x.shape[3]
        n = H * W
        k, u, v, h = self.dim_k, self.dim_u, self.dim_v, self.heads
        shared = self._shared(B)
        q = reshape_normed(q, [B, h, k, n])
        values = reshape_normed(values, [B, u, v, n])
        keys = keys.unflatten(1, [u, k]) if keys.dim() == 3 else keys.reshape(B, u, k, n)  # [B, u, k, n]
        d = self.dilation
        if self.pos_embedding is not None and d == 1:  # the plain backend's form, or TorchScript's choice
            if form == '':
                form = choose_form(self.spec, H, W)
            return lambdas_plain(q, keys if self.content else None, values, self.pos_embedding.weight, shared, H, W,
                                 form, self.spec.stride,
                                 self.pool_count_include_pad, self.key_norm, self.global_scope, self.table_size)
        if self.content:  # lambda^c (eq. 1), here the part of every lambda_n shared by every n
            lam = content_lambda_plain(keys, values, self.key_norm)
            shared = lam if shared is None else lam + shared
        if self.pos_embedding is None:  # the content lambda alone (Table 9)
            assert shared is not None
            return content_term(shared, q, H, W, self.spec.stride, self.pool_count_include_pad)  # eq. 2
        # the position lambdas on each d x d interleaved sub-grid of a dilated scope, the content term on the whole
        # map (on the sub-grids, lambda^c repeated d d times, AOTInductor packages returned NaN at small sizes)
        qs = space_to_batch(q.reshape(B, h * k, H, W), d)
        vs = space_to_batch(values.reshape(B, u * v, H, W), d)
        hs, ws = qs.shape[-2], qs.shape[-1]
        pos = self._sub_grids(qs.reshape(B * d * d, h * k, hs, ws), vs.reshape(B * d * d, u * v, hs, ws), mode)
        pos = batch_to_space(pos, d, H, W)  # [B, h v, H, W]
        return pos if shared is None else content_term(shared, q, H, W) + pos

    def _sub_grids(self, qs: torch.Tensor, vs: torch.Tensor, mode: str) -> torch.Tensor:
        """The position term on the sub-grids ``qs [B d d, h k, hs, ws]``, ``vs [B d d, u v, hs, ws]``."""
        if not torch.jit.is_scripting():
            if mode != 'fx':
                return lambdas(make_plan(self.spec, qs, mode), self.spec, qs, None, vs, self.pos_embedding.weight,
                               None)
            return fx_lambdas(self.spec, qs, None, vs, self.pos_embedding.weight, None)
        hs, ws = qs.shape[2], qs.shape[3]
        b, n = qs.shape[0], hs * ws
        return lambdas_plain(qs.reshape(b, self.heads, self.dim_k, n), None,
                             vs.reshape(b, self.dim_u, self.dim_v, n), self.pos_embedding.weight, None, hs, ws,
                             choose_form(self.spec, hs, ws), 1, False, self.key_norm, self.global_scope,
                             self.table_size)

def _folds(norm: nn.Module) -> bool:
    """Whether :meth:`LambdaLayer.reparameterize` folds ``norm``: a batch norm (``nn.BatchNorm2d``, ``SyncBatchNorm``,
    a frozen batch norm) with running statistics."""
    return (isinstance(norm, nn.modules.batchnorm._NormBase) or type(norm).__name__ == 'FrozenBatchNorm2d') and \
        getattr(norm, 'running_mean', None) is not None and getattr(norm, 'running_var', None) is not None


def _drop_shared_embedding(module, state_dict, prefix, local_metadata):
    """state_dict hook of a layer that shares another layer's embedding: the table is saved once, by the
    layer that registered it first (safetensors and timm's save_for_hf refuse aliased tensors)."""
    state_dict.pop(prefix + 'pos_embedding.weight', None)
    return state_dict


def _restore_shared_embedding(module, state_dict, prefix, *args):
    """Load pre-hook: the shared table is loaded through its first layer; this one reads it back as is."""
    state_dict.setdefault(prefix + 'pos_embedding.weight', module.pos_embedding.weight.detach())
