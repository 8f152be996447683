"""MMDetection backbone: a timm LambdaResNet (or ResNet-RS) returning c2..c5 for an FPN."""
import traceback
from typing import Optional, Sequence

import timm
import torch
import torch.nn as nn
from mmcv.cnn import build_norm_layer
from mmdet.registry import MODELS
from mmengine.logging import MMLogger
from mmengine.model import BaseModule
from timm.models import load_state_dict
from timm.models._hub import download_cached_file
from torch.nn.modules.batchnorm import _BatchNorm

import timm_lambda  # noqa: F401  (registers the LambdaResNet / ResNet-RS-without-SE models with timm)

from .checkpoint_compat import check_checkpoint_file

__all__ = ['TimmLambdaResNet', 'norm_layer_from_cfg']

# Stride of the deepest feature map (c5); inputs must be padded to it.
_OUTPUT_STRIDE = 32


def norm_layer_from_cfg(norm_cfg: dict):
    """A timm ``norm_layer`` that builds mmcv's ``norm_cfg`` (BN, SyncBN, MMSyncBN, GN, ... and
    ``requires_grad``): ``norm_layer(num_features, momentum=..., eps=..., device=..., dtype=...)``.

    timm models call it for every norm they build (the lambda layers' query/value norms too), so the
    backbone has mmdet's norms from construction on. ``momentum``/``eps`` a model binds (its
    ``bn_momentum``/``bn_eps``) apply unless ``norm_cfg`` sets them.
    """
    if not isinstance(norm_cfg, dict) or 'type' not in norm_cfg:
        raise ValueError(f"norm_cfg must be a dict with a 'type' (e.g. dict(type='SyncBN')), got {norm_cfg!r}")

    def norm_layer(num_features: int, momentum: Optional[float] = None, eps: Optional[float] = None,
                   device=None, dtype=None) -> nn.Module:
        cfg = dict(norm_cfg)
        if cfg['type'] != 'GN':
            if momentum is not None:
                cfg.setdefault('momentum', momentum)
            if eps is not None:
                cfg.setdefault('eps', eps)
        elif eps is not None:
            cfg.setdefault('eps', eps)
        # built where timm asks (e.g. the meta device), not on the CPU and moved; mmcv passes the rest of
        # the cfg to the layer class (torch's norms take device/dtype; mmcv's MMSyncBN takes neither)
        cfg.update({k: v for k, v in dict(device=device, dtype=dtype).items() if v is not None})
        return build_norm_layer(cfg, num_features)[1]

    return norm_layer


