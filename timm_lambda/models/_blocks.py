"""ResNet blocks whose 3x3 convolution is another spatial mixer, the stage adapter that builds them, and the
stage geometry that sizes the mixers' position tables.

A LambdaResNet (LambdaNetworks appendix F.2) or an attention ResNet is timm's
:class:`~timm.models.resnet.ResNet` in which chosen blocks replace a 3x3 convolution by a lambda layer or an
attention layer. timm's ``make_blocks`` calls one ``block_fn`` per stage for every block of that stage, in
order; :class:`StageBlocks` is such a ``block_fn``: it builds block ``i`` either as timm's own
:class:`~timm.models.resnet.Bottleneck` / :class:`~timm.models.resnet.BasicBlock` or as a
:class:`MixerBottleneck` / :class:`MixerBasicBlock`, with the stage's norm layer and ``device``/``dtype``
factory kwargs.
"""
import math
from functools import partial
from typing import Any, Callable, Collection, Optional, Tuple

from torch import nn
from timm.layers import create_attn, get_norm_layer
from timm.models.resnet import BasicBlock, Bottleneck

__all__ = ['MixerBottleneck', 'MixerBasicBlock', 'StageBlocks', 'stage_sizes', 'norm_with_bn_args',
           'check_output_stride', 'OUTPUT_STRIDES']

Size = Tuple[int, int]


OUTPUT_STRIDES = (8, 16, 32)


def check_output_stride(output_stride) -> int:
    """8, 16 or 32 (timm's ResNet ``output_stride``); a ValueError naming the accepted values otherwise."""
    if isinstance(output_stride, bool) or output_stride not in OUTPUT_STRIDES:
        raise ValueError(f'output_stride must be one of {OUTPUT_STRIDES}, got {output_stride!r}')
    return int(output_stride)


