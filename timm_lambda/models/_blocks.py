"""ResNet building blocks whose 3x3 convolution is another spatial mixer, built at construction time.

A LambdaResNet (LambdaNetworks appendix F.2) or an attention-augmented ResNet is timm's
:class:`~timm.models.resnet.ResNet` in which chosen bottlenecks replace their 3x3 convolution by a
lambda layer (or an attention-augmented convolution). timm's ``make_blocks`` calls one ``block_fn`` per
stage for every block of that stage, in order; :class:`StageBlocks` is such a ``block_fn`` that builds
block ``i`` either as timm's own :class:`~timm.models.resnet.Bottleneck` or as a :class:`MixerBottleneck`,
with the stage's norm layer and ``device``/``dtype`` factory kwargs.
"""
import math
from typing import Any, Callable, Collection, Optional

from torch import nn
from timm.layers import create_attn
from timm.models.resnet import Bottleneck

__all__ = ['MixerBottleneck', 'StagePlan', 'StageBlocks']


class MixerBottleneck(nn.Module):
    """timm's ResNet bottleneck (1x1, mixer, 1x1, residual) with ``mixer`` in place of the 3x3 convolution.

    ``mixer(in_chs, out_chs, stride=stride, norm_layer=norm_layer, device=, dtype=)`` builds the spatial
    layer (it downsamples itself when ``stride == 2``). Parameter names, ``forward`` and ``zero_init_last``
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
        if cardinality != 1 or dilation != 1 or (first_dilation or 1) != 1 or aa_layer is not None:
            raise ValueError('blocks with a lambda layer or attention support plain bottlenecks only: '
                             f'cardinality=1, dilation=1 (output_stride=32), no aa_layer; got cardinality='
                             f'{cardinality}, dilation={dilation}, aa_layer={aa_layer}')
        width = int(math.floor(planes * (base_width / 64)))
        first_planes = width // reduce_first
        outplanes = planes * self.expansion

        self.conv1 = nn.Conv2d(inplanes, first_planes, kernel_size=1, bias=False, **dd)
        self.bn1 = norm_layer(first_planes, **dd)
        self.act1 = act_layer(inplace=True)
        self.conv2 = mixer(first_planes, width, stride=stride, norm_layer=norm_layer, **dd)
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


class StagePlan:
    """What one ResNet stage is made of: which blocks (0-based) use ``mixer``, and the SE layer of the others."""

    def __init__(self, mixer_blocks: Collection[int] = (), mixer: Optional[Callable[..., nn.Module]] = None,
                 attn_layer: Optional[Any] = None, mixer_attn_layer: Optional[Any] = None):
        self.mixer_blocks = frozenset(mixer_blocks)
        self.mixer = mixer
        self.attn_layer = attn_layer
        self.mixer_attn_layer = mixer_attn_layer


class StageBlocks:
    """A ``block_fn`` for timm's ``make_blocks`` that builds a stage's blocks as planned by a :class:`StagePlan`.

    ``make_blocks`` calls it once per block, in order; the call count is the block index within the stage.
    """
    expansion = 4

    def __init__(self, plan: StagePlan):
        self.plan = plan
        self._index = 0

    def __call__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None,
                 **kwargs) -> nn.Module:
        index, self._index = self._index, self._index + 1
        if index in self.plan.mixer_blocks:
            return MixerBottleneck(inplanes, planes, stride, downsample, mixer=self.plan.mixer,
                                   attn_layer=self.plan.mixer_attn_layer, **kwargs)
        return Bottleneck(inplanes, planes, stride, downsample, attn_layer=self.plan.attn_layer, **kwargs)
