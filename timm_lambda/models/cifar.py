"""LambdaResNets for small (32x32) inputs: the CIFAR-10 reproduction report's model and CIFAR-style stems.

* ``resnet50_lambda_global32``: the model of the seed CIFAR-10 reproduction report
  (:data:`timm_lambda.paper.CIFAR10_REPORT`): the vanilla ResNet-50 with every bottleneck 3x3 convolution a
  lambda layer (``resnet50_lambda``: torchvision's 7x7 stride-2 stem and max pool, so a 32x32 image reaches
  the lambda layers at 8x8, 4x4, 2x2 and 1x1), global context (``scope='global'``, tables sized for 32x32
  inputs), one position-embedding table shared by all layers, 10 classes.
* ``resnet26_lambda_cifar``, ``resnet50_lambda_cifar``: CIFAR-style LambdaResNets (blocks 2-2-2-2 and 3-4-6-3,
  every 3x3 a lambda layer): a 3x3 stride-1 stem convolution and no stem pooling, so c2..c5 run at 32x32,
  16x16, 8x8 and 4x4 for a 32x32 image; the paper's 23x23 scope (local, any input size).

All have pretrained cfgs for 32x32 CIFAR-10 inputs (10 classes, the report's mean/std, no centre crop) and
no weights.
"""
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn

from ..paper import CIFAR10_MEAN, CIFAR10_STD, STAGE_DEPTHS
from ._pretrained import cfg
from .lambda_resnet import LambdaResNet

__all__ = ['CifarLambdaResNet']


class CifarLambdaResNet(LambdaResNet):
    """LambdaResNet with a CIFAR stem: one 3x3 stride-1 convolution (3 -> 64), BN, ReLU and no pooling.

    timm's :class:`~timm.models.resnet.ResNet` builds its stem inline (7x7 stride-2 convolution or the deep
    3x3 stem, then a stride-2 pool) and has no option for a CIFAR stem, so this constructor replaces
    ``conv1`` (keeping its name, so ``first_conv`` and checkpoints match) and ``maxpool`` (an ``Identity``)
    before returning, initialises the new convolution as timm does, and states the stage reductions (1, 1,
    2, 4, 8) in ``feature_info``. Everything downstream (``create_model``, ``features_only``, FX, TorchScript,
    checkpoints) only ever sees the CIFAR stem. Global scopes size their tables for the stage resolutions of
    this stem (``stem_reduction = 1``). ``output_stride`` (16 or 8) counts timm's nominal strides, as timm's
    ``make_blocks`` does (it assumes a stride-4 stem): 16 dilates c5, 8 dilates c4 and c5, so the real
    reductions are a quarter of the nominal ones (c5 at 4 or 2 instead of 8).

    Args: those of :class:`~timm_lambda.models.lambda_resnet.LambdaResNet`, except the stem options
    ``stem_type``, ``stem_width`` and ``replace_stem_pool`` (refused).
    """
    stem_reduction = 1

    def __init__(self, *args, in_chans: int = 3, device=None, dtype=None, **kwargs):
        for name in ('stem_type', 'stem_width', 'replace_stem_pool'):
            if name in kwargs:
                raise ValueError(f'{name} does not apply to the CIFAR stem (one 3x3 stride-1 convolution, '
                                 f'no pooling); got {name}={kwargs[name]!r}')
        super().__init__(*args, in_chans=in_chans, device=device, dtype=dtype, **kwargs)
        stem_chs = self.conv1.out_channels  # 64: timm's single-convolution stem width (any norm_layer)
        self.conv1 = nn.Conv2d(in_chans, stem_chs, kernel_size=3, stride=1, padding=1, bias=False,
                               device=device, dtype=dtype)
        nn.init.kaiming_normal_(self.conv1.weight, mode='fan_out', nonlinearity='relu')  # as ResNet.init_weights
        self.maxpool = nn.Identity()
        self.feature_info = [dict(info, reduction=1 if i == 0 else info['reduction'] // 4)
                             for i, info in enumerate(self.feature_info)]


def _cifar10(pool: int, **kwargs):
    """CIFAR-10 inputs: 32x32, no centre crop (crop_pct 1), the report's mean/std, 10 classes."""
    return cfg(32, num_classes=10, pool_size=(pool, pool), crop_pct=1.0, interpolation='bilinear', mean=CIFAR10_MEAN,
               std=CIFAR10_STD, **kwargs)


default_cfgs = generate_default_cfgs({
    # global context: tables sized for 32x32, larger inputs refused (timm passes input_size on as img_size)
    'resnet50_lambda_global32.cifar10': _cifar10(
        1, description='resnet50_lambda with global context at 32x32: the CIFAR-10 reproduction report\'s model',
        origin_url='https://github.com/joigalcar3/LambdaNetworks', fixed_input_size=True),
    'resnet26_lambda_cifar.cifar10': _cifar10(4),
    'resnet50_lambda_cifar.cifar10': _cifar10(4),
})


@register_model
def resnet50_lambda_global32(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """The CIFAR-10 reproduction report's model: vanilla ResNet-50 with every 3x3 conv a lambda layer, global
    context for 32x32 inputs (lambda layers at 8, 4, 2, 1 px; larger inputs are refused), one shared
    position-embedding table, 10 classes. 12.84M parameters (report: 12.8M, counted without its embeddings).
    ``scope=23`` (or another local scope) gives the same network with local tables, for any input size."""
    args = dict(layers=STAGE_DEPTHS[50], lambda_blocks=('all',) * 4, se_stages=(), scope='global',
                shared_embeddings=True)
    args.update(kwargs)
    if args['scope'] != 'global':  # a local scope serves any size: not a fixed-input-size model, no img_size
        args['pretrained_cfg_overlay'] = dict(args.get('pretrained_cfg_overlay') or {}, fixed_input_size=False)
    return build_model_with_cfg(LambdaResNet, 'resnet50_lambda_global32', pretrained, **args)


@register_model
def resnet26_lambda_cifar(pretrained: bool = False, **kwargs) -> CifarLambdaResNet:
    """CIFAR-style LambdaResNet-26: 3x3 stride-1 stem, no stem pooling, blocks 2-2-2-2, every 3x3 a lambda layer."""
    args = dict(layers=(2, 2, 2, 2), lambda_blocks=('all',) * 4, se_stages=())
    return build_model_with_cfg(CifarLambdaResNet, 'resnet26_lambda_cifar', pretrained, **dict(args, **kwargs))


@register_model
def resnet50_lambda_cifar(pretrained: bool = False, **kwargs) -> CifarLambdaResNet:
    """CIFAR-style ResNet-50 with every 3x3 a lambda layer: 3x3 stride-1 stem, no stem pooling (c2 at 32x32)."""
    args = dict(layers=STAGE_DEPTHS[50], lambda_blocks=('all',) * 4, se_stages=())
    return build_model_with_cfg(CifarLambdaResNet, 'resnet50_lambda_cifar', pretrained, **dict(args, **kwargs))
