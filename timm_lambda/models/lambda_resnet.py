"""LambdaResNets: ResNet-RS hybrids with lambda layers (LambdaNetworks section 5.3, appendix F.2).

Built on timm's own :class:`timm.models.resnet.ResNet` (stem, ResNet-D average-pool shortcuts, SE,
DropPath, classifier, feature extraction, ``forward_intermediates``, gradient checkpointing). The
bottlenecks listed in ``lambda_blocks`` are built as :class:`~timm_lambda.models._blocks.SpatialBottleneck`
with a :class:`~timm_lambda.layers.LambdaLayer` in place of the 3x3 convolution (3x3 average pooling with
stride 2 after the layer when the block downsamples) and no squeeze-and-excitation.

Registered here: the LambdaResNets of Table 19 (``lambdaresnet50`` .. ``lambdaresnet420``) and their -C4
variants, ResNet-RS without SE (``resnetrs*_nose``), and the vanilla ResNet-50 with every 3x3 convolution a
lambda layer (``resnet50_lambda``) with its Table 3 and Table 4 variants (``_u4``, ``_k8``, ``_shared``,
``_conv7``) and d-li14/lambda.pytorch's architecture (``resnet50_lambda_dli14``).

Choices where the paper is ambiguous (tested in tests/test_models.py, listed in README):

* Table 19 lambda positions (e.g. "6, 12, 18" in the 23 c4 blocks of LambdaResNet-101) are
  1-based block numbers within the stage: the 6th, 12th and 18th blocks.
* Squeeze-and-excitation (ratio 0.25 of the block output width, as in ResNet-RS / timm's
  ``resnetrs*``) is used in the convolutional bottlenecks of c2 and c3 only (``se_stages=(0, 1)``).
  That is the only placement that reproduces the paper's parameter counts: LambdaResNet-101
  36.9M, -152 51.4M, -101-C4 26.0M, -152-C4 35.1M. SE in every convolutional bottleneck
  (``se_stages=(0, 1, 2, 3)``, the literal reading of F.2) gives 47.4M for LambdaResNet-101.
"""
import warnings
from functools import partial
from typing import Optional, Sequence, Tuple, Union

import torch
from timm.layers import get_attn, register_notrace_function
from timm.models import (
    build_model_with_cfg,
    checkpoint_seq,
    generate_default_cfgs,
    register_model,
    resolve_pretrained_cfg,
)
from torch import nn

from ..layers import LambdaLayer, RelativePositionEmbedding
from ..layers.checks import check_scope, to_int, to_pair
from ..paper import LAMBDA_BLOCKS, RESOLUTIONS, RESOLUTIONS_C4, STAGE_DEPTHS
from ._blocks import HybridResNet, check_layers, check_stages, stage_reductions, stage_sizes
from ._pretrained import RESNETRS_PAPER, cfg

__all__ = ['LambdaResNet', 'stage_block_indices', 'checkpoint_filter_dli14', 'DLI14_MODEL',
           'DLI14_MODEL_ARGS']

StageSpec = Union[None, str, int, Sequence[int]]


def stage_block_indices(spec: StageSpec, depth: int, stage: int) -> Tuple[int, ...]:
    """0-based indices of the blocks of one stage (c2 = 0) that ``spec`` selects: None, 'all', a 1-based
    block number or a sequence of them."""
    where = f'lambda_blocks[{stage}] (stage c{stage + 2}, {depth} blocks)'
    if spec is None or spec == 'none':
        return ()
    if isinstance(spec, str):
        if spec != 'all':
            raise ValueError(f"{where} must be None, 'all' or 1-based block numbers, got {spec!r}")
        return tuple(range(depth))
    numbers = (spec,) if not isinstance(spec, (tuple, list, range, set, frozenset)) else tuple(spec)
    numbers = [to_int(i, where, 1) for i in numbers]
    bad = [i for i in numbers if i > depth]
    if bad:
        raise ValueError(f'{where} has block numbers {bad} outside 1..{depth}')
    return tuple(sorted(i - 1 for i in set(numbers)))


