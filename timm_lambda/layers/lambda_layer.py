"""The multi-query lambda layer for 2-D inputs (LambdaNetworks, sections 3.1-3.4, appendix C).

For every query position ``n`` the context is summarised into a linear function (equation 1)::

    lambda_n = sum_m (softmax_m(k)_m + e_nm) v_m^T   = lambda^c + lambda^p_n   in R^{|k| x |v|}

which is applied to ``|h|`` queries (equation 2, section 3.2)::

    y_n = concat_h(lambda_n^T q_n^h)                                          in R^{|h||v|}

The position lambdas: :mod:`.position_lambda`, over the relative embeddings of :mod:`.relative_embedding`.
Intra-depth ``|u|`` (appendix C.4, Fig. 8) adds a dimension to keys, embeddings and values that is summed over.
"""
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
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
from .execution import compiling, functorch_active, recorder, warn_once
from .pooling import downsample_pool
from .position_lambda import (
    KEY_NORMS,
    POSITION_IMPLS,
    choose_form,
    content_term,
    key_views,
    lambdas,
    normalize_keys,
    position_lambdas,
)
from .position_lambda.plain_ops import content_lambda_plain
from .relative_embedding import RelativePositionEmbedding

__all__ = ['LambdaLayer', 'normalize_keys', 'KEY_NORMS']