def stage_sizes(img_size: Optional[Size], stem_reduction: int = 4,
                output_stride: int = 32) -> Tuple[Optional[Size], ...]:
    """(H, W) of the c2..c5 outputs of a ResNet at ``img_size`` whose stem reduces by ``stem_reduction`` (4:
    stride-2 stem and stride-2 pool; 1: the CIFAR stem), every stride-2 step rounding up; ``None`` for each
    when ``img_size`` is None. The first block of stage ``s`` sees ``stage_sizes(...)[max(s - 1, 0)]``.

    ``output_stride`` 16 or 8: the stages timm's ``make_blocks`` dilates (those whose nominal stride, counted
    from 4 after the stem, would pass ``output_stride``) keep the previous stage's size."""
    output_stride = check_output_stride(output_stride)
    if img_size is None:
        return (None,) * 4
    steps, net_stride = [], 4
    for stage in range(4):
        if stage > 0 and net_stride < output_stride:  # as make_blocks: dilate once net_stride >= output_stride
            net_stride *= 2
        steps.append(net_stride // 4)
    return tuple(tuple(math.ceil(s / (stem_reduction * step)) for s in img_size) for step in steps)


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


def _dilation_arg(dilation: int) -> dict:
    """``{'dilation': d}`` for a dilated block's mixer, nothing at dilation 1 (mixers built without it)."""
    return {'dilation': dilation} if dilation > 1 else {}


class MixerBottleneck(nn.Module):
    """timm's ResNet bottleneck (1x1, mixer, 1x1, residual) with ``mixer`` in place of the 3x3 convolution.

    ``mixer(in_chs, out_chs, stride=stride, norm_layer=norm_layer, device=, dtype=)`` builds the spatial
    layer (it downsamples itself when ``stride == 2``); in a dilated stage (timm's ``output_stride`` 16 or 8)
    it also gets ``dilation=first_dilation or dilation`` (the dilation timm gives its 3x3 convolution) when
    that is > 1. Parameter names, ``forward`` and ``zero_init_last``
    are timm's :class:`~timm.models.resnet.Bottleneck`'s, so checkpoints and tools treat both alike.
    Shapes: ``[B, inplanes, H, W] -> [B, 4 planes, H / stride, W / stride]``.
    """
    expansion = 4

    def __init__(
            self,
            inplanes: int,
            planes: int,
            stride: int = 1,
            downsample: Optional[nn.Module] = None,
            cardinality: int = 1,
            base_width: int = 64,
            reduce_first: int = 1,
            dilation: int = 1,
            first_dilation: Optional[int] = None,
            act_layer: Callable[..., nn.Module] = nn.ReLU,
            norm_layer: Callable[..., nn.Module] = nn.BatchNorm2d,
            attn_layer: Optional[Any] = None,
            aa_layer: Optional[Any] = None,
            drop_block: Optional[Callable[[], nn.Module]] = None,
            drop_path: Optional[nn.Module] = None,
            mixer: Callable[..., nn.Module] = None,
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        if mixer is None:
            raise ValueError('MixerBottleneck needs a mixer (the layer that replaces the 3x3 convolution)')
        if cardinality != 1 or aa_layer is not None:
            raise ValueError('blocks with a lambda layer or attention support plain bottlenecks only: '
                             f'cardinality=1, no aa_layer; got cardinality={cardinality}, aa_layer={aa_layer}')
        width = int(math.floor(planes * (base_width / 64)))
        first_planes = width // reduce_first
        outplanes = planes * self.expansion

        self.conv1 = nn.Conv2d(inplanes, first_planes, kernel_size=1, bias=False, **dd)
        self.bn1 = norm_layer(first_planes, **dd)
        self.act1 = act_layer(inplace=True)
        self.conv2 = mixer(first_planes, width, stride=stride, norm_layer=norm_layer,
                           **_dilation_arg(first_dilation or dilation), **dd)
        self.bn2 = norm_layer(width, **dd)
        self.drop_block = drop_block() if drop_block is not None else nn.Identity()
        self.act2 = act_layer(inplace=True)
        self.aa = nn.Identity()
        self.conv3 = nn.Conv2d(width, outplanes, kernel_size=1, bias=False, **dd)
        self.bn3 = norm_layer(outplanes, **dd)
        self.se = create_attn(attn_layer, outplanes, **dd)
        self.act3 = act_layer(inplace=True)
        self.downsample = downsample
        self.stride = stride
        self.dilation = dilation
        self.drop_path = drop_path

    zero_init_last = Bottleneck.zero_init_last
    forward = Bottleneck.forward


class MixerBasicBlock(nn.Module):
    """timm's ResNet basic block (3x3, 3x3, residual) with ``mixer`` in place of the first 3x3 convolution.

    ``mixer(in_chs, out_chs, stride=stride, norm_layer=norm_layer, device=, dtype=)`` builds the layer (it
    downsamples itself; ``dilation`` as in :class:`MixerBottleneck`). Parameter names, ``forward`` and ``zero_init_last`` are timm's
    :class:`~timm.models.resnet.BasicBlock`'s.
    """
    expansion = 1

    def __init__(
            self,
            inplanes: int,
            planes: int,
            stride: int = 1,
            downsample: Optional[nn.Module] = None,
            cardinality: int = 1,
            base_width: int = 64,
            reduce_first: int = 1,
            dilation: int = 1,
            first_dilation: Optional[int] = None,
            act_layer: Callable[..., nn.Module] = nn.ReLU,
            norm_layer: Callable[..., nn.Module] = nn.BatchNorm2d,
            attn_layer: Optional[Any] = None,
            aa_layer: Optional[Any] = None,
            drop_block: Optional[Callable[[], nn.Module]] = None,
            drop_path: Optional[nn.Module] = None,
            mixer: Callable[..., nn.Module] = None,
            device=None,
            dtype=None,
    ):
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        if mixer is None:
            raise ValueError('MixerBasicBlock needs a mixer (the layer that replaces the first 3x3 convolution)')
        if cardinality != 1 or base_width != 64 or aa_layer is not None:
            raise ValueError('basic blocks with attention support plain blocks only: cardinality=1, base_width=64, '
                             f'no aa_layer; got cardinality={cardinality}, base_width={base_width}, '
                             f'aa_layer={aa_layer}')
        first_planes = planes // reduce_first
        outplanes = planes * self.expansion
        self.conv1 = mixer(inplanes, first_planes, stride=stride, norm_layer=norm_layer,
                           **_dilation_arg(first_dilation or dilation), **dd)
        self.bn1 = norm_layer(first_planes, **dd)
        self.drop_block = drop_block() if drop_block is not None else nn.Identity()
        self.act1 = act_layer(inplace=True)
        self.aa = nn.Identity()
        self.conv2 = nn.Conv2d(first_planes, outplanes, kernel_size=3, padding=dilation, dilation=dilation,
                               bias=False, **dd)
        self.bn2 = norm_layer(outplanes, **dd)
        self.se = create_attn(attn_layer, outplanes, **dd)
        self.act2 = act_layer(inplace=True)
        self.downsample = downsample
        self.stride = stride
        self.dilation = dilation
        self.drop_path = drop_path

    zero_init_last = BasicBlock.zero_init_last
    forward = BasicBlock.forward


class StageBlocks:
    """A ``block_fn`` for timm's ``make_blocks``: the blocks of one stage, some with ``mixer``.

    Args:
        mixer: builds the spatial layer of the mixer blocks (see :class:`MixerBottleneck`); None: every block
            is timm's plain block.
        mixer_blocks: 0-based indices of the blocks that use ``mixer`` (None: every block).
        basic: basic blocks (ResNet-18/34) instead of bottlenecks.
        attn_layer: timm attention (e.g. SE) of the plain blocks; ``mixer_attn_layer`` that of the mixer blocks.
        strided_mixer: the mixer of a block with stride 2 (default ``mixer``), e.g. one sized for the
            previous stage's resolution.

    ``make_blocks`` calls it once per block, in order; the call count is the block index within the stage.
    """

    def __init__(self, mixer: Optional[Callable[..., nn.Module]] = None, mixer_blocks: Optional[Collection[int]] = None,
                 basic: bool = False, attn_layer: Optional[Any] = None, mixer_attn_layer: Optional[Any] = None,
                 strided_mixer: Optional[Callable[..., nn.Module]] = None):
        self.mixer = mixer
        self.strided_mixer = strided_mixer or mixer
        self.mixer_blocks = None if mixer_blocks is None else frozenset(mixer_blocks)
        self.basic = basic
        self.expansion = 1 if basic else 4
        self.attn_layer = attn_layer
        self.mixer_attn_layer = mixer_attn_layer
        self._index = 0

    def __call__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None,
                 **kwargs) -> nn.Module:
        index, self._index = self._index, self._index + 1
        if self.mixer is None or (self.mixer_blocks is not None and index not in self.mixer_blocks):
            block = BasicBlock if self.basic else Bottleneck
            return block(inplanes, planes, stride, downsample, attn_layer=self.attn_layer, **kwargs)
        block = MixerBasicBlock if self.basic else MixerBottleneck
        mixer = self.strided_mixer if stride == 2 else self.mixer
        return block(inplanes, planes, stride, downsample, mixer=mixer, attn_layer=self.mixer_attn_layer, **kwargs)
