"""Attention baselines in timm's ResNet frame: AA-ResNets (Bello et al. 2019) and the rows of LambdaNetworks
Table 4 (global, axial and local self-attention against lambda layers in a ResNet-50).

:class:`AttentionResNet` is timm's :class:`~timm.models.resnet.ResNet` (vanilla stem, stages, classifier,
feature extraction, ``forward_intermediates``) in which every block of the chosen stages has an attention
layer in place of its (first) 3x3 convolution, built at construction:

* ``attention='aa'``: :class:`~timm_lambda.layers.AugmentedConv2d` (AA paper sections 3.2 and 4.2),
* ``'global'``: :class:`~timm_lambda.layers.RelPosSelfAttention2d` (timm's BottleneckAttn, any size up to
  ``img_size``),
* ``'axial'``: :class:`~timm_lambda.layers.AxialSelfAttention2d`,
* ``'local'``: :class:`~timm_lambda.layers.LocalSelfAttention2d` (timm's HaloAttn with one-pixel blocks).

Bottleneck blocks are :class:`~timm_lambda.models._blocks.SpatialBottleneck` (timm's Bottleneck, attention in
``conv2``); basic blocks (ResNet-34) are :class:`~timm_lambda.models._blocks.SpatialBasicBlock` (timm's BasicBlock,
attention in ``conv1``: the AA paper augments one convolution per residual block, the first one in its
Wide-ResNets).

In a block that downsamples, the AA layer attends at the output resolution (3x3 average pooling before the
attention, see :mod:`timm_lambda.layers.attention_augmented`); the Table 4 attention layers attend at the
input resolution and pool 3x3 with stride 2 afterwards, as the lambda layers they are compared with
(LambdaNetworks appendix F.2).

The lambda rows of Table 4 (|k| = 8, shared embeddings, lambda convolution 7x7) are
:class:`~timm_lambda.models.LambdaResNet` configurations, registered with the other lambda models in
:mod:`timm_lambda.models.lambda_resnet`.
"""
import math
from functools import partial
from typing import Optional, Sequence, Tuple, Union

from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

from ..layers import AugmentedConv2d, AxialSelfAttention2d, LocalSelfAttention2d, RelPosSelfAttention2d
from ..layers.checks import check_ratio, to_int, to_pair
from ..paper import STAGE_DEPTHS
from ._blocks import HybridResNet, check_layers, check_stages, stage_sizes
from ._pretrained import AA_PAPER, cfg

__all__ = ['AttentionResNet', 'ATTENTIONS']

ATTENTIONS = ('aa', 'global', 'axial', 'local')

# Options of each attention kind and their defaults (None: not accepted for that kind).
_OPTIONS = {
    'aa': dict(kappa=0.2, upsilon=0.1, min_dim_head_k=20, attn_downsample=True, img_size=224),
    'global': dict(qk_ratio=1.0, img_size=224),
    'axial': dict(qk_ratio=0.5, img_size=224),
    'local': dict(qk_ratio=1.0, kernel_size=7),
}


def _aa_layer(in_chs, out_chs, stride=1, in_size=None, norm_layer=None, kappa=0.2, upsilon=0.1, num_heads=8,
              min_dim_head_k=20, attn_downsample=False, dilation=1, device=None, dtype=None):
    size = None
    if in_size is not None:  # attention at the output resolution, halved again when downsampled
        size = tuple(math.ceil(s / stride) for s in in_size)
        size = tuple(math.ceil(s / 2) for s in size) if attn_downsample else size
    return AugmentedConv2d(in_chs, out_chs, 3, stride, kappa=kappa, upsilon=upsilon, heads=num_heads,
                           min_dim_head_k=min_dim_head_k, max_size=size, attn_downsample=attn_downsample,
                           dilation=dilation, device=device, dtype=dtype)


def _global_layer(in_chs, out_chs, stride=1, in_size=None, norm_layer=None, num_heads=8, qk_ratio=1.0,
                  dilation=1, device=None, dtype=None):  # global: nothing to dilate (tables sized by in_size)
    return RelPosSelfAttention2d(in_chs, out_chs, feat_size=in_size, stride=stride, num_heads=num_heads,
                                 qk_ratio=qk_ratio, device=device, dtype=dtype)


def _axial_layer(in_chs, out_chs, stride=1, in_size=None, norm_layer=None, num_heads=8, qk_ratio=0.5,
                 dilation=1, device=None, dtype=None):  # whole rows / columns: nothing to dilate
    return AxialSelfAttention2d(in_chs, out_chs, feat_size=in_size, stride=stride, num_heads=num_heads,
                                qk_ratio=qk_ratio, device=device, dtype=dtype)


def _local_layer(in_chs, out_chs, stride=1, in_size=None, norm_layer=None, num_heads=8, qk_ratio=1.0,
                 kernel_size=7, dilation=1, device=None, dtype=None):
    return LocalSelfAttention2d(in_chs, out_chs, stride=stride, num_heads=num_heads, kernel_size=kernel_size,
                                qk_ratio=qk_ratio, dilation=dilation, device=device, dtype=dtype)


