"""timm's own lambda networks (``timm.models.byoanet``) on this package's :class:`~timm_lambda.layers.LambdaLayer`.

timm publishes ImageNet weights of three lambda networks: ``lambda_resnet26t.c1_in1k``, ``lambda_resnet50ts.a1h_in1k``
(local position lambdas, timm's ``r=9``) and ``lambda_resnet26rpt_256.c1_in1k`` (relative position embeddings over the
whole map, ``r=None``). Its :class:`timm.layers.lambda_layer.LambdaLayer` computes what ours computes (sections
3.1-3.4, |u| = 1) with three conventions, here layer options:

* a bias on its lambda convolution ``Conv3d(1, |k|, (r, r, 1))``: ``position_bias=True``;
* stride 2 by ``nn.AvgPool2d(2, 2)`` after the stride-1 layer: ``pool_size=2`` (floor sizes);
* ``rpt``: a table ``pos_emb [2H-1, 2W-1, |k|]`` for a fixed ``feat_size``: ``scope='global'`` with
  ``max_size=feat_size`` (ours serves every input up to that size, timm's that size only).

:class:`TimmLambdaLayer` is our layer with timm's arguments and initialisation; :func:`convert_timm_lambda_layers`
swaps it in for every timm lambda layer of a model; :func:`checkpoint_filter_timm_lambda_layers` maps timm's
state_dict keys (timm's ``pretrained_filter_fn``). Registered here, for timm's pretrained machinery:
``lambda_resnet26t_fast``, ``lambda_resnet50ts_fast`` and ``lambda_resnet26rpt_256_fast``, timm's architectures
(``ByobNet`` from timm's own ``model_cfgs``) with this layer, whose pretrained cfgs are timm's (same tags, same
Hugging Face Hub ids and URLs): ``pretrained=True`` downloads timm's file and maps it. timm's names stay timm's:
``_fast`` keeps both in one registry.
"""
from dataclasses import replace
from typing import Callable, Optional

import torch
from timm.layers import make_divisible, register_notrace_function, trunc_normal_
from timm.layers.lambda_layer import LambdaLayer as TimmLayer
from timm.models import build_model_with_cfg, byoanet, generate_default_cfgs, register_model
from timm.models.byobnet import ByobNet
from torch import nn

from ..layers import LambdaLayer
from ..layers.checks import check_max_size
from ..layers.projection import Projection

__all__ = ['TimmLambdaLayer', 'convert_timm_lambda_layers', 'checkpoint_filter_timm_lambda_layers', 'FAST_VARIANTS']


def check_feat_size(x: torch.Tensor, max_h: int, max_w: int) -> None:
    """A ValueError naming ``max_size`` for an input larger than a global table covers, before the operator (which
    checks real tensors only, not the meta device's); an FX leaf, skipped by jit.trace."""
    if not torch.jit.is_tracing():
        check_max_size(x.shape[-2], x.shape[-1], max_h, max_w)


torch.fx.wrap('check_feat_size')
register_notrace_function(check_feat_size)

# our name -> timm's name (same architecture, same weights)
FAST_VARIANTS = {
    'lambda_resnet26t_fast': 'lambda_resnet26t',
    'lambda_resnet50ts_fast': 'lambda_resnet50ts',
    'lambda_resnet26rpt_256_fast': 'lambda_resnet26rpt_256',
}


