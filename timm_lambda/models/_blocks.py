"""timm's ResNet blocks with a lambda or attention layer in place of a 3x3 convolution, the ResNet they build
(:class:`HybridResNet`, the base of the LambdaResNets and the attention baselines), and the stage geometry that
sizes those layers' position tables.

A LambdaResNet (LambdaNetworks section 5.3, appendix F.2) or an attention ResNet is timm's
:class:`~timm.models.resnet.ResNet` in which chosen blocks are :class:`SpatialBottleneck` /
:class:`SpatialBasicBlock`: timm's :class:`~timm.models.resnet.Bottleneck` / :class:`~timm.models.resnet.BasicBlock`
whose 3x3 convolution is replaced, after timm has built the block, by ``spatial_layer(...)``.
"""
import math
from functools import partial
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
from timm.layers import get_norm_layer
from timm.models.resnet import BasicBlock, Bottleneck, ResNet
from torch import nn

from ..layers.checks import to_int

__all__ = ['SpatialBottleneck', 'SpatialBasicBlock', 'HybridResNet', 'stage_sizes', 'norm_with_bn_args',
           'check_layers', 'check_stages', 'check_output_stride', 'OUTPUT_STRIDES']

Size = Tuple[int, int]
# spatial_layer(in_chs, out_chs, stride=, dilation=, norm_layer=, device=, dtype=) -> nn.Module
SpatialLayer = Callable[..., nn.Module]

OUTPUT_STRIDES = (8, 16, 32)


def check_output_stride(output_stride) -> int:
    """8, 16 or 32 (timm's ResNet ``output_stride``); a ValueError naming the accepted values otherwise."""
    if isinstance(output_stride, bool) or output_stride not in OUTPUT_STRIDES:
        raise ValueError(f'output_stride must be one of {OUTPUT_STRIDES}, got {output_stride!r}')
    return int(output_stride)


def check_layers(layers) -> Tuple[int, ...]:
    """Blocks per stage c2..c5: four ints >= 1."""
    layers = tuple(to_int(d, 'layers') for d in layers)
    if len(layers) != 4:
        raise ValueError(f'layers needs 4 entries (blocks in c2..c5), got {layers!r}')
    return layers


def check_stages(stages, name: str) -> Tuple[int, ...]:
    """Stage indices 0..3 (c2..c5), sorted and without repeats."""
    if isinstance(stages, (str, int)) or any(isinstance(s, bool) or s not in (0, 1, 2, 3) for s in stages):
        raise ValueError(f'{name} must hold stage indices 0..3 (c2..c5), got {stages!r}')
    return tuple(sorted(set(stages)))


def stage_sizes(img_size: Optional[Size], stem_reduction: int = 4,
                output_stride: int = 32) -> Tuple[Optional[Size], ...]:
    """(H, W) of the c2..c5 outputs of a ResNet at ``img_size`` whose stem reduces by ``stem_reduction`` (4:
    stride-2 stem and stride-2 pool; 1: the CIFAR stem), every stride-2 step rounding up; ``None`` for each
    when ``img_size`` is None. The first block of stage ``s`` sees ``stage_sizes(...)[max(s - 1, 0)]``.

    ``output_stride`` 16 or 8: the stages timm's ``make_blocks`` dilates (those whose nominal stride, counted
    from 4 after the stem, would pass ``output_stride``) keep the previous stage's size."""
    reductions = stage_reductions(stem_reduction, output_stride)
    if img_size is None:
        return (None,) * 4
    return tuple(tuple(math.ceil(s / r) for s in img_size) for r in reductions)