class LambdaResNet(HybridResNet):
    """timm ResNet whose selected bottlenecks use lambda layers (appendix F.2).

    Args:
        layers: blocks per stage (c2..c5).
        lambda_blocks: per stage, None, 'all' or 1-based block numbers that use a lambda layer.
        se_stages: stages (0 = c2 .. 3 = c5) whose convolutional bottlenecks use SE.
        se_ratio: SE squeeze ratio relative to the block output width (0.25 = "ratio of 4").
        dim_k, heads, dim_u, scope, form, key_norm, qv_norm, content, position: lambda layer
            options (see :class:`~timm_lambda.layers.LambdaLayer`; ``impl``: ``form``'s former name).
        position_bias, pool_count_include_pad: the two conventions of d-li14/lambda.pytorch (a bias on the
            position lambdas; stride-2 pooling that counts the zero padding); off by default (paper), on in
            ``resnet50_lambda_dli14`` (see :class:`~timm_lambda.layers.LambdaLayer`).
        shared_embeddings: one position-embedding table for every lambda layer (Table 4).
        img_size: input size, int or (H, W); required with ``scope='global'`` (it sizes the
            embedding tables), not accepted with a local scope (which serves any size).
        output_stride: 32 (default), 16 or 8 (timm's ResNet argument, e.g. for DeepLab): the stages that would
            pass it keep the resolution; their lambda layers take ``dilation`` (local scope on a dilated grid)
            and global tables are sized for the larger maps.
        bn_momentum, bn_eps, norm_layer, device, dtype and other timm ResNet arguments (stem_type, avg_down,
            drop_rate, drop_path_rate, ...): see :class:`~timm_lambda.models._blocks.HybridResNet`.
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
            scope: Union[int, str, Tuple[int, int]] = 23,
            form: str = 'auto',
            key_norm: str = 'softmax',
            qv_norm: bool = True,
            content: bool = True,
            position: bool = True,
            position_bias: bool = False,
            pool_count_include_pad: bool = False,
            shared_embeddings: bool = False,
            img_size: Optional[Union[int, Tuple[int, int]]] = None,
            device=None,
            dtype=None,
            **kwargs,
    ):
        if 'impl' in kwargs:
            warnings.warn("LambdaResNet's impl= is now called form= (the form of the position lambdas); impl= will "
                          'go in a later release', FutureWarning, stacklevel=2)
            form = kwargs.pop('impl')
        layers = check_layers(layers)
        if isinstance(lambda_blocks, (str, int)) or len(lambda_blocks) != 4:
            raise ValueError(f"lambda_blocks needs 4 entries (c2..c5), each None, 'all' or block numbers, "
                             f'got {lambda_blocks!r}')
        positions = [stage_block_indices(spec, d, i) for i, (spec, d) in enumerate(zip(lambda_blocks, layers))]
        se_stages = check_stages(se_stages, 'se_stages')
        scope = check_scope(scope)
        if img_size is not None:
            img_size = to_pair(img_size, 'img_size')
            if scope != 'global':
                raise ValueError(f"img_size only sizes the embedding tables of scope='global'; the local "
                                 f'{scope[0]}x{scope[1]} scope serves any input size, so leave img_size unset')
        elif scope == 'global' and any(positions):
            raise ValueError("img_size (int or (H, W)) is required with scope='global': it sizes the embedding tables")
        lambda_args = dict(dim_k=dim_k, heads=heads, dim_u=dim_u, scope=scope, form=form, key_norm=key_norm,
                           qv_norm=qv_norm, content=content, position=position, position_bias=position_bias,
                           pool_count_include_pad=pool_count_include_pad)

        # output_stride 16 / 8: the dilated stages keep their resolution (global tables sized for it); their
        # lambda layers get dilation=d from the blocks (a local scope on a dilated grid, see LambdaLayer)
        sizes = stage_sizes(img_size, type(self).stem_reduction, kwargs.get('output_stride', 32))
        shared = None
        if shared_embeddings and position and any(positions):
            first = min(i for i, p in enumerate(positions) if p)
            shared = RelativePositionEmbedding(dim_k, dim_u, scope, sizes[max(first - 1, 0)], device=device,
                                               dtype=dtype)

        def spatial_layer(stage_idx: int, block_idx: int, stride: int):
            if block_idx not in positions[stage_idx]:
                return None
            # every lambda layer of a stage is sized for the stage's input (its first block downsamples itself)
            return partial(_lambda_layer, max_size=sizes[max(stage_idx - 1, 0)], pos_embedding=shared, **lambda_args)

        se_layer = partial(get_attn('se'), rd_ratio=se_ratio)
        super().__init__(layers, spatial_layer, conv_attn=[se_layer if s in se_stages else None for s in range(4)],
                         device=device, dtype=dtype, **kwargs)
        self.lambda_positions = tuple(positions)
        # the largest input the global tables cover: each global layer's map is the input's, divided by its
        # stage's reduction and rounded up; a larger input fails in forward_features, naming its size and img_size
        self.global_img_size: Optional[Tuple[int, int]] = img_size if position and any(positions) else None
        self.max_input_size: Optional[Tuple[int, int]] = None
        if self.global_img_size is not None:
            reductions = stage_reductions(type(self).stem_reduction, kwargs.get('output_stride', 32))
            # (table's stage, seen map's stage): a stage's first block sees the previous stage's output
            layers_seen = [(max(s - 1, 0), max(s - 1, 0) if 0 in p else s) for s, p in enumerate(positions) if p]
            self.max_input_size = (min(reductions[seen] * sizes[table][0] for table, seen in layers_seen),
                                   min(reductions[seen] * sizes[table][1] for table, seen in layers_seen))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """timm's ResNet.forward_features, after checking a global-scope model's input size: the same ValueError in
        eager mode, TorchScript and torch.export; in a jit.trace, whose graph keeps tensor ops only, as the operator
        ``timm_lambda::checked_input_size`` (its message in the RuntimeError the graph raises; not in ONNX graphs);
        an FX leaf for timm's feature extraction."""
        if torch.jit.is_scripting():  # (TorchScript compiles this branch alone)
            check_input_size(x, self.max_input_size, self.global_img_size)
        elif not torch.jit.is_tracing():
            check_input_size(x, self.max_input_size, self.global_img_size)
        elif self.max_input_size is not None and not torch.onnx.is_in_onnx_export():
            x = _checked_input_size(x, self.max_input_size[0], self.max_input_size[1], str(self.global_img_size))
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.act1(x)
        x = self.maxpool(x)
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq([self.layer1, self.layer2, self.layer3, self.layer4], x, flatten=True)
        else:
            x = self.layer1(x)
            x = self.layer2(x)
            x = self.layer3(x)
            x = self.layer4(x)
        return x


