"""MMDetection backbone wrapping timm LambdaResNets and ResNet-RS baselines."""
import os.path as osp
from collections import OrderedDict
from typing import Optional, Sequence

import timm
import torch
import torch.nn as nn
from mmcv.cnn import build_norm_layer
from mmengine.logging import MMLogger
from mmengine.model import BaseModule
from mmengine.runner.checkpoint import CheckpointLoader
from torch.nn.modules.batchnorm import _BatchNorm

from mmdet.registry import MODELS

# Stride of the deepest feature map (c5); inputs must be padded to it.
_OUTPUT_STRIDE = 32


def _import_model_registry():
    """Make sure the timm_lambda models are registered in timm."""
    try:
        import timm_lambda  # noqa: F401  (registers lambdaresnet*, *_nose)
    except ImportError as e:  # pragma: no cover - timm_lambda is this repo
        raise ImportError(
            'mmdet_plugin needs the timm_lambda package (this repository); '
            f'import failed: {e}') from e


def _replace_norms(root: nn.Module, norm_cfg: dict) -> int:
    """Replace every BatchNorm2d inside ``root`` by a layer built from
    ``norm_cfg`` (mmcv ``build_norm_layer``: BN, SyncBN, MMSyncBN, GN, ...).

    Affine parameters are copied, running statistics too when the new layer
    keeps them, and eps/momentum are inherited from the timm layer unless
    ``norm_cfg`` sets them. This covers the lambda layers' own query/value
    BatchNorms as well as the ResNet stem/blocks. Returns the number of
    replaced layers.
    """
    try:
        from timm.layers import BatchNormAct2d
    except ImportError:  # pragma: no cover
        BatchNormAct2d = ()
    norm_type = norm_cfg.get('type')
    count = 0
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.BatchNorm2d):
                continue
            if BatchNormAct2d and isinstance(child, BatchNormAct2d):
                if norm_type in ('BN', 'BN2d'):
                    for p in child.parameters():
                        p.requires_grad = norm_cfg.get('requires_grad', True)
                    continue
                if norm_type == 'SyncBN':
                    from timm.layers import convert_sync_batchnorm
                    setattr(parent, name, convert_sync_batchnorm(child))
                    count += 1
                    continue
                raise ValueError(
                    f'norm_cfg type={norm_type!r} cannot replace the fused '
                    f'norm+activation layer {type(child).__name__} ({name}); '
                    "use norm_cfg type 'BN' or 'SyncBN' for this model")
            cfg = dict(norm_cfg)
            cfg.setdefault('eps', child.eps)
            if norm_type != 'GN' and child.momentum is not None:
                cfg.setdefault('momentum', child.momentum)
            _, new = build_norm_layer(cfg, child.num_features)
            with torch.no_grad():
                if child.affine and getattr(new, 'weight', None) is not None:
                    new.weight.copy_(child.weight)
                    new.bias.copy_(child.bias)
                if (child.track_running_stats
                        and getattr(new, 'running_mean', None) is not None):
                    new.running_mean.copy_(child.running_mean)
                    new.running_var.copy_(child.running_var)
                    new.num_batches_tracked.copy_(child.num_batches_tracked)
            new.train(child.training)
            setattr(parent, name, new)
            count += 1
    return count