def stage_reductions(stem_reduction: int = 4, output_stride: int = 32) -> Tuple[int, ...]:
    """Input / output resolution of the c2..c5 stages (:func:`stage_sizes` divides by them, rounding up)."""
    output_stride = check_output_stride(output_stride)
    steps, net_stride = [], 4
    for stage in range(4):
        if stage > 0 and net_stride < output_stride:  # as make_blocks: dilate once net_stride >= output_stride
            net_stride *= 2
        steps.append(net_stride // 4)
    return tuple(stem_reduction * step for step in steps)


def norm_with_bn_args(norm_layer, bn_momentum: Optional[float] = None, bn_eps: Optional[float] = None):
    """``norm_layer`` with timm train.py's ``--bn-momentum``/``--bn-eps`` bound (PyTorch momentum = 1 - TF
    decay; F.3's decay 0.9999 is momentum 1e-4). Every norm of the model, lambda layers' included, uses it."""
    norm_layer = get_norm_layer(norm_layer)
    bound = {}
    for name, key, value in (('bn_momentum', 'momentum', bn_momentum), ('bn_eps', 'eps', bn_eps)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
            raise ValueError(f'{name} must be a number in (0, 1), got {value!r}')
        bound[key] = float(value)
    return partial(norm_layer, **bound) if bound else norm_layer


class _SpatialLayerBlock:
    """A timm ResNet block whose 3x3 convolution ``replaced`` is, once timm has built the block,
    ``spatial_layer(in_chs, out_chs, stride=, dilation=, norm_layer=, device=, dtype=)``: the layer downsamples
    itself when ``stride == 2`` and takes the dilation timm gave the convolution (> 1 in the stages timm dilates
    for ``output_stride`` 16 or 8). Names, ``forward`` and ``zero_init_last`` stay timm's, so checkpoints and
    tools treat both alike."""
    replaced: str

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None, *,
                 spatial_layer: SpatialLayer, cardinality: int = 1, aa_layer: Any = None,
                 norm_layer: Callable[..., nn.Module] = nn.BatchNorm2d, device=None, dtype=None, **kwargs):
        if cardinality != 1 or aa_layer is not None:
            raise ValueError('blocks with a lambda or attention layer support plain blocks only: cardinality=1, '
                             f'no aa_layer; got cardinality={cardinality}, aa_layer={aa_layer}')
        super().__init__(inplanes, planes, stride, downsample, norm_layer=norm_layer, device=device, dtype=dtype,
                         **kwargs)
        conv = getattr(self, self.replaced)
        setattr(self, self.replaced, spatial_layer(conv.in_channels, conv.out_channels, stride=stride,
                                                   dilation=conv.dilation[0], norm_layer=norm_layer,
                                                   device=device, dtype=dtype))


class SpatialBottleneck(_SpatialLayerBlock, Bottleneck):
    """timm's :class:`~timm.models.resnet.Bottleneck` (1x1, 3x3, 1x1, residual) with ``spatial_layer`` (a lambda or
    attention layer) in place of its 3x3 convolution ``conv2``.
    Shapes: ``[B, inplanes, H, W] -> [B, 4 planes, H / stride, W / stride]``."""
    replaced = 'conv2'


class SpatialBasicBlock(_SpatialLayerBlock, BasicBlock):
    """timm's :class:`~timm.models.resnet.BasicBlock` (3x3, 3x3, residual) with ``spatial_layer`` in place of its
    first 3x3 convolution ``conv1`` (the AA paper augments the first convolution of a Wide-ResNet block).
    Shapes: ``[B, inplanes, H, W] -> [B, planes, H / stride, W / stride]``."""
    replaced = 'conv1'


class _BlockArgs(nn.Module):
    """Stands in for one block while timm's ``make_blocks`` lays out the stages: it keeps the arguments
    ``make_blocks`` computed for the block (stride, downsample, dilation, drop path, ...), which
    :class:`HybridResNet` then builds with the block's index (``make_blocks`` passes the blocks none)."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.args, self.kwargs = args, kwargs


class _BottleneckArgs(_BlockArgs):
    expansion = Bottleneck.expansion


class _BasicBlockArgs(_BlockArgs):
    expansion = BasicBlock.expansion


class HybridResNet(ResNet):
    """timm's :class:`~timm.models.resnet.ResNet` whose blocks are chosen one by one: block ``block_idx`` of stage
    ``stage_idx`` (c2 = 0) is a :class:`SpatialBottleneck` / :class:`SpatialBasicBlock` with
    ``spatial_layer(stage_idx, block_idx, stride)`` when that returns a layer factory, and timm's own block (with
    ``conv_attn[stage_idx]``, e.g. SE) when it returns None.

    timm's ``make_blocks`` computes every block's stride, dilation, shortcut and drop-path rate; this class lets
    it do so with stand-ins and builds each block from those arguments and its index.

    Args:
        layers: blocks per stage (c2..c5).
        spatial_layer: ``(stage_idx, block_idx, stride) -> layer factory or None``.
        basic: basic blocks (ResNet-18/34) instead of bottlenecks.
        conv_attn: per stage, the timm attention (``attn_layer``) of its convolutional blocks.
        bn_momentum, bn_eps: batch-norm settings for every norm layer (timm train.py arguments).
        norm_layer: normalisation layer of every block, the spatial layers' included.
        **kwargs: timm ResNet arguments (stem_type, avg_down, output_stride, drop_path_rate, device, ...).
    """
    stem_reduction = 4  # input / c2 resolution (7x7 or deep stride-2 stem + stride-2 pool); sizes global tables

    def __init__(self, layers: Sequence[int], spatial_layer: Callable[[int, int, int], Optional[SpatialLayer]],
                 basic: bool = False, conv_attn: Sequence[Any] = (None,) * 4, bn_momentum: Optional[float] = None,
                 bn_eps: Optional[float] = None, norm_layer: Any = nn.BatchNorm2d, zero_init_last: bool = True,
                 **kwargs):
        norm_layer = norm_with_bn_args(norm_layer, bn_momentum, bn_eps)
        super().__init__(block=_BasicBlockArgs if basic else _BottleneckArgs, layers=layers, norm_layer=norm_layer,
                         zero_init_last=zero_init_last, **kwargs)
        plain, spatial = (BasicBlock, SpatialBasicBlock) if basic else (Bottleneck, SpatialBottleneck)
        for stage_idx in range(len(layers)):
            stage = getattr(self, f'layer{stage_idx + 1}')
            for block_idx, block in enumerate(stage):
                stride = block.args[2]  # make_blocks calls block_fn(inplanes, planes, stride, downsample, **kwargs)
                layer = spatial_layer(stage_idx, block_idx, stride)
                if layer is None:
                    stage[block_idx] = plain(*block.args, attn_layer=conv_attn[stage_idx], **block.kwargs)
                else:
                    stage[block_idx] = spatial(*block.args, spatial_layer=layer, **block.kwargs)
        self.init_weights(zero_init_last=zero_init_last)

    @torch.jit.ignore
    def init_weights(self, zero_init_last: bool = True) -> None:
        """timm's ResNet initialisation, then the spatial layers' own (timm's kaiming init of every convolution
        would otherwise overwrite their query/key/value projections; F.2 for the lambda layers)."""
        super().init_weights(zero_init_last=zero_init_last)
        for m in self.modules():
            if isinstance(m, _SpatialLayerBlock):
                getattr(m, m.replaced).reset_parameters()