def check_input_size(x: torch.Tensor, max_size: Optional[Tuple[int, int]], img_size: Optional[Tuple[int, int]]):
    """A ValueError naming the input's size and ``img_size`` when the input is larger than ``max_size`` (the largest
    a global-scope model's tables cover; None: any size)."""
    if max_size is not None and (x.shape[-2] > max_size[0] or x.shape[-1] > max_size[1]):
        raise ValueError(f'input of {x.shape[-2]}x{x.shape[-1]} px is larger than this global-scope model covers '
                         f'({max_size[0]}x{max_size[1]} px, from img_size={img_size}): create it with img_size=(H, W) '
                         f'of the largest input, e.g. timm.create_model(name, img_size=({x.shape[-2]}, '
                         f'{x.shape[-1]})), or use a local scope')


@torch.library.custom_op('timm_lambda::checked_input_size', mutates_args=())
def _checked_input_size(x: torch.Tensor, max_h: int, max_w: int, img_size: str) -> torch.Tensor:
    """:func:`check_input_size` as an operator, for jit.trace (a traced graph keeps tensor ops only; an op with no
    output would be dropped from it): ``x`` (a copy) where it fits ``(max_h, max_w)``, else the same ValueError."""
    check_input_size(x, (max_h, max_w), img_size)  # type: ignore[arg-type]  (img_size printed as the tuple was)
    return x.clone()