_LAYERS = {'aa': _aa_layer, 'global': _global_layer, 'axial': _axial_layer, 'local': _local_layer}


class AttentionResNet(HybridResNet):
    """timm ResNet whose blocks in ``attn_stages`` use an attention layer in place of a 3x3 convolution.

    Args:
        layers: blocks per stage (c2..c5).
        block: 'bottleneck' (ResNet-50 and deeper) or 'basic' (ResNet-18/34).
        attention: 'aa' (attention augmented convolution), 'global', 'axial' or 'local' self-attention.
        attn_stages: stages (0 = c2 .. 3 = c5) whose every block uses the attention layer.
        num_heads: attention heads (default 8).
        kappa, upsilon, min_dim_head_k: 'aa' only: key depth ratio (default 0.2), value depth ratio (0.1)
            and the minimum key depth per head (20), see :class:`~timm_lambda.layers.AugmentedConv2d`.
        attn_downsample: 'aa' only: the first stage of ``attn_stages`` attends at half resolution
            (default True, AA paper section 4.2).
        qk_ratio: 'global', 'axial', 'local': total query/key depth relative to the value depth (defaults 1,
            0.5, 1).
        kernel_size: 'local' only: neighbourhood side (default 7).
        img_size: largest input, int or (H, W) (default 224): sizes the relative position tables of 'aa',
            'global' and 'axial' (larger inputs raise a ValueError naming img_size); not accepted by 'local',
            which serves any size.
        output_stride: 32 (default), 16 or 8 (timm's ResNet argument): dilated stages keep the resolution (tables
            sized for it; the AA convolution and local attention dilated, global and axial attention unchanged).
        bn_momentum, bn_eps, norm_layer, device, dtype and other timm ResNet arguments (stem_type, drop_rate,
            drop_path_rate, ...): see :class:`~timm_lambda.models._blocks.HybridResNet`.
    """

    def __init__(
            self,
            layers: Sequence[int],
            block: str = 'bottleneck',
            attention: str = 'aa',
            attn_stages: Sequence[int] = (1, 2, 3),
            num_heads: int = 8,
            kappa: Optional[float] = None,
            upsilon: Optional[float] = None,
            min_dim_head_k: Optional[int] = None,
            attn_downsample: Optional[bool] = None,
            qk_ratio: Optional[float] = None,
            kernel_size: Optional[int] = None,
            img_size: Optional[Union[int, Tuple[int, int]]] = None,
            **kwargs,
    ):
        layers = check_layers(layers)
        if block not in ('bottleneck', 'basic'):
            raise ValueError(f"block must be 'bottleneck' or 'basic', got {block!r}")
        if attention not in ATTENTIONS:
            raise ValueError(f'attention must be one of {ATTENTIONS}, got {attention!r}')
        attn_stages = check_stages(attn_stages, 'attn_stages')
        given = dict(kappa=kappa, upsilon=upsilon, min_dim_head_k=min_dim_head_k, attn_downsample=attn_downsample,
                     qk_ratio=qk_ratio, kernel_size=kernel_size, img_size=img_size)
        defaults = _OPTIONS[attention]
        wrong = [k for k, v in given.items() if v is not None and k not in defaults]
        if wrong:
            raise ValueError(f"{', '.join(wrong)} not accepted with attention={attention!r} (its options: "
                             f"{', '.join(defaults)})")
        opts = {k: defaults[k] if given[k] is None else given[k] for k in defaults}
        num_heads = to_int(num_heads, 'num_heads')
        if 'kappa' in opts:
            opts['kappa'] = check_ratio(opts['kappa'], 'kappa')
            opts['upsilon'] = check_ratio(opts['upsilon'], 'upsilon', high=1.0)
            opts['min_dim_head_k'] = to_int(opts['min_dim_head_k'], 'min_dim_head_k')
            if not isinstance(opts['attn_downsample'], bool):
                raise ValueError(f"attn_downsample must be True or False, got {opts['attn_downsample']!r}")
        if 'qk_ratio' in opts:
            opts['qk_ratio'] = check_ratio(opts['qk_ratio'], 'qk_ratio')
        if 'kernel_size' in opts:
            opts['kernel_size'] = to_int(opts['kernel_size'], 'kernel_size', 3)
            if opts['kernel_size'] % 2 == 0:
                raise ValueError(f"kernel_size must be odd and >= 3, got {opts['kernel_size']}")
        size = to_pair(opts.pop('img_size'), 'img_size') if 'img_size' in opts else None

        # output_stride 16 / 8: dilated stages keep their resolution; tables are sized for it, the AA convolution
        # and local attention take the dilation, global and axial attention have none to take
        sizes = stage_sizes(size, output_stride=kwargs.get('output_stride', 32))

        def spatial_layer(stage_idx: int, block_idx: int, stride: int):
            if stage_idx not in attn_stages:
                return None
            stage_opts = dict(opts)
            if 'attn_downsample' in stage_opts:  # only the first attention stage attends at half resolution
                stage_opts['attn_downsample'] = opts['attn_downsample'] and stage_idx == attn_stages[0]
            # a strided block attends at the previous stage's resolution (it downsamples itself)
            in_size = sizes[max(stage_idx - 1, 0)] if stride == 2 else sizes[stage_idx]
            return partial(_LAYERS[attention], in_size=in_size, num_heads=num_heads, **stage_opts)

        super().__init__(layers, spatial_layer, basic=block == 'basic', **kwargs)
        self.attention = attention
        self.attn_stages = attn_stages
        self.img_size = size


