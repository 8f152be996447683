"""LambdaResNets: ResNet-RS hybrids with lambda layers (LambdaNetworks section 5.3, appendix F.2).

Built on timm's own :class:`timm.models.resnet.ResNet` (stem, ResNet-D average-pool shortcuts,
SE, DropPath, classifier, feature extraction, ``forward_intermediates``, gradient
checkpointing). A bottleneck listed in ``lambda_blocks`` gets its 3x3 convolution replaced by a
:class:`~timm_lambda.layers.LambdaLayer` (3x3 average pooling with stride 2 after the layer
when the block downsamples) and has no squeeze-and-excitation.

Choices where the paper is ambiguous (tested in tests/test_models.py, listed in README):

* Table 19 lambda positions (e.g. "6, 12, 18" in the 23 c4 blocks of LambdaResNet-101) are
  1-based block numbers within the stage: the 6th, 12th and 18th blocks.
* Squeeze-and-excitation (ratio 0.25 of the block output width, as in ResNet-RS / timm's
  ``resnetrs*``) is used in the convolutional bottlenecks of c2 and c3 only (``se_stages=(0, 1)``).
  That is the only placement that reproduces the paper's parameter counts: LambdaResNet-101
  36.9M, -152 51.4M, -101-C4 26.0M, -152-C4 35.1M. SE in every convolutional bottleneck
  (``se_stages=(0, 1, 2, 3)``, the literal reading of F.2) gives 47.4M for LambdaResNet-101.
"""
from functools import partial
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from torch import nn

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import get_attn
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.resnet import Bottleneck, ResNet

from ..layers import LambdaLayer, RelativePositionEmbedding

__all__ = ['LambdaResNet', 'LAMBDA_BLOCKS', 'STAGE_DEPTHS', 'set_bn_args']

# Table 19: block configuration per depth (He et al. 2016; Bello et al. 2021 / ResNet-RS).
STAGE_DEPTHS = {
    50: (3, 4, 6, 3),
    101: (3, 4, 23, 3),
    152: (3, 8, 36, 3),
    200: (3, 24, 36, 3),
    270: (4, 29, 53, 4),
    350: (4, 36, 72, 4),
    420: (4, 44, 87, 4),
}
# Table 19: lambda layers in c4 (1-based block numbers); every c5 block is a lambda block.
LAMBDA_BLOCKS = {
    50: (3,),
    101: (6, 12, 18),
    152: (5, 10, 15, 20, 25, 30),
    200: (5, 10, 15, 20, 25, 30),
    270: (8, 16, 24, 32, 40, 48),
    350: (10, 20, 30, 40, 50, 60),
    420: (10, 20, 30, 40, 50, 60, 70, 80),
}

StageSpec = Union[None, str, Sequence[int]]


def set_bn_args(model: nn.Module, bn_momentum: Optional[float] = None, bn_eps: Optional[float] = None) -> None:
    """Apply timm's ``bn_momentum``/``bn_eps`` (train.py ``--bn-momentum``) to every batch norm,
    those inside lambda layers included. PyTorch momentum = 1 - TF decay (F.3: 0.9999 -> 1e-4)."""
    for name, value in (('bn_momentum', bn_momentum), ('bn_eps', bn_eps)):
        if value is not None and not 0 < value < 1:
            raise ValueError(f'{name} must be in (0, 1), got {value!r}')
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            if bn_momentum is not None:
                m.momentum = bn_momentum
            if bn_eps is not None:
                m.eps = bn_eps


def _stage_blocks(spec: StageSpec, depth: int, stage: int) -> Tuple[int, ...]:
    """0-based block indices of one stage that become lambda blocks."""
    if spec is None or spec == () or spec == 'none':
        return ()
    if spec == 'all':
        return tuple(range(depth))
    if isinstance(spec, str) or not all(isinstance(i, int) for i in spec):
        raise ValueError(f"lambda_blocks[{stage}] must be None, 'all' or 1-based block numbers, got {spec!r}")
    bad = [i for i in spec if not 1 <= i <= depth]
    if bad:
        raise ValueError(f'lambda_blocks[{stage}] has block numbers {bad} outside 1..{depth} (stage c{stage + 2})')
    return tuple(sorted(i - 1 for i in set(spec)))