@_checked_input_size.register_fake
def _(x, max_h, max_w, img_size):
    return torch.empty_like(x)


register_notrace_function(check_input_size)  # an FX leaf for timm's feature extraction
torch.fx.wrap('check_input_size')  # and for torch.fx.symbolic_trace


def _lambda_layer(dim: int, dim_out: int, dilation: int = 1, **kwargs) -> LambdaLayer:
    """A block's lambda layer; a dilated block's global-scope layer takes no dilation (it sees every position;
    its table is sized for the dilated stage's resolution)."""
    if kwargs.get('scope') == 'global':
        dilation = 1
    return LambdaLayer(dim, dim_out, dilation=dilation, **kwargs)


# ResNet-RS base (appendix F.2): ResNet-D, deep stem whose max pool is a strided 3x3 conv.
_RS_ARGS = dict(stem_width=32, stem_type='deep', replace_stem_pool=True, avg_down=True)
# The vanilla ResNet-50 of Tables 3 and 4 with every 3x3 convolution a lambda layer.
_RESNET50_ALL_LAMBDA = dict(layers=STAGE_DEPTHS[50], lambda_blocks=('all',) * 4, se_stages=())


def _hybrid(depth: int, **kwargs):
    """LambdaResNet-``depth`` (Table 19): lambda layers in the listed c4 blocks and every c5 block."""
    return {**_RS_ARGS, 'layers': STAGE_DEPTHS[depth], 'lambda_blocks': (None, None, LAMBDA_BLOCKS[depth], 'all'),
            **kwargs}


def _c4(depth: int, **kwargs):
    """LambdaResNet-``depth``-C4 (E.2): every c4 and c5 bottleneck uses a lambda layer."""
    return {**_RS_ARGS, 'layers': STAGE_DEPTHS[depth], 'lambda_blocks': (None, None, 'all', 'all'), **kwargs}


def _nose(depth: int, **kwargs):
    """ResNet-RS-``depth`` without squeeze-and-excitation ("ResNet-RS wo/ SE", Fig. 4, Table 13)."""
    return {**_RS_ARGS, 'layers': STAGE_DEPTHS[depth], 'lambda_blocks': (None,) * 4, 'se_stages': (), **kwargs}


def _resnet50_lambda(kwargs: dict, **variant):
    """resnet50_lambda's arguments (Table 3 "Lambda layer"), then a variant's, then the caller's ``kwargs``."""
    return {**_RESNET50_ALL_LAMBDA, **variant, **kwargs}


# d-li14/lambda.pytorch: the one public ImageNet-trained paper-faithful lambda network (LambdaResNet-50,
# "78.208 / 93.820" top-1 / top-5, 14.995M parameters; README of the repository at commit 646de55). Its
# architecture, resnet50_lambda_dli14, is resnet50_lambda with two conventions: a bias on the lambda
# convolution (position_bias) and a stride-2 average pooling that counts the zero padding. The checkpoint is
# hosted outside GitHub (a OneDrive link on the project page): no URL here, the download is manual.
DLI14_MODEL = 'resnet50_lambda_dli14.in1k'
DLI14_MODEL_ARGS = dict(position_bias=True, pool_count_include_pad=True)
DLI14_PAGE = 'https://github.com/d-li14/lambda.pytorch'
# Before the architecture had its own name, a tag of resnet50_lambda switched it on; still accepted, deprecated.
_DEPRECATED_DLI14_TAG = 'dli14_in1k'