# Vanilla ResNet preprocessing at 224 px (AA paper: standard Inception augmentation; LambdaNetworks Tables 3 and 4:
# the 90-epoch setup at 224 px). 'aa', 'global' and 'axial' size their relative tables for img_size and refuse
# larger inputs: fixed_input_size (timm passes input_size on as img_size); 'local' serves any size.
default_cfgs = generate_default_cfgs({
    **{f'aa_resnet{d}.r224': cfg(interpolation='bilinear', fixed_input_size=True, **AA_PAPER)
       for d in (34, 50, 101, 152)},
    'resnet50_global_attn.r224': cfg(interpolation='bilinear', fixed_input_size=True),
    'resnet50_axial_attn.r224': cfg(interpolation='bilinear', fixed_input_size=True),
    'resnet50_local_attn7.r224': cfg(interpolation='bilinear'),
})


def _aa(depth: int, **kwargs):
    layers = (3, 4, 6, 3) if depth == 34 else STAGE_DEPTHS[depth]
    args = dict(layers=layers, block='basic' if depth == 34 else 'bottleneck', attention='aa', attn_stages=(1, 2, 3))
    if depth == 34:
        args.update(kappa=0.25, upsilon=0.25)
    return {**args, **kwargs}


@register_model
def aa_resnet34(pretrained: bool = False, **kwargs) -> AttentionResNet:
    """AA-ResNet-34 (AA paper Table 3, 20.7M): the first 3x3 convolution of every c3-c5 basic block attention
    augmented, kappa = upsilon = 0.25, 8 heads."""
    return build_model_with_cfg(AttentionResNet, 'aa_resnet34', pretrained, **_aa(34, **kwargs))


@register_model
def aa_resnet50(pretrained: bool = False, **kwargs) -> AttentionResNet:
    """AA-ResNet-50 (AA paper Table 3, 25.8M; LambdaNetworks Table 3 "Conv + relative self-attention"): every
    c3-c5 bottleneck 3x3 convolution attention augmented, kappa = 2 upsilon = 0.2, 8 heads."""
    return build_model_with_cfg(AttentionResNet, 'aa_resnet50', pretrained, **_aa(50, **kwargs))


@register_model
def aa_resnet101(pretrained: bool = False, **kwargs) -> AttentionResNet:
    """AA-ResNet-101 (AA paper Table 3, 45.4M): kappa = 2 upsilon = 0.2, 8 heads, every c3-c5 bottleneck."""
    return build_model_with_cfg(AttentionResNet, 'aa_resnet101', pretrained, **_aa(101, **kwargs))


@register_model
def aa_resnet152(pretrained: bool = False, **kwargs) -> AttentionResNet:
    """AA-ResNet-152 (AA paper Table 3, 61.6M): kappa = 2 upsilon = 0.2, 8 heads, every c3-c5 bottleneck."""
    return build_model_with_cfg(AttentionResNet, 'aa_resnet152', pretrained, **_aa(152, **kwargs))


def _table4(attention: str, **kwargs):
    return {**dict(layers=STAGE_DEPTHS[50], attention=attention, attn_stages=(0, 1, 2, 3)), **kwargs}


@register_model
def resnet50_global_attn(pretrained: bool = False, **kwargs) -> AttentionResNet:
    """LambdaNetworks Table 4 "Global self-attention": every ResNet-50 3x3 convolution replaced by global
    multi-head self-attention with 2-D relative logits (8 heads; timm's BottleneckAttn), inputs up to img_size."""
    return build_model_with_cfg(AttentionResNet, 'resnet50_global_attn', pretrained, **_table4('global', **kwargs))


@register_model
def resnet50_axial_attn(pretrained: bool = False, **kwargs) -> AttentionResNet:
    """LambdaNetworks Table 4 "Axial self-attention": every ResNet-50 3x3 convolution replaced by a height-axis
    then a width-axis multi-head self-attention with 1-D relative logits (8 heads)."""
    return build_model_with_cfg(AttentionResNet, 'resnet50_axial_attn', pretrained, **_table4('axial', **kwargs))


@register_model
def resnet50_local_attn7(pretrained: bool = False, **kwargs) -> AttentionResNet:
    """LambdaNetworks Table 4 "Local self-attention (7x7)" / Table 3 "Local relative self-attention
    (Ramachandran et al., 2019)", 18.0M: every ResNet-50 3x3 convolution replaced by 7x7 local self-attention
    (8 heads; timm's HaloAttn with one-pixel blocks)."""
    return build_model_with_cfg(AttentionResNet, 'resnet50_local_attn7', pretrained, **_table4('local', **kwargs))