@MODELS.register_module()
class TimmLambdaResNet(BaseModule):
    """LambdaResNet / ResNet-RS backbone for MMDetection, built by timm.

    Any model registered in timm that supports ``features_only`` and a ``norm_layer`` argument works; the
    intended ones are the LambdaResNets (``lambdaresnet101``, ..., ``lambdaresnet152_c4``) and the ResNet-RS
    baselines of the paper's Table 14: ``resnetrs101``/``resnetrs152`` (timm, with squeeze-excitation) and
    ``resnetrs101_nose``/``resnetrs152_nose`` (timm_lambda, without SE).

    Args:
        model_name (str): timm model name.
        out_indices (Sequence[int]): Which of c2, c3, c4, c5 (strides 4, 8, 16, 32) to return, with mmdet's
            ResNet numbering: 0 -> c2, ..., 3 -> c5. Default: (0, 1, 2, 3).
        frozen_stages (int): mmdet's ResNet meaning: -1 freezes nothing, 0 freezes the stem, k >= 1 the stem
            and the first k stages (parameters stop requiring grad, norm layers stay in eval mode).
        norm_cfg (dict, optional): mmcv norm config used for every norm the timm model builds (stem, blocks
            and the lambda layers' query/value norms): ``dict(type='BN'|'SyncBN'|'MMSyncBN'|'GN', ...)``;
            ``requires_grad=False`` freezes the affine parameters. ``None`` keeps timm's BatchNorm2d.
        norm_eval (bool): Keep norm layers in eval mode (frozen running statistics) while training.
        with_cp (bool): Gradient checkpointing through timm's ``set_grad_checkpointing``.
        size_divisor (int, optional): Input height and width must be divisible by this (the c5 stride, 32)
            so that c2..c5 line up with the image; mmdet pads to it with the data preprocessor's
            ``pad_size_divisor=32``. ``None`` disables the check.
        model_kwargs (dict, optional): Extra ``timm.create_model`` kwargs (e.g. ``drop_path_rate``).
        init_cfg (dict, optional): ``dict(type='Pretrained', checkpoint=PATH_OR_URL)`` builds the model from a
            timm ImageNet checkpoint: ``timm.create_model(..., pretrained=True,
            pretrained_cfg_overlay=dict(file=PATH))`` reads it (``.pth``/``.safetensors``, ``state_dict``/``model``
            wrappers, ``module.`` prefixes, the EMA weights when the file has them; ``use_ema=False`` takes the
            raw ones), drops the classifier and loads the rest before ``features_only`` wraps the model; every
            other key must match (an error names the file and the mismatches). The weights load at
            construction, as in mmpretrain's ``TIMMBackbone`` (so mmdet's ``test.py`` reads the file too, then
            loads the detector checkpoint over it). ``prefix='backbone.'`` loads the backbone of a detector
            checkpoint. ``None``, or ``checkpoint=None`` (the configs' default, so that a child config or
            ``--cfg-options model.backbone.init_cfg.checkpoint=PATH`` can fill it in): train from scratch.
    """

    def __init__(self,
                 model_name: str,
                 out_indices: Sequence[int] = (0, 1, 2, 3),
                 frozen_stages: int = -1,
                 norm_cfg: Optional[dict] = dict(type='BN', requires_grad=True),
                 norm_eval: bool = False,
                 with_cp: bool = False,
                 size_divisor: Optional[int] = _OUTPUT_STRIDE,
                 model_kwargs: Optional[dict] = None,
                 init_cfg: Optional[dict] = None):
        if isinstance(init_cfg, str):
            raise ValueError(f'init_cfg={init_cfg!r} is a string; the checkpoint goes in init_cfg.checkpoint: '
                             "init_cfg=dict(type='Pretrained', checkpoint=PATH) in a config, or "
                             '--cfg-options model.backbone.init_cfg.checkpoint=PATH')
        if init_cfg is not None:
            if not isinstance(init_cfg, dict) or init_cfg.get('type') != 'Pretrained' or 'checkpoint' not in init_cfg:
                raise ValueError("init_cfg must be None (train from scratch) or dict(type='Pretrained', "
                                 f'checkpoint=PATH or None), got {init_cfg!r}')
            unknown = set(init_cfg) - {'type', 'checkpoint', 'prefix', 'use_ema'}
            if unknown:
                raise ValueError(f'init_cfg has unknown keys {sorted(unknown)}; accepted: checkpoint, prefix, use_ema')
            checkpoint = init_cfg['checkpoint']
            if checkpoint is not None and (not isinstance(checkpoint, str) or not checkpoint):
                raise ValueError('init_cfg.checkpoint must be a file path or URL (or None: train from scratch), '
                                 f'got {checkpoint!r}')
        super().__init__(init_cfg=init_cfg)
        if not isinstance(model_name, str) or not timm.is_model(model_name):
            raise ValueError(f'model_name={model_name!r} is not a timm model; available LambdaResNets: '
                             f"{timm.list_models('lambdaresnet*')}, ResNet-RS: {timm.list_models('resnetrs*')}")
        out_indices = tuple(out_indices)
        if not out_indices or any(i not in (0, 1, 2, 3) for i in out_indices) \
                or tuple(sorted(set(out_indices))) != out_indices:
            raise ValueError('out_indices must be increasing values from (0, 1, 2, 3) '
                             f'(0=c2/stride 4 ... 3=c5/stride 32), got {out_indices}')
        if not -1 <= frozen_stages <= 4:
            raise ValueError(f'frozen_stages must be in [-1, 4], got {frozen_stages}')
        if size_divisor is not None and size_divisor < 1:
            raise ValueError(f'size_divisor must be None or >= 1, got {size_divisor}')
        self.model_name = model_name
        self.out_indices = out_indices
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.with_cp = with_cp
        self.size_divisor = size_divisor

        model_kwargs = dict(model_kwargs or {})
        if norm_cfg is not None:
            if 'norm_layer' in model_kwargs:
                raise ValueError('give norm_cfg or model_kwargs.norm_layer, not both')
            model_kwargs['norm_layer'] = norm_layer_from_cfg(norm_cfg)
        checkpoint = init_cfg['checkpoint'] if init_cfg is not None else None
        if checkpoint is not None:  # timm loads it into the classification model, before features_only wraps it
            local = download_cached_file(checkpoint) if '://' in checkpoint else checkpoint
            check_checkpoint_file(local, 'init_cfg.checkpoint')  # missing, empty or truncated: an error naming it
            check = _pretrained_filter(checkpoint, local, model_name, init_cfg.get('prefix'),
                                       init_cfg.get('use_ema', True))
            model_kwargs.update(pretrained=True, pretrained_cfg_overlay=dict(file=local), pretrained_filter_fn=check)
        try:
            # timm feature index i+1 is c(i+2): index 0 is the stride-2 stem.
            self.body = timm.create_model(model_name, features_only=True,
                                          out_indices=tuple(i + 1 for i in out_indices), **model_kwargs)
        except Exception as e:  # a truncated pickle fails anywhere (EOFError, IndexError, ...): name the file
            # timm reads the file inside create_model: only what its load_state_dict raised is about the file
            if not any(f.f_code is load_state_dict.__code__ for f, _ in traceback.walk_tb(e.__traceback__)):
                raise
            kind = 'safetensors' if type(e).__name__ == 'SafetensorError' else 'a checkpoint'
            raise ValueError(f'init_cfg.checkpoint {checkpoint}: cannot read the file as {kind} '
                             f'({type(e).__name__}: {e})') from e
        reductions = self.body.feature_info.reduction()
        expected = [4 * 2 ** i for i in out_indices]
        if list(reductions) != expected:
            raise ValueError(f'{model_name} features have strides {reductions}, expected {expected} for '
                             f'out_indices={out_indices}')
        self.out_channels = tuple(self.body.feature_info.channels())
        # Module names (keys of the timm FeatureListNet) that end each stage, for frozen_stages. Names are
        # resolved at use time (never cached module references): mmengine's revert_sync_batchnorm replaces
        # modules after construction.
        self._stage_end_names = [info['module'].replace('.', '_') for info in self.body.feature_info.info[0:5]]
        if with_cp:
            self.body.set_grad_checkpointing(True)
        self._freeze_stages()

    def _freeze_stages(self):
        """Freezes the stem and the first ``frozen_stages`` stages: the FeatureListNet's top-level modules up to the
        one that ends stage ``frozen_stages`` (e.g. ``act1`` ends the stem; the max-pool falls into c2)."""
        if self.frozen_stages < 0:
            return
        for name, module in self.body.items():
            module.eval()
            module.requires_grad_(False)
            if name == self._stage_end_names[self.frozen_stages]:
                break

    def train(self, mode: bool = True):
        super().train(mode)
        self._freeze_stages()
        if mode and self.norm_eval:
            for m in self.modules():
                if isinstance(m, (_BatchNorm, nn.GroupNorm)):
                    m.eval()
        return self

    def forward(self, x: torch.Tensor):
        if self.size_divisor and (x.shape[-1] % self.size_divisor or x.shape[-2] % self.size_divisor):
            raise ValueError(
                f'{type(self).__name__}: input size {tuple(x.shape[-2:])} is not divisible by size_divisor='
                f'{self.size_divisor}; pad the images (mmdet: model.data_preprocessor.pad_size_divisor=32) '
                'or set the backbone size_divisor=None')
        return tuple(self.body(x))

    def init_weights(self):
        """Nothing left to do: timm initialised the weights when it built the model, from ``init_cfg.checkpoint``
        when one is given (as mmpretrain's ``TIMMBackbone`` does)."""
        self._is_init = True