def _dli14_cfg(*notes: str):
    return cfg(
        224, interpolation='bilinear', origin_url=DLI14_PAGE,
        # d-li14/lambda.pytorch states no license (no LICENSE file, none in its README at 646de55): unknown.
        license='unknown',
        description='LambdaResNet-50 trained on ImageNet-1k by Duo Li (d-li14/lambda.pytorch)',
        notes=('Their README: 78.208 top-1 / 93.820 top-5 on ImageNet val, 14.995M parameters, 6.576 GFLOPs; '
               'SGD lr 0.1, momentum 0.9, weight decay 1e-4, 130 epochs, cosine, batch 256, label smoothing 0.1.',
               'Weights hosted outside GitHub (link on the project page): download manually and create the '
               "model with pretrained=True, pretrained_cfg_overlay=dict(file=PATH); checkpoint_filter_dli14 "
               'converts the keys.',
               'Their evaluation transform is not stated: standard ImageNet eval assumed (bilinear resize to '
               '256, centre crop 224, ImageNet mean/std).',
               'The repository states no license.', *notes),
    )


def checkpoint_filter_dli14(state_dict: dict, model: Optional[nn.Module] = None) -> dict:
    """A d-li14/lambda.pytorch LambdaResNet checkpoint in timm_lambda's keys (timm ``pretrained_filter_fn``).

    Accepts the bare ``state_dict``, or a training checkpoint holding it under ``'state_dict'`` or
    ``'model'``, with or without ``DataParallel``/DDP's ``module.`` prefix. Their lambda layer's
    ``conv_qkv.weight`` is our ``qkv.weight`` (same channel order: queries, keys, values),
    ``lambda_conv.weight [k, u, 1, r, r]`` is our relative embedding table ``pos_embedding.weight
    [k, u, r, r]`` (a Conv3d is a cross-correlation: it weighs the value at m - n + centre, our
    ``e_nm = R[m - n]``) and ``lambda_conv.bias [k]`` is ``pos_bias``. Everything else (torchvision ResNet
    names) is unchanged. A checkpoint already in our keys passes through.

    With ``model`` given, a d-li14 checkpoint is refused (ValueError) unless the model was built with both of
    their conventions (``position_bias=True``, ``pool_count_include_pad=True``, as ``resnet50_lambda_dli14``
    is): the weights would load but the outputs would differ.
    """
    for key in ('state_dict', 'model'):
        if isinstance(state_dict.get(key), dict):
            state_dict = state_dict[key]
            break
    out, theirs = {}, False
    for name, value in state_dict.items():
        if name.startswith('module.'):
            name = name[len('module.'):]
        if name.endswith('.conv_qkv.weight'):
            name, theirs = name[:-len('conv_qkv.weight')] + 'qkv.weight', True
        elif name.endswith('.lambda_conv.weight'):
            if value.dim() != 5 or value.shape[2] != 1:
                raise ValueError(f'{name}: expected a Conv3d kernel [k, u, 1, r, r], got {tuple(value.shape)}')
            name, value, theirs = name[:-len('lambda_conv.weight')] + 'pos_embedding.weight', value[:, :, 0], True
        elif name.endswith('.lambda_conv.bias'):
            name, theirs = name[:-len('lambda_conv.bias')] + 'pos_bias', True
        out[name] = value
    if theirs and model is not None:
        layers = [m for m in model.modules() if isinstance(m, LambdaLayer)]
        wrong = [m for m in layers if m.pos_bias is None or (m.stride == 2 and not m.pool_count_include_pad)]
        if wrong:
            raise ValueError(
                'this is a d-li14/lambda.pytorch checkpoint: its lambda layers have a position bias and count the '
                f"padding in their stride-2 pooling. Create '{DLI14_MODEL}' (formerly 'resnet50_lambda."
                f"{_DEPRECATED_DLI14_TAG}'), or pass position_bias=True, pool_count_include_pad=True, to load it")
    return out


_R224 = cfg(224, interpolation='bilinear')  # the vanilla ResNet-50 frame of Tables 3 and 4 (F.3, 90 epochs)