class LambdaResNet(ResNet):
    """timm ResNet whose selected bottlenecks use lambda layers (appendix F.2).

    Args:
        layers: blocks per stage (c2..c5).
        lambda_blocks: per stage, None, 'all' or 1-based block numbers that use a lambda layer.
        se_stages: stages (0 = c2 .. 3 = c5) whose convolutional bottlenecks use SE.
        se_ratio: SE squeeze ratio relative to the block output width (0.25 = "ratio of 4").
        dim_k, heads, dim_u, scope, impl, key_norm, qv_norm, content, position: lambda layer
            options (see :class:`~timm_lambda.layers.LambdaLayer`).
        shared_embeddings: one position-embedding table for every lambda layer (Table 4).
        img_size: input size; required with ``scope='global'`` to size the embedding tables.
        bn_momentum, bn_eps: batch-norm settings for every BN layer (timm train.py arguments).
        **kwargs: timm ResNet arguments (stem_type, avg_down, drop_rate, drop_path_rate, ...).
    """

    def __init__(
            self,
            layers: Sequence[int],
            lambda_blocks: Sequence[StageSpec] = (None, None, None, 'all'),
            se_stages: Sequence[int] = (0, 1),
            se_ratio: float = 0.25,
            dim_k: int = 16,
            heads: int = 4,
            dim_u: int = 1,
            scope: Union[int, str] = 23,
            impl: str = 'auto',
            key_norm: str = 'softmax',
            qv_norm: bool = True,
            content: bool = True,
            position: bool = True,
            shared_embeddings: bool = False,
            img_size: Optional[int] = None,
            bn_momentum: Optional[float] = None,
            bn_eps: Optional[float] = None,
            block: Any = Bottleneck,
            block_args: Optional[Dict[str, Any]] = None,
            **kwargs,
    ):
        if len(layers) != 4 or len(lambda_blocks) != 4:
            raise ValueError(f'layers and lambda_blocks need 4 entries (c2..c5), got {layers!r}, {lambda_blocks!r}')
        if any(s not in (0, 1, 2, 3) for s in se_stages):
            raise ValueError(f'se_stages must hold stage indices 0..3 (c2..c5), got {se_stages!r}')
        positions = [_stage_blocks(spec, d, i) for i, (spec, d) in enumerate(zip(lambda_blocks, layers))]
        block_args = dict(block_args or {})
        if se_stages:
            block_args['attn_layer'] = partial(get_attn('se'), rd_ratio=se_ratio)
        super().__init__(block=block, layers=layers, block_args=block_args, **kwargs)

        lambda_args = dict(dim_k=dim_k, heads=heads, dim_u=dim_u, scope=scope, impl=impl,
                           key_norm=key_norm, qv_norm=qv_norm, content=content, position=position)
        if scope in ('global', None) and img_size is None:
            raise ValueError("img_size is required with scope='global' (it sizes the embedding tables)")
        shared = None
        if shared_embeddings and position:
            max_size = None if img_size is None else (-(-img_size // 4),) * 2
            shared = RelativePositionEmbedding(dim_k, dim_u, scope, max_size)
        self.lambda_positions = tuple(positions)
        for stage_idx, stage in enumerate([self.layer1, self.layer2, self.layer3, self.layer4]):
            in_reduction = 4 * 2 ** max(stage_idx - 1, 0)  # reduction of the stage's first 3x3 input
            for block_idx, blk in enumerate(stage):
                if block_idx in positions[stage_idx]:
                    max_size = None if img_size is None else (-(-img_size // in_reduction),) * 2
                    self._to_lambda_block(blk, lambda_args, max_size, shared)
                elif stage_idx not in se_stages:
                    blk.se = None
        set_bn_args(self, bn_momentum, bn_eps)

    @staticmethod
    def _to_lambda_block(blk: Bottleneck, lambda_args: dict, max_size, shared) -> None:
        """Replace the block's 3x3 convolution by a lambda layer and drop its SE (appendix F.2)."""
        conv = blk.conv2
        if conv.groups != 1 or conv.dilation != (1, 1) or not isinstance(blk.aa, nn.Identity):
            raise ValueError('lambda blocks support plain bottlenecks only (no groups, dilation or anti-aliasing)')
        blk.conv2 = LambdaLayer(conv.in_channels, conv.out_channels, stride=conv.stride[0],
                                max_size=max_size, pos_embedding=shared, **lambda_args)
        blk.se = None


def _create_lambda_resnet(variant: str, pretrained: bool = False, **kwargs) -> LambdaResNet:
    return build_model_with_cfg(LambdaResNet, variant, pretrained, **kwargs)


# ResNet-RS base (appendix F.2): ResNet-D, deep stem whose max pool is a strided 3x3 conv.
_RS_ARGS = dict(stem_width=32, stem_type='deep', replace_stem_pool=True, avg_down=True)


def _lambda_resnet_args(depth: int, c4_all: bool = False) -> Dict[str, Any]:
    c4 = 'all' if c4_all else LAMBDA_BLOCKS[depth]
    return dict(layers=STAGE_DEPTHS[depth], lambda_blocks=(None, None, c4, 'all'), **_RS_ARGS)


def _cfg(res: int, **kwargs) -> Dict[str, Any]:
    """Pretrained cfg: trained and evaluated at ``res`` (F.1: 'evaluated at the same resolution')."""
    return {
        'num_classes': 1000, 'input_size': (3, res, res), 'pool_size': (res // 32, res // 32),
        'test_input_size': (3, res, res), 'crop_pct': 0.875, 'interpolation': 'bicubic',
        'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'conv1.0', 'classifier': 'fc',
        'paper_ids': 'arXiv:2102.08602', 'paper_name': 'LambdaNetworks: Modeling Long-Range Interactions without Attention',
        **kwargs,
    }


# Table 18 / Table 20 resolutions; the first tag of each name is its default.
# LambdaResNet-200 is not in Table 18: 256 (as 270, and ResNet-RS-200) is our choice.
_RESOLUTIONS = {
    50: (160, 128), 101: (192, 160), 152: (256, 224, 192, 288), 200: (256,),
    270: (256,), 350: (320, 288, 256), 420: (320,),
}
# -C4 variants: Table 13 (101-C4 at 224, 152-C4 at 256), Table 15 (152/200-C4 at 320), Table 16 (270-C4 at 256).
_RESOLUTIONS_C4 = {
    50: (160,), 101: (224, 192), 152: (256, 320), 200: (320,), 270: (256,), 350: (320,), 420: (320,),
}

default_cfgs = generate_default_cfgs({
    **{f'lambdaresnet{d}.r{r}': _cfg(r) for d, rs in _RESOLUTIONS.items() for r in rs},
    **{f'lambdaresnet{d}_c4.r{r}': _cfg(r) for d, rs in _RESOLUTIONS_C4.items() for r in rs},
    'resnet50_lambda.r224': _cfg(224, interpolation='bilinear', first_conv='conv1'),
    'resnet50_lambda_u4.r224': _cfg(224, interpolation='bilinear', first_conv='conv1'),
    **{f'resnetrs{d}_nose.r{r}': _cfg(r, paper_ids='arXiv:2103.07579') for d, rs in _RESOLUTIONS.items() for r in rs},
})


def _register_depth(depth: int) -> None:
    """Register lambdaresnet{depth}, lambdaresnet{depth}_c4 and resnetrs{depth}_nose."""

    def hybrid(pretrained: bool = False, **kwargs) -> LambdaResNet:
        return _create_lambda_resnet(f'lambdaresnet{depth}', pretrained, **dict(_lambda_resnet_args(depth), **kwargs))

    def c4(pretrained: bool = False, **kwargs) -> LambdaResNet:
        return _create_lambda_resnet(f'lambdaresnet{depth}_c4', pretrained, **dict(_lambda_resnet_args(depth, True), **kwargs))

    def nose(pretrained: bool = False, **kwargs) -> LambdaResNet:
        args = dict(layers=STAGE_DEPTHS[depth], lambda_blocks=(None,) * 4, se_stages=(), **_RS_ARGS)
        return _create_lambda_resnet(f'resnetrs{depth}_nose', pretrained, **dict(args, **kwargs))

    hybrid.__doc__ = (f'LambdaResNet-{depth} (Table 19): ResNet-RS-{depth} with lambda layers in c4 blocks '
                      f'{LAMBDA_BLOCKS[depth]} and every c5 block.')
    c4.__doc__ = f'LambdaResNet-{depth}-C4: every 3x3 convolution of c4 and c5 replaced by a lambda layer (E.2).'
    nose.__doc__ = f'ResNet-RS-{depth} without squeeze-and-excitation ("ResNet-RS wo/ SE", Fig. 4, Table 13).'
    for fn, name in ((hybrid, f'lambdaresnet{depth}'), (c4, f'lambdaresnet{depth}_c4'), (nose, f'resnetrs{depth}_nose')):
        fn.__name__ = fn.__qualname__ = name
        fn.__module__ = __name__
        globals()[name] = register_model(fn)


for _depth in STAGE_DEPTHS:
    _register_depth(_depth)


@register_model
def resnet50_lambda(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """Vanilla ResNet-50 with every 3x3 convolution replaced by a lambda layer (Table 3, 15.0M)."""
    args = dict(layers=STAGE_DEPTHS[50], lambda_blocks=('all',) * 4, se_stages=())
    return _create_lambda_resnet('resnet50_lambda', pretrained, **dict(args, **kwargs))


@register_model
def resnet50_lambda_u4(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """Table 3 'Lambda layer (|u|=4)': as resnet50_lambda with |u|=4 and a 7x7 scope (F.2), 16.0M."""
    args = dict(layers=STAGE_DEPTHS[50], lambda_blocks=('all',) * 4, se_stages=(), dim_u=4, scope=7)
    return _create_lambda_resnet('resnet50_lambda_u4', pretrained, **dict(args, **kwargs))
