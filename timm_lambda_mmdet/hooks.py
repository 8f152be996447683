"""Checks before a run, so that a mistake stops the run with a message instead of a wrong result."""
import os
import os.path as osp
from typing import Optional

from mmdet.registry import HOOKS
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.runner import BaseLoop

from .checkpoint_compat import check_checkpoint_file
from .mmcv_cuda import mmcv_has_cuda_ops

__all__ = ['PreflightHook', 'check_mmcv_ops_for_device']

MMCV_CUDA_REBUILD = 'TIMM_LAMBDA_MMCV_CUDA=1 bash tools/install.sh'


def check_mmcv_ops_for_device(device_type: str, mmcv_has_cuda: bool) -> None:
    """Refuse a model on a CUDA device with an mmcv whose compiled ops are CPU-only.

    mmcv's RoIAlign / NMS / ... dispatch on the tensors' device; a CPU-only build (``FORCE_CUDA=0``, the
    prebuilt wheel of tools/install.sh on a machine without a GPU) fails at the first iteration with
    ``<op> is not implemented on CUDA``-like errors. Raising here names the cause and the fix instead.
    """
    if device_type == 'cuda' and not mmcv_has_cuda:
        raise RuntimeError(
            'the model is on a CUDA device, but the installed mmcv has CPU-only compiled ops (no CUDA device code '
            'in mmcv/_ext*.so): RoIAlign/NMS would fail at the first iteration. Rebuild mmcv with its CUDA ops: '
            f'`{MMCV_CUDA_REBUILD}` (needs the CUDA toolkit matching torch.version.cuda; see docs/install.md, '
            '"GPU (CUDA) install"), or run on CPU.')


@HOOKS.register_module()
class PreflightHook(Hook):
    """Refuses a checkpoint whose keys do not match the model, and unwritable output files, before the run.

    * ``after_load_checkpoint`` (``load_from``, mmdet's ``tools/test.py CONFIG CHECKPOINT``, ``--resume``): the
      checkpoint's ``state_dict`` must hold exactly the model's keys (``module.`` prefixes aside); otherwise a
      ``ValueError`` names the missing and unexpected keys. mmengine itself only logs them and goes on, so a
      checkpoint of another architecture, or a timm ImageNet state dict, would be scored with untrained heads.
      ``strict_checkpoint=False`` keeps mmengine's behaviour.
    * ``before_run``: the checkpoint to load (``load_from``, the test checkpoint, ``--resume``'s) must not be
      empty or a truncated zip (an error names the file instead of torch's bare ``EOFError``); every output
      file of the built test/val evaluators (mmdet ``tools/test.py --out``, ``CocoMetric.outfile_prefix``)
      must be in an existing, writable directory, checked before the evaluation runs rather than after it;
      a model on a CUDA device needs mmcv's CUDA ops (:func:`check_mmcv_ops_for_device`), else a
      ``RuntimeError`` says how to rebuild mmcv.
    """
    priority = 'VERY_HIGH'

    def __init__(self, strict_checkpoint: bool = True):
        self.strict_checkpoint = strict_checkpoint

    def before_run(self, runner) -> None:
        self._check_mmcv_ops(runner)
        self._check_checkpoint_to_load(runner)
        for loop in (getattr(runner, '_test_loop', None), getattr(runner, '_val_loop', None)):
            if not isinstance(loop, BaseLoop) or getattr(loop, 'evaluator', None) is None:
                continue
            for metric in loop.evaluator.metrics:
                for attr in ('out_file_path', 'outfile_prefix'):
                    _check_writable(getattr(metric, attr, None), f'{type(metric).__name__}.{attr}')

    @staticmethod
    def _check_mmcv_ops(runner) -> None:
        """The model's device (its first parameter's; mmengine has moved it there before ``before_run``)."""
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        param = next(iter(model.parameters()), None)
        if param is None or param.device.type != 'cuda':
            return
        check_mmcv_ops_for_device(param.device.type, mmcv_has_cuda_ops())

    @staticmethod
    def _check_checkpoint_to_load(runner) -> None:
        """The file mmengine's ``load_or_resume`` (after ``before_run``) will read must exist and be readable."""
        load_from, resume = getattr(runner, '_load_from', None), getattr(runner, '_resume', False)
        if getattr(runner, '_has_loaded', False) or not (load_from or resume):
            return
        if resume and load_from is None:
            from mmengine.runner import find_latest_checkpoint
            load_from = find_latest_checkpoint(runner.work_dir)  # None: mmengine starts from scratch
            what = f'resume (the last checkpoint of work_dir {runner.work_dir})'
        else:
            what = 'resume' if resume else 'load_from (the config\'s, or tools/test.py CHECKPOINT)'
        if load_from:
            check_checkpoint_file(load_from, what)

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        if not self.strict_checkpoint:
            return
        state = checkpoint.get('state_dict', checkpoint) if isinstance(checkpoint, dict) else {}
        keys = {k[len('module.'):] if k.startswith('module.') else k for k in state}
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - keys), sorted(keys - expected)
        if missing or unexpected:
            raise ValueError(
                f'the checkpoint does not match the model ({type(model).__name__}): {len(missing)} missing keys '
                f'{missing[:6]}{" ..." if len(missing) > 6 else ""}, {len(unexpected)} unexpected keys '
                f'{unexpected[:6]}{" ..." if len(unexpected) > 6 else ""}. Is it a checkpoint of this config? '
                '(A timm ImageNet checkpoint belongs in model.backbone.init_cfg.checkpoint, e.g. --cfg-options '
                'model.backbone.init_cfg.checkpoint=PATH; set custom_hooks PreflightHook(strict_checkpoint=False) '
                'to load partially.)')


def _check_writable(path: Optional[str], what: str) -> None:
    if not path or '://' in str(path):
        return
    directory = osp.dirname(osp.abspath(str(path)))
    if not osp.isdir(directory):
        raise FileNotFoundError(f'{what}={path!r}: the directory {directory!r} does not exist')
    if not os.access(directory, os.W_OK):
        raise PermissionError(f'{what}={path!r}: the directory {directory!r} is not writable')