def _pretrained_filter(path: str, local: str, model_name: str, prefix: Optional[str], use_ema: bool):
    """timm's ``pretrained_filter_fn(state_dict, model)`` for ``init_cfg``, doing what timm's ``file`` route does not:
    the raw weights for ``use_ema=False`` (timm takes the EMA ones when present), a detector's backbone for
    ``prefix='backbone.'``, and a check of every non-classifier key (timm loads non-strictly once it has dropped
    the classifier), with errors naming the file."""
    def filter_fn(state_dict: dict, model: nn.Module) -> dict:
        if not use_ema:
            state_dict = load_state_dict(local, use_ema=False)
        if prefix:  # a detector checkpoint: backbone.body.<timm key>
            state_dict = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
            if not state_dict:
                raise ValueError(f'init_cfg.checkpoint {path}: no key starts with prefix={prefix!r}')
            state_dict = {k[len('body.'):] if k.startswith('body.') else k: v for k, v in state_dict.items()}
        classifier = model.pretrained_cfg.get('classifier') or ()
        head = tuple(f'{c}.' for c in ((classifier,) if isinstance(classifier, str) else classifier))
        target = {k: v for k, v in model.state_dict().items() if not k.startswith(head)}
        loaded = {k: v for k, v in state_dict.items() if not k.startswith(head)}
        missing, unexpected = sorted(set(target) - set(loaded)), sorted(set(loaded) - set(target))
        if missing or unexpected:
            raise ValueError(
                f'init_cfg.checkpoint {path} does not match {model_name}: {len(missing)} missing keys '
                f'{missing[:8]}{" ..." if len(missing) > 8 else ""}, {len(unexpected)} unexpected keys '
                f'{unexpected[:8]}{" ..." if len(unexpected) > 8 else ""}; is it a checkpoint of this model_name '
                '(and, for a detector checkpoint, is prefix set)?')
        bad_shapes = [k for k, v in loaded.items() if tuple(v.shape) != tuple(target[k].shape)]
        if bad_shapes:
            raise ValueError(f'init_cfg.checkpoint {path}: shapes of {bad_shapes[:8]} differ from {model_name}; '
                             'is it a checkpoint of this model_name?')
        MMLogger.get_current_instance().info(
            f'Loaded {len(loaded)} tensors of {model_name} from {path} '
            f'({"EMA weights where present" if use_ema else "raw weights"})')
        return state_dict

    return filter_fn