class TimmLambdaLayer(LambdaLayer):
    """:class:`timm.layers.lambda_layer.LambdaLayer`'s arguments, initialisation and outputs, computed by
    :class:`~timm_lambda.layers.LambdaLayer` (its operator and backends).

    Args (timm's): dim, dim_out (default ``dim``); ``feat_size`` (H, W): the input size for ``r=None``; ``stride`` 1
    or 2 (2x2 average pooling after the layer, ``pool_size=2``); ``num_heads`` |h|; ``dim_head`` |k| (if None:
    ``make_divisible(dim_out * qk_ratio, 8) // num_heads``); ``r``: odd local scope ``r x r`` with a position bias
    (timm's lambda convolution), or None: ``scope='global'``, ``max_size=feat_size`` (timm's ``rpt``);
    ``qkv_bias``: a bias on the 1x1 projection. ``norm_layer``: the query and value norms (timm: BatchNorm2d).

    Shapes: ``[B, dim, H, W] -> [B, dim_out, H // stride, W // stride]``; with ``r=None`` any ``H, W`` up to
    ``feat_size`` (timm's: exactly ``feat_size``).
    """

    def __init__(self, dim: int, dim_out: Optional[int] = None, feat_size=None, stride: int = 1, num_heads: int = 4,
                 dim_head: Optional[int] = 16, r: Optional[int] = 9, qk_ratio: float = 1.0, qkv_bias: bool = False,
                 norm_layer: Callable[..., nn.Module] = nn.BatchNorm2d, device=None, dtype=None):
        dim_out = dim_out or dim
        dim_k = dim_head or make_divisible(dim_out * qk_ratio, divisor=8) // num_heads
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1 or r % 2 == 0):
            raise ValueError(f'r must be an odd int >= 1 (the local scope r x r) or None (relative position '
                             f'embeddings over feat_size), got {r!r}')
        if r is None and feat_size is None:
            raise ValueError('feat_size=(H, W) is required with r=None: the relative embeddings cover that input')
        scope = dict(scope=r) if r is not None else dict(scope='global', max_size=feat_size)
        super().__init__(dim, dim_out, dim_k=dim_k, heads=num_heads, stride=stride, position_bias=r is not None,
                         pool_size=2, norm_layer=norm_layer, device=device, dtype=dtype, **scope)
        if qkv_bias:
            self.qkv = Projection(self.dim, self.qkv.out_channels, bias=True, device=device, dtype=dtype)
            self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer at stride 1, then ``self.pool`` (timm's ``nn.AvgPool2d(2, 2)`` at stride 2, ``pool_size=2``)."""
        if self.global_scope:
            check_feat_size(x, (self.table_size[0] + 1) // 2, (self.table_size[1] + 1) // 2)
        # (LambdaLayer.forward's body: TorchScript compiles no super() call)
        y = self._forward(x) if not torch.jit.is_scripting() else self._script_forward(x)
        return self.pool(y) if self.pool_after else y

    def reset_parameters(self) -> None:
        """timm's initialisation: the projection ~ truncated N(0, dim^-1/2); the local table (timm's lambda
        convolution) ~ truncated N(0, |k|^-1/2), the global one ~ truncated N(0, 0.02); the position bias as a Conv3d
        bias, U(-1/r, 1/r) (:meth:`LambdaLayer.reset_parameters`)."""
        super().reset_parameters()
        trunc_normal_(self.qkv.weight, std=self.dim ** -0.5)
        trunc_normal_(self.pos_embedding.weight, std=0.02 if self.global_scope else self.dim_k ** -0.5)


def _map_layer(state_dict: dict, prefix: str) -> None:
    """timm's lambda-layer keys under ``prefix`` in ours, in place: ``conv_lambda.weight [k, 1, r, r, 1]`` (a Conv3d
    over ``[1, H, W, |v|]``: a cross-correlation, weighing the value at ``m = n + o`` by ``W[o + r // 2]``, our
    ``e_nm = R[m - n]``) -> ``pos_embedding.weight [k, 1, r, r]``; ``conv_lambda.bias`` -> ``pos_bias``; ``pos_emb
    [2H-1, 2W-1, k]`` (``e_nm = pos_emb[m - n + (H-1, W-1)]``) -> ``pos_embedding.weight [k, 1, 2H-1, 2W-1]``
    (centred on offset 0 as ours)."""
    w = state_dict.pop(prefix + 'conv_lambda.weight', None)
    if w is not None:
        if w.dim() != 5 or w.shape[1] != 1 or w.shape[4] != 1:
            raise ValueError(f'{prefix}conv_lambda.weight: expected timm\'s Conv3d kernel [k, 1, r, r, 1], '
                             f'got {tuple(w.shape)}')
        state_dict[prefix + 'pos_embedding.weight'] = w[..., 0]
    b = state_dict.pop(prefix + 'conv_lambda.bias', None)
    if b is not None:
        state_dict[prefix + 'pos_bias'] = b
    e = state_dict.pop(prefix + 'pos_emb', None)
    if e is not None:
        if e.dim() != 3:
            raise ValueError(f'{prefix}pos_emb: expected timm\'s table [2H-1, 2W-1, k], got {tuple(e.shape)}')
        state_dict[prefix + 'pos_embedding.weight'] = e.permute(2, 0, 1).unsqueeze(1).contiguous()


_TIMM_KEYS = ('conv_lambda.weight', 'conv_lambda.bias', 'pos_emb')


def checkpoint_filter_timm_lambda_layers(state_dict: dict, model: Optional[nn.Module] = None) -> dict:
    """A state_dict of a model with timm's lambda layers (``timm.models.byoanet``'s checkpoints) in the keys of the
    same model with :class:`TimmLambdaLayer` (timm's ``pretrained_filter_fn(state_dict, model)``; ``model`` unused).

    Every key ending in ``conv_lambda.weight``, ``conv_lambda.bias`` or ``pos_emb`` is mapped (see
    :func:`_map_layer`); the projection and the norms keep their names (``qkv``, ``norm_q``, ``norm_v``), and so
    does everything else. A state_dict in our keys passes through. Returns a new dict (tensors shared or views).
    """
    out = dict(state_dict)
    prefixes = {k[:-len(s)] for k in state_dict for s in _TIMM_KEYS if k == s or k.endswith('.' + s)}
    for prefix in prefixes:
        _map_layer(out, prefix)
    return out


def _from_timm(old: TimmLayer) -> TimmLambdaLayer:
    """One timm layer as a :class:`TimmLambdaLayer`: its projection and norm modules reused as they are (type,
    requires_grad, statistics), its position weights mapped, its train/eval mode kept."""
    w = old.qkv.weight
    local = old.conv_lambda is not None
    r = old.conv_lambda.kernel_size[0] if local else None
    if local and (old.conv_lambda.kernel_size[1] != r or old.conv_lambda.bias is None):
        raise ValueError(f'a timm LambdaLayer with a lambda convolution {tuple(old.conv_lambda.kernel_size)}, '
                         f'bias={old.conv_lambda.bias is not None}: only square r x r kernels with a bias (timm\'s '
                         'layer) convert')
    stride = 2 if isinstance(old.pool, nn.AvgPool2d) else 1
    new = TimmLambdaLayer(old.qkv.in_channels, old.num_heads * old.dim_v, feat_size=old.feat_size, stride=stride,
                          num_heads=old.num_heads, dim_head=old.dim_qk, r=r, device=w.device, dtype=w.dtype)
    new.qkv, new.norm_q, new.norm_v = old.qkv, old.norm_q, old.norm_v
    position = {k: v for k, v in old.state_dict().items() if k in _TIMM_KEYS}
    requires_grad = old.conv_lambda.weight.requires_grad if local else old.pos_emb.requires_grad
    _map_layer(position, '')
    with torch.no_grad():
        for name, value in position.items():
            target = new.get_parameter(name)
            target.copy_(value)
            target.requires_grad_(requires_grad)
    return new.train(old.training)


def convert_timm_lambda_layers(module: nn.Module) -> nn.Module:
    """Every :class:`timm.layers.lambda_layer.LambdaLayer` in ``module`` replaced by the equal
    :class:`TimmLambdaLayer` (same outputs and gradients; weights mapped, the projection and norms reused), in
    place, as ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``: returns ``module``, or the new layer when ``module``
    is itself a timm lambda layer. The model's own names (``stages.2.1.self_attn``) stay; its state_dict has our keys
    (:func:`checkpoint_filter_timm_lambda_layers` maps a timm checkpoint to them)."""
    if isinstance(module, TimmLayer):
        return _from_timm(module)
    for name, child in list(module.named_modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, TimmLayer):
                setattr(child, attr, _from_timm(sub))
    return module


def _timm_cfg(name: str, tag: str):
    """timm's own pretrained cfg of ``name.tag``, its Hub id written out (timm completes a bare ``'timm/'`` with the
    registering model's name, which would be ours)."""
    cfg = byoanet.default_cfgs[name].cfgs[tag]
    hub = cfg.hf_hub_id + f'{name}.{tag}' if cfg.hf_hub_id == 'timm/' else cfg.hf_hub_id
    return replace(cfg, hf_hub_id=hub, notes=(f"timm's {name}.{tag} weights (timm.models.byoanet), mapped on load by "
                                              'checkpoint_filter_timm_lambda_layers.',))


default_cfgs = generate_default_cfgs({
    f'{fast}.{tag}': _timm_cfg(name, tag)
    for fast, name in FAST_VARIANTS.items() for tag in byoanet.default_cfgs[name].tags
})


def _create(variant: str, pretrained: bool, **kwargs) -> ByobNet:
    """timm's ``_create_byoanet`` with :class:`TimmLambdaLayer` as the self-attention layer (its query and value norms
    batch norms whatever the model's ``norm_layer``, as timm's). A caller's own ``pretrained_filter_fn`` runs after
    the key mapping."""
    cfg = byoanet.model_cfgs[FAST_VARIANTS[variant]]
    cfg = replace(cfg, self_attn_layer=TimmLambdaLayer)
    caller_filter = kwargs.pop('pretrained_filter_fn', None)

    def filter_fn(state_dict, model):
        state_dict = checkpoint_filter_timm_lambda_layers(state_dict, model)
        return state_dict if caller_filter is None else caller_filter(state_dict, model)

    return build_model_with_cfg(ByobNet, variant, pretrained, model_cfg=cfg, feature_cfg=dict(flatten_sequential=True),
                                pretrained_filter_fn=filter_fn, **kwargs)


@register_model
def lambda_resnet26t_fast(pretrained: bool = False, **kwargs) -> ByobNet:
    """timm's ``lambda_resnet26t`` (lambda layers, 9x9 local scope, in the last two stages) on this package's layer;
    ``pretrained=True``: timm's ``c1_in1k`` weights."""
    return _create('lambda_resnet26t_fast', pretrained, **kwargs)


@register_model
def lambda_resnet50ts_fast(pretrained: bool = False, **kwargs) -> ByobNet:
    """timm's ``lambda_resnet50ts`` (SiLU, lambda layers, 9x9 local scope, in the last three stages) on this
    package's layer; ``pretrained=True``: timm's ``a1h_in1k`` weights."""
    return _create('lambda_resnet50ts_fast', pretrained, **kwargs)


@register_model
def lambda_resnet26rpt_256_fast(pretrained: bool = False, **kwargs) -> ByobNet:
    """timm's ``lambda_resnet26rpt_256`` (global relative position embeddings in the last two stages, 256 px) on
    this package's layer; ``pretrained=True``: timm's ``c1_in1k`` weights."""
    kwargs.setdefault('img_size', 256)
    return _create('lambda_resnet26rpt_256_fast', pretrained, **kwargs)