@MODELS.register_module()
class TimmLambdaResNet(BaseModule):
    """LambdaResNet / ResNet-RS backbone for MMDetection, built by timm.

    Any model registered in timm that supports ``features_only`` works; the
    intended ones are the LambdaResNets (``lambdaresnet101``, ...,
    ``lambdaresnet152_c4``) and the ResNet-RS baselines of the paper's
    Table 14: ``resnetrs101``/``resnetrs152`` (timm, with squeeze-excitation)
    and ``resnetrs101_nose``/``resnetrs152_nose`` (timm_lambda, without SE).

    Args:
        model_name (str): timm model name.
        out_indices (Sequence[int]): Which of c2, c3, c4, c5 (strides 4, 8,
            16, 32) to return, with mmdet's ResNet numbering: 0 -> c2, ...,
            3 -> c5. Default: (0, 1, 2, 3).
        frozen_stages (int): mmdet's ResNet meaning: -1 freezes nothing,
            0 freezes the stem, k >= 1 the stem and the first k stages
            (parameters stop requiring grad, norm layers stay in eval mode).
        norm_cfg (dict, optional): Normalisation for every BatchNorm2d of the
            timm model (stem, blocks and the lambda layers' query/value
            norms): ``dict(type='BN'|'SyncBN'|'MMSyncBN'|'GN', ...)``.
            ``requires_grad=False`` freezes the affine parameters. ``None``
            keeps timm's BatchNorm2d.
        norm_eval (bool): Keep BatchNorm layers in eval mode (frozen running
            statistics) while training.
        with_cp (bool): Gradient checkpointing through timm's
            ``set_grad_checkpointing`` (trades compute for memory).
        size_divisor (int, optional): Input height and width must be
            divisible by this (the c5 stride, 32) so that c2..c5 line up
            with the image; mmdet pads to it with the data preprocessor's
            ``pad_size_divisor=32``. ``None`` disables the check.
        model_kwargs (dict, optional): Extra ``timm.create_model`` kwargs
            (e.g. ``drop_path_rate``).
        init_cfg (dict, optional): ``dict(type='Pretrained', checkpoint=PATH)``
            loads a timm ImageNet checkpoint (a plain state_dict or one
            under 'state_dict'/'model'; ``.pth``/``.bin``/``.safetensors``);
            the classifier is dropped. ``prefix='backbone.'`` loads the
            backbone of a detector checkpoint. ``None``: train from scratch.
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
        if init_cfg is not None:
            if not isinstance(init_cfg, dict) or init_cfg.get(
                    'type') != 'Pretrained' or 'checkpoint' not in init_cfg:
                raise ValueError(
                    'init_cfg must be None (train from scratch) or '
                    "dict(type='Pretrained', checkpoint=PATH), got "
                    f'{init_cfg!r}')
        super().__init__(init_cfg=init_cfg)
        _import_model_registry()
        if not isinstance(model_name, str) or not timm.is_model(model_name):
            raise ValueError(
                f'model_name={model_name!r} is not a timm model; available '
                f"LambdaResNets: {timm.list_models('lambdaresnet*')}, "
                f"ResNet-RS: {timm.list_models('resnetrs*')}")
        out_indices = tuple(out_indices)
        if not out_indices or any(i not in (0, 1, 2, 3) for i in out_indices) \
                or tuple(sorted(set(out_indices))) != out_indices:
            raise ValueError(
                'out_indices must be increasing values from (0, 1, 2, 3) '
                f'(0=c2/stride 4 ... 3=c5/stride 32), got {out_indices}')
        if not -1 <= frozen_stages <= 4:
            raise ValueError(
                f'frozen_stages must be in [-1, 4], got {frozen_stages}')
        if size_divisor is not None and size_divisor < 1:
            raise ValueError(f'size_divisor must be None or >= 1, '
                             f'got {size_divisor}')
        self.model_name = model_name
        self.out_indices = out_indices
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.with_cp = with_cp
        self.size_divisor = size_divisor

        # timm feature index i+1 is c(i+2): index 0 is the stride-2 stem.
        self.body = timm.create_model(
            model_name,
            pretrained=False,
            features_only=True,
            out_indices=tuple(i + 1 for i in out_indices),
            **(model_kwargs or {}))
        reductions = self.body.feature_info.reduction()
        expected = [4 * 2**i for i in out_indices]
        if list(reductions) != expected:
            raise ValueError(
                f'{model_name} features have strides {reductions}, expected '
                f'{expected} for out_indices={out_indices}')
        self.out_channels = tuple(self.body.feature_info.channels())
        # Module names (keys of the timm FeatureListNet) that end each stage,
        # for frozen_stages. Names are resolved at use time (never cached
        # module references): mmengine's revert_sync_batchnorm replaces
        # modules after construction.
        all_info = self.body.feature_info.info
        self._stage_end_names = [
            info['module'].replace('.', '_') for info in all_info[0:5]
        ]
        if norm_cfg is not None:
            _replace_norms(self.body, norm_cfg)
        if with_cp:
            self.body.set_grad_checkpointing(True)
        self._freeze_stages()

    # ------------------------------------------------------------------ stages
    def _stage_groups(self):
        """Top-level module names grouped as [stem, c2, c3, c4, c5] (the
        stem ends at timm's stride-2 feature, e.g. ``act1``; parameter-free
        modules such as the max-pool fall into c2)."""
        groups = [[]]
        ends = list(self._stage_end_names)
        for name in self.body.keys():
            groups[-1].append(name)
            if ends and name == ends[0]:
                ends.pop(0)
                groups.append([])
        return [g for g in groups if g]

    def _freeze_stages(self):
        if self.frozen_stages < 0:
            return
        for group in self._stage_groups()[:self.frozen_stages + 1]:
            for name in group:
                m = self.body[name]
                m.eval()
                for p in m.parameters():
                    p.requires_grad = False

    def train(self, mode: bool = True):
        super().train(mode)
        self._freeze_stages()
        if mode and self.norm_eval:
            for m in self.modules():
                if isinstance(m, _BatchNorm):
                    m.eval()
        return self

    # ----------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor):
        if self.size_divisor and (x.shape[-1] % self.size_divisor
                                  or x.shape[-2] % self.size_divisor):
            raise ValueError(
                f'{type(self).__name__}: input size {tuple(x.shape[-2:])} is '
                f'not divisible by size_divisor={self.size_divisor}; pad the '
                'images (mmdet: model.data_preprocessor.pad_size_divisor=32) '
                'or set the backbone size_divisor=None')
        return tuple(self.body(x))

    # ----------------------------------------------------- pretrained weights
    def init_weights(self):
        if self.init_cfg is None:
            # timm initialised the weights at construction (from scratch).
            self._is_init = True
            return
        cfg = self.init_cfg
        load_timm_checkpoint(
            self.body,
            cfg['checkpoint'],
            model_name=self.model_name,
            prefix=cfg.get('prefix'),
            map_location=cfg.get('map_location', 'cpu'))
        self._is_init = True


def _read_state_dict(path, map_location='cpu'):
    if isinstance(path, str) and path.endswith('.safetensors'):
        from safetensors.torch import load_file
        if not osp.isfile(path):
            raise FileNotFoundError(
                f"init_cfg checkpoint file not found: '{path}'")
        return load_file(path, device=str(map_location))
    if isinstance(path, str) and '://' not in path and not osp.isfile(path):
        raise FileNotFoundError(
            f"init_cfg checkpoint file not found: '{path}'")
    ckpt = CheckpointLoader.load_checkpoint(path, map_location=map_location)
    if not isinstance(ckpt, dict):
        raise TypeError(f'checkpoint {path} holds a {type(ckpt).__name__}, '
                        'expected a state_dict')
    for key in ('state_dict', 'model'):
        if key in ckpt and isinstance(ckpt[key], dict):
            return ckpt[key]
    return ckpt


def load_timm_checkpoint(feature_net, path, model_name=None, prefix=None,
                         map_location='cpu'):
    """Load a timm ImageNet checkpoint into a timm ``features_only`` model.

    Keys are taken from the full classification model: the ``module.``
    prefix of DDP checkpoints is stripped, ``prefix`` (e.g. ``backbone.``)
    selects a sub-module, first-level Sequentials flattened by timm's
    FeatureListNet (``stages.0`` -> ``stages_0``) are mapped, and the
    classifier (and any other key the feature model lacks) is dropped.

    Raises ``ValueError`` if no key matches or a shape differs (wrong model
    for this checkpoint). Returns ``(loaded_keys, missing, dropped)``.
    """
    logger = MMLogger.get_current_instance()
    raw = _read_state_dict(path, map_location)
    state = OrderedDict()
    for k, v in raw.items():
        if k.startswith('module.'):
            k = k[len('module.'):]
        if prefix:
            if not k.startswith(prefix):
                continue
            k = k[len(prefix):]
        state[k] = v
    if prefix and not state:
        raise ValueError(f"no key of checkpoint {path} starts with "
                         f"prefix={prefix!r}")
    target = feature_net.state_dict()
    mapped, dropped = OrderedDict(), []
    for k, v in state.items():
        if k.startswith('body.') and k[5:] in target:
            k = k[5:]  # a TimmLambdaResNet's own state_dict
        cand = k
        if cand not in target:
            parts = k.split('.')
            if len(parts) > 2 and '_'.join(parts[:2]) + '.' + '.'.join(
                    parts[2:]) in target:
                cand = '_'.join(parts[:2]) + '.' + '.'.join(parts[2:])
        if cand not in target:
            dropped.append(k)
            continue
        if tuple(target[cand].shape) != tuple(v.shape):
            raise ValueError(
                f'checkpoint {path}: shape of {k} {tuple(v.shape)} does not '
                f'match the model {model_name} {tuple(target[cand].shape)}; '
                'is init_cfg.checkpoint a checkpoint of this model_name?')
        mapped[cand] = v
    if not mapped:
        raise ValueError(
            f'checkpoint {path} has no parameter of model {model_name} '
            f'(first keys: {list(state)[:5]}); check init_cfg.checkpoint '
            'and model_name (and prefix for detector checkpoints)')
    missing = [k for k in target if k not in mapped]
    feature_net.load_state_dict(mapped, strict=False)
    classifier = [k for k in dropped
                  if k.split('.')[0] in ('fc', 'head', 'classifier')]
    other = [k for k in dropped if k not in classifier]
    logger.info(f'Loaded {len(mapped)} tensors of {model_name} from {path}; '
                f'dropped classifier keys: {classifier}')
    if other:
        logger.warning(f'unexpected keys in {path} not loaded: {other}')
    if missing:
        logger.warning(f'keys of {model_name} missing from {path} (left at '
                       f'their initialisation): {missing}')
    return list(mapped), missing, dropped