default_cfgs = generate_default_cfgs({
    **{f'lambdaresnet{d}.r{r}': cfg(r, first_conv='conv1.0') for d, rs in RESOLUTIONS.items() for r in rs},
    **{f'lambdaresnet{d}_c4.r{r}': cfg(r, first_conv='conv1.0') for d, rs in RESOLUTIONS_C4.items() for r in rs},
    **{f'resnetrs{d}_nose.r{r}': cfg(r, first_conv='conv1.0', **RESNETRS_PAPER)
       for d, rs in RESOLUTIONS.items() for r in rs},
    'resnet50_lambda.r224': _R224,
    f'resnet50_lambda.{_DEPRECATED_DLI14_TAG}': _dli14_cfg(f'Deprecated tag: create {DLI14_MODEL} instead.'),
    DLI14_MODEL: _dli14_cfg(),
    'resnet50_lambda_u4.r224': _R224,
    'resnet50_lambda_k8.r224': _R224,
    'resnet50_lambda_shared.r224': _R224,
    'resnet50_lambda_conv7.r224': _R224,
})


def _pretrained_tag(kwargs) -> Optional[str]:
    """The pretrained tag create_model passes on (``'name.tag'`` arrives as ``pretrained_cfg='tag'``)."""
    pretrained_cfg = kwargs.get('pretrained_cfg')
    if isinstance(pretrained_cfg, str):
        return pretrained_cfg
    if isinstance(pretrained_cfg, dict):
        return pretrained_cfg.get('tag')
    return getattr(pretrained_cfg, 'tag', None)


def _create_dli14(variant: str, pretrained: bool, **kwargs) -> LambdaResNet:
    if pretrained:  # their weights are not downloadable: say where they are instead of timm's generic error
        weights = resolve_pretrained_cfg(variant, kwargs.get('pretrained_cfg'), kwargs.get('pretrained_cfg_overlay'))
        if not (weights.has_weights or weights.state_dict is not None):
            raise RuntimeError(f'No pretrained weights exist for {DLI14_MODEL} in timm: download the checkpoint by '
                               f'hand from {DLI14_PAGE} and pass pretrained_cfg_overlay=dict(file=PATH)')
    return build_model_with_cfg(LambdaResNet, variant, pretrained,
                                pretrained_filter_fn=_then(kwargs.pop('pretrained_filter_fn', None)),
                                **_resnet50_lambda(kwargs, **DLI14_MODEL_ARGS))


def _then(caller_filter):
    """checkpoint_filter_dli14, then the caller's own ``pretrained_filter_fn`` (the mmdet backbone's key checks)
    on the converted keys."""
    if caller_filter is None:
        return checkpoint_filter_dli14
    return lambda state_dict, model: caller_filter(checkpoint_filter_dli14(state_dict, model), model)


