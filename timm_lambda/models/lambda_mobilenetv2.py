"""MobileNet-v2 with two lightweight lambda blocks (LambdaNetworks appendix E.4.2, Table 17).

Lightweight lambda block: an inverted bottleneck whose first pointwise convolution does not
expand the width and whose depthwise convolution is replaced by a lambda convolution with a
5x5 scope, |k|=32, |h|=4. The 10th and 16th inverted bottlenecks of MobileNet-v2 (counting
the first, non-expanding block as the 1st) are replaced. Built on timm's EfficientNet and
InvertedResidual; 3.21M parameters in the paper, 3.24M here (see README).
"""
from functools import partial
from typing import Optional, Sequence

from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._efficientnet_blocks import InvertedResidual
from timm.models._efficientnet_builder import decode_arch_def, round_channels
from timm.models.efficientnet import EfficientNet
from torch import nn

from ..layers import LambdaLayer
from ._blocks import norm_with_bn_args
from ._pretrained import cfg

__all__ = ['LambdaMobileNetV2', 'LightweightLambdaBlock']

# timm's MobileNet-v2 arch definition (Sandler et al. 2018, Table 2).
_MOBILENETV2_ARCH = [
    ['ds_r1_k3_s1_c16'], ['ir_r2_k3_s2_e6_c24'], ['ir_r3_k3_s2_e6_c32'], ['ir_r4_k3_s2_e6_c64'],
    ['ir_r3_k3_s1_e6_c96'], ['ir_r3_k3_s2_e6_c160'], ['ir_r1_k3_s1_e6_c320'],
]


class LightweightLambdaBlock(InvertedResidual):
    """timm's non-expanding inverted bottleneck whose depthwise convolution ``conv_dw`` is a lambda convolution
    (E.4.2): ``[B, chs, H, W]`` in and out. ``dilation``: that of the depthwise conv it replaces (timm's
    ``output_stride`` 16 / 8), the lambda convolution's scope on a dilated grid (see
    :class:`~timm_lambda.layers.LambdaLayer`)."""

    def __init__(self, chs: int, dim_k: int = 32, heads: int = 4, scope: int = 5, dilation: int = 1,
                 act_layer=nn.ReLU6, norm_layer=nn.BatchNorm2d, device=None, dtype=None, **kwargs):
        super().__init__(chs, chs, exp_ratio=1.0, act_layer=act_layer, norm_layer=norm_layer, device=device,
                         dtype=dtype, **kwargs)
        self.conv_dw = LambdaLayer(chs, chs, dim_k=dim_k, heads=heads, scope=scope, dilation=dilation,
                                   norm_layer=norm_layer, device=device, dtype=dtype)


class LambdaMobileNetV2(EfficientNet):
    """timm EfficientNet (MobileNet-v2 config) with lightweight lambda blocks.

    Args:
        lambda_blocks: 1-based numbers of the inverted bottlenecks to replace (default 10, 16).
        dim_k, heads, scope: lambda convolution options (E.4.2 defaults).
        bn_momentum, bn_eps: batch-norm settings for every norm layer (timm train.py arguments).
        output_stride: 32 (default), 16 or 8 (timm's EfficientNet argument): the lambda blocks of dilated
            stages take the dilation of the depthwise convolution they replace.

    timm's EfficientNet builds its blocks inside its constructor with no hook for another block type, so
    the chosen blocks are rebuilt here, in this constructor, with the model's norm layer and factory kwargs.
    """

    def __init__(self, lambda_blocks: Sequence[int] = (10, 16), dim_k: int = 32, heads: int = 4,
                 scope: int = 5, drop_path_rate: float = 0., bn_momentum: Optional[float] = None,
                 bn_eps: Optional[float] = None, norm_layer=nn.BatchNorm2d, act_layer=nn.ReLU6,
                 device=None, dtype=None, **kwargs):
        norm_layer = norm_with_bn_args(norm_layer, bn_momentum, bn_eps)
        super().__init__(drop_path_rate=drop_path_rate, norm_layer=norm_layer, act_layer=act_layer,
                         device=device, dtype=dtype, **kwargs)
        flat = [(s, i) for s, stage in enumerate(self.blocks) for i in range(len(stage))]
        if isinstance(lambda_blocks, int):
            lambda_blocks = (lambda_blocks,)
        for number in lambda_blocks:
            if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= len(flat):
                raise ValueError(f'lambda_blocks holds {number!r}; blocks are numbered 1..{len(flat)}')
            s, i = flat[number - 1]
            old = self.blocks[s][i]
            if not getattr(old, 'has_skip', False):
                raise ValueError(f'block {number} changes width or stride; lightweight lambda blocks '
                                 f'replace residual (same width, stride 1) blocks only')
            dilation = old.conv_dw.dilation[0]  # > 1 in stages timm dilates for output_stride 16 / 8
            new = LightweightLambdaBlock(old.conv_pwl.out_channels, dim_k, heads, scope, dilation, act_layer=act_layer,
                                         norm_layer=norm_layer, device=device, dtype=dtype)
            new.drop_path = old.drop_path
            self.blocks[s][i] = new


default_cfgs = generate_default_cfgs({
    'mobilenetv2_100_lambda.r224': cfg(224, first_conv='conv_stem', classifier='classifier'),
})


@register_model
def mobilenetv2_100_lambda(pretrained: bool = False, **kwargs) -> LambdaMobileNetV2:
    """MobileNet-v2 with the 10th and 16th inverted bottlenecks replaced by lightweight lambda blocks."""
    model_args = dict(
        block_args=decode_arch_def(_MOBILENETV2_ARCH), num_features=1280, stem_size=32,
        round_chs_fn=partial(round_channels, multiplier=1.0),
    )
    return build_model_with_cfg(LambdaMobileNetV2, 'mobilenetv2_100_lambda', pretrained,
                                feature_cfg=dict(flatten_sequential=True), **dict(model_args, **kwargs))