torch.fx.wrap('check_input')
torch.fx.wrap('position_lambdas')
torch.fx.wrap('lambdas')
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
            computed on the ``d x d`` interleaved sub-grids (:mod:`.dilation`) with every ``impl``; the content
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
        impl: 'auto', 'einsum', 'conv', 'dense' or 'tiled' implementation of the position lambdas
            (:mod:`timm_lambda.layers.position_lambda`); all give the same result.
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
                 position: bool = True, key_norm: str = 'softmax', qv_norm: bool = True, impl: str = 'auto',
                 pos_embedding: Optional[RelativePositionEmbedding] = None, pool_count_include_pad: bool = False,
                 position_bias: bool = False, dilation: int = 1, norm_layer: Callable[..., nn.Module] = nn.BatchNorm2d,
                 pool_size: int = 3, device=None, dtype=None):
        super().__init__()
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
        self.impl = check_choice(impl, 'impl', POSITION_IMPLS)
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
        self.qkv = nn.Conv2d(self.dim, h * k + k * u + v * u, 1, bias=False, **dd)
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
        if self.pool_size == 2 and self.stride == 2:  # applied by forward, after the layer at stride 1
            self.pool = nn.AvgPool2d(2, 2)
        self.reset_parameters()

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
        self.qkv = nn.Conv2d(old.in_channels, old.out_channels, 1, bias=True, device=old.weight.device,
                             dtype=old.weight.dtype)
        self.qkv.weight.copy_(w)
        self.qkv.bias.copy_(bias)
        for norm, a, b in foldable:
            setattr(self, 'norm_q' if norm is self.norm_q else 'norm_v', nn.Identity())

    def extra_repr(self) -> str:
        return (f'dim={self.dim}, dim_out={self.dim_out}, dim_k={self.dim_k}, heads={self.heads}, '
                f'dim_u={self.dim_u}, dim_v={self.dim_v}, scope={self.scope}, stride={self.stride}, '
                f'content={self.content}, position={self.position}, key_norm={self.key_norm!r}, impl={self.impl!r}'
                + (f', dilation={self.dilation}' if self.dilation > 1 else '')
                + (', position_bias=True' if self.pos_bias is not None else '')
                + (', pool_count_include_pad=True' if self.pool_count_include_pad and self.stride == 2 else '')
                + (', pool_size=2' if self.pool_size == 2 and self.stride == 2 else ''))

    @torch.jit.unused
    def __prepare_scriptable__(self):
        if self.position:  # a scripted model must load without this package's custom operators
            warn_once('torchscript', 'TorchScript runs the position lambdas as plain tensor ops: inference is fine, '
                                     'training is slower than in eager mode or under torch.compile')
        return self

    @torch.jit.unused
    def choose_impl(self, height: int, width: int) -> str:
        """The position-lambda implementation used for a ``height x width`` input (the 'auto' rule)."""
        if not self.position:
            return 'none'
        d = self.dilation  # the position lambdas run on the d x d sub-grids
        height, width = (height + d - 1) // d, (width + d - 1) // d
        return choose_form(self.impl, height, width, self.table_size[0], self.table_size[1], self.global_scope)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool_size == 2 and self.stride == 2:  # timm's convention: the layer at stride 1, then 2x2 pooling
            return self.pool(self._lambda_forward(x, 1))
        return self._lambda_forward(x, self.stride)

    def _lambda_forward(self, x: torch.Tensor, stride: int) -> torch.Tensor:
        check_input(x, self.dim, 'LambdaLayer')
        B, _, H, W = x.shape
        n = H * W
        k, u, v, h = self.dim_k, self.dim_u, self.dim_v, self.heads
        if not torch.jit.is_scripting() and compiling():
            # compiled: one 1x1 convolution each (slices of the one weight), no channel-slice views of an activation:
            # inductor orders a saved view's strides by sympy comparisons it cannot decide at symbolic sizes with
            # B = 1 and a square map (``128*s**2 < 128*s``: an InductorError with dynamic=True, issue 51)
            w, b = self.qkv.weight, self.qkv.bias  # (a bias after reparameterize())
            q = F.conv2d(x, w[:h * k], None if b is None else b[:h * k])
            keys = F.conv2d(x, w[h * k:h * k + k * u], None if b is None else b[h * k:h * k + k * u])
            values = F.conv2d(x, w[h * k + k * u:], None if b is None else b[h * k + k * u:])
        elif not torch.jit.is_scripting() and recorder() is None:
            # eager: one split of the projection (its backward is one concatenation; three slices were six launches
            # and two sums), each part a view
            q, keys, values = self.qkv(x).split([h * k, k * u, v * u], dim=1)
        else:
            # recorded (jit.trace, torch.export, torch.func) and scripted: the split of the flattened projection, back
            # to 4-D (a reshape of a 4-D channel slice makes torch.export guard on sizes of 1 even with
            # backed_size_oblivious: docs/execution_modes.md)
            q, keys, values = self.qkv(x).flatten(2).split([h * k, k * u, v * u], dim=1)  # keys stay [B, u k, n]
            q, values = q.unflatten(2, [H, W]), values.unflatten(2, [H, W])
        if not torch.jit.is_scripting() and functorch_active():
            # torch <= 2.13: torch.func.vmap of group_norm fails on a channel slice ("Expected X.is_contiguous"),
            # and .contiguous() is no copy there (the slice is contiguous per sample)
            q = q.clone(memory_format=torch.contiguous_format)
            values = values.clone(memory_format=torch.contiguous_format)
        q, values = self.norm_q(q), self.norm_v(values)  # [B, h k, H, W], [B, u v, H, W]
        shared: Optional[torch.Tensor] = None
        if self.pos_bias is not None:  # lambda^p_n[k, :] += b_k for every n: a part of lambda_n shared by every n
            shared = self.pos_bias.unsqueeze(1).expand(k, v).unsqueeze(0).expand(B, k, v)
        d = self.dilation
        if self.pos_embedding is not None and d == 1:  # everything after the norms: one operator (eager, compiled)
            return lambdas(q, keys if self.content else None, values, self.pos_embedding.weight, shared, B, h, H, W,
                           self.impl, self.global_scope, stride, self.pool_count_include_pad, self.table_size,
                           self.key_norm)
        q = reshape_normed(q, [B, h, k, n])
        values = reshape_normed(values, [B, u, v, n])
        if self.content:  # lambda^c (eq. 1), here the part of every lambda_n shared by every n
            lam = content_lambda_plain(key_views(keys, u, k), values, self.key_norm)
            shared = lam if shared is None else lam + shared
        if self.pos_embedding is None:  # the content lambda alone (Table 9)
            assert shared is not None
            return content_term(shared, q, H, W, stride, self.pool_count_include_pad)  # eq. 2
        # the position lambdas on each d x d interleaved sub-grid of a dilated scope, the content term on the whole
        # map (on the sub-grids, lambda^c repeated d d times, AOTInductor packages returned NaN at small sizes)
        qs = space_to_batch(q.reshape(B, h * k, H, W), d)
        hs, ws = qs.shape[-2], qs.shape[-1]
        pos = position_lambdas(qs.reshape(B * d * d, h, k, hs * ws),
                               space_to_batch(values.reshape(B, u * v, H, W), d).reshape(B * d * d, u, v, hs * ws),
                               self.pos_embedding.weight, hs, ws, self.impl, self.global_scope, stride,
                               self.pool_count_include_pad, self.table_size)  # [B d d, h v, hs, ws]
        pos = batch_to_space(pos, d, H, W)
        return pos if shared is None else content_term(shared, q, H, W) + pos


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