@register_model
def lambdaresnet50(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaResNet-50 (Table 19): ResNet-RS-50 with lambda layers in c4 block 3 and every c5 block."""
    return build_model_with_cfg(LambdaResNet, 'lambdaresnet50', pretrained, **_hybrid(50, **kwargs))


@register_model
def lambdaresnet101(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaResNet-101 (Table 19): lambda layers in c4 blocks 6, 12, 18 and every c5 block; 36.9M (Table 13)."""
    return build_model_with_cfg(LambdaResNet, 'lambdaresnet101', pretrained, **_hybrid(101, **kwargs))


@register_model
def lambdaresnet152(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaResNet-152 (Table 19): lambda layers in c4 blocks 5, 10, .., 30 and every c5 block; 51.4M (Table 13)."""
    return build_model_with_cfg(LambdaResNet, 'lambdaresnet152', pretrained, **_hybrid(152, **kwargs))


@register_model
def lambdaresnet200(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaResNet-200 (Table 19): lambda layers in c4 blocks 5, 10, .., 30 and every c5 block."""
    return build_model_with_cfg(LambdaResNet, 'lambdaresnet200', pretrained, **_hybrid(200, **kwargs))


@register_model
def lambdaresnet270(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaResNet-270 (Table 19): lambda layers in c4 blocks 8, 16, .., 48 and every c5 block."""
    return build_model_with_cfg(LambdaResNet, 'lambdaresnet270', pretrained, **_hybrid(270, **kwargs))


@register_model
def lambdaresnet350(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaResNet-350 (Table 19): lambda layers in c4 blocks 10, 20, .., 60 and every c5 block."""
    return build_model_with_cfg(LambdaResNet, 'lambdaresnet350', pretrained, **_hybrid(350, **kwargs))


@register_model
def lambdaresnet420(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaResNet-420 (Table 19): lambda layers in c4 blocks 10, 20, .., 80 and every c5 block."""
    return build_model_with_cfg(LambdaResNet, 'lambdaresnet420', pretrained, **_hybrid(420, **kwargs))


@register_model
def lambdaresnet50_c4(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaResNet-50-C4 (E.2): every c4 and c5 3x3 convolution is a lambda layer."""
    return build_model_with_cfg(LambdaResNet, 'lambdaresnet50_c4', pretrained, **_c4(50, **kwargs))


@register_model
def lambdaresnet101_c4(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaResNet-101-C4 (E.2): every c4 and c5 3x3 convolution is a lambda layer; 26.0M (Table 13)."""
    return build_model_with_cfg(LambdaResNet, 'lambdaresnet101_c4', pretrained, **_c4(101, **kwargs))


@register_model
def lambdaresnet152_c4(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaResNet-152-C4 (E.2): every c4 and c5 3x3 convolution is a lambda layer; 35.1M (Tables 13, 15)."""
    return build_model_with_cfg(LambdaResNet, 'lambdaresnet152_c4', pretrained, **_c4(152, **kwargs))


@register_model
def lambdaresnet200_c4(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaResNet-200-C4 (E.2): every c4 and c5 3x3 convolution is a lambda layer; 42M (Table 15)."""
    return build_model_with_cfg(LambdaResNet, 'lambdaresnet200_c4', pretrained, **_c4(200, **kwargs))


@register_model
def lambdaresnet270_c4(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaResNet-270-C4 (E.2): every c4 and c5 3x3 convolution is a lambda layer."""
    return build_model_with_cfg(LambdaResNet, 'lambdaresnet270_c4', pretrained, **_c4(270, **kwargs))


@register_model
def lambdaresnet350_c4(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaResNet-350-C4 (E.2): every c4 and c5 3x3 convolution is a lambda layer."""
    return build_model_with_cfg(LambdaResNet, 'lambdaresnet350_c4', pretrained, **_c4(350, **kwargs))


@register_model
def lambdaresnet420_c4(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaResNet-420-C4 (E.2): every c4 and c5 3x3 convolution is a lambda layer."""
    return build_model_with_cfg(LambdaResNet, 'lambdaresnet420_c4', pretrained, **_c4(420, **kwargs))


@register_model
def resnetrs50_nose(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """ResNet-RS-50 without squeeze-and-excitation (Fig. 4 baseline)."""
    return build_model_with_cfg(LambdaResNet, 'resnetrs50_nose', pretrained, **_nose(50, **kwargs))


@register_model
def resnetrs101_nose(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """ResNet-RS-101 without squeeze-and-excitation; 44.6M (Table 13)."""
    return build_model_with_cfg(LambdaResNet, 'resnetrs101_nose', pretrained, **_nose(101, **kwargs))


@register_model
def resnetrs152_nose(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """ResNet-RS-152 without squeeze-and-excitation; 60.2M (Table 13)."""
    return build_model_with_cfg(LambdaResNet, 'resnetrs152_nose', pretrained, **_nose(152, **kwargs))


@register_model
def resnetrs200_nose(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """ResNet-RS-200 without squeeze-and-excitation (Fig. 4 baseline)."""
    return build_model_with_cfg(LambdaResNet, 'resnetrs200_nose', pretrained, **_nose(200, **kwargs))


@register_model
def resnetrs270_nose(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """ResNet-RS-270 without squeeze-and-excitation (Fig. 4 baseline)."""
    return build_model_with_cfg(LambdaResNet, 'resnetrs270_nose', pretrained, **_nose(270, **kwargs))


@register_model
def resnetrs350_nose(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """ResNet-RS-350 without squeeze-and-excitation (Fig. 4 baseline)."""
    return build_model_with_cfg(LambdaResNet, 'resnetrs350_nose', pretrained, **_nose(350, **kwargs))


@register_model
def resnetrs420_nose(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """ResNet-RS-420 without squeeze-and-excitation (Fig. 4 baseline)."""
    return build_model_with_cfg(LambdaResNet, 'resnetrs420_nose', pretrained, **_nose(420, **kwargs))


@register_model
def resnet50_lambda(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """Vanilla ResNet-50 with every 3x3 convolution replaced by a lambda layer (Table 3 "Lambda layer", 15.0M).

    The deprecated tag ``resnet50_lambda.dli14_in1k`` builds :func:`resnet50_lambda_dli14` (with a
    DeprecationWarning), keeping its pretrained cfg.
    """
    if _pretrained_tag(kwargs) == _DEPRECATED_DLI14_TAG:
        warnings.warn(f"'resnet50_lambda.{_DEPRECATED_DLI14_TAG}' is deprecated: the architecture of "
                      f"d-li14/lambda.pytorch's weights has its own name, create '{DLI14_MODEL}' instead",
                      DeprecationWarning, stacklevel=3)  # the caller of timm.create_model
        return _create_dli14('resnet50_lambda', pretrained, **kwargs)
    return build_model_with_cfg(LambdaResNet, 'resnet50_lambda', pretrained,
                                pretrained_filter_fn=_then(kwargs.pop('pretrained_filter_fn', None)),
                                **_resnet50_lambda(kwargs))


@register_model
def resnet50_lambda_dli14(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """resnet50_lambda with d-li14/lambda.pytorch's two conventions (``position_bias``,
    ``pool_count_include_pad``): the architecture of their ImageNet LambdaResNet-50. Load their checkpoint with
    ``timm.create_model('resnet50_lambda_dli14.in1k', pretrained=True, pretrained_cfg_overlay=dict(file=PATH))``
    (keys converted by :func:`checkpoint_filter_dli14`)."""
    return _create_dli14('resnet50_lambda_dli14', pretrained, **kwargs)


@register_model
def resnet50_lambda_u4(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """Table 3 'Lambda layer (|u|=4)': as resnet50_lambda with |u|=4 and a 7x7 scope (F.2), 16.0M."""
    return build_model_with_cfg(LambdaResNet, 'resnet50_lambda_u4', pretrained,
                                **_resnet50_lambda(kwargs, dim_u=4, scope=7))


@register_model
def resnet50_lambda_k8(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaNetworks Table 4 "Lambda layer (|k|=8)": resnet50_lambda with query/key depth 8."""
    return build_model_with_cfg(LambdaResNet, 'resnet50_lambda_k8', pretrained, **_resnet50_lambda(kwargs, dim_k=8))


@register_model
def resnet50_lambda_shared(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaNetworks Table 4 "Lambda layer (shared embeddings)": resnet50_lambda with one position-embedding
    table for every lambda layer."""
    return build_model_with_cfg(LambdaResNet, 'resnet50_lambda_shared', pretrained,
                                **_resnet50_lambda(kwargs, shared_embeddings=True))


@register_model
def resnet50_lambda_conv7(pretrained: bool = False, **kwargs) -> LambdaResNet:
    """LambdaNetworks Table 4 "Lambda convolution (7x7)": resnet50_lambda with a 7x7 scope computed by the
    lambda convolution (``form='conv'``; ``form='auto'`` gives the same result faster on CPU)."""
    return build_model_with_cfg(LambdaResNet, 'resnet50_lambda_conv7', pretrained,
                                **_resnet50_lambda(kwargs, scope=7, form='conv'))
