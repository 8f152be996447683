"""A short image-classification run through timm's own machinery, on a generated data set.

``timm.create_model`` builds the LambdaResNet, :class:`~_lib.datasets.SyntheticShapes` generates the
images (train and held-out splits from independent random streams), ``timm.data.create_loader`` applies
timm's train/eval transforms with the model's data config, ``timm.optim.create_optimizer_v2`` and
``timm.scheduler.create_scheduler_v2`` (cosine, per-update warm-up) drive the training, with timm's
label-smoothing loss and ``timm.utils.accuracy``. It prints one line per epoch and returns the numbers.

    from _lib.quick_train import QuickRunConfig, quick_train
    result = quick_train(QuickRunConfig(epochs=2))

``tools/classification_quick_run.py`` is the command-line entry point (README "Classification quick run").
"""
import dataclasses
import math
import random
import time
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import timm
import torch
from timm.data import create_loader, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import AverageMeter, accuracy

from .datasets import SHAPE_CLASSES, SyntheticShapes

__all__ = ['QuickRunConfig', 'quick_train']


@dataclasses.dataclass
class QuickRunConfig:
    """Settings of a quick run (defaults: the README's run, about 2 minutes on 2 CPU cores).

    The default model is the CIFAR-10 report's network (``resnet50_lambda_global32``: every 3x3 a lambda layer,
    global context, lambda layers at 8, 4, 2, 1 px for 32x32 images) with one block per stage instead of
    3-4-6-3 (``model_kwargs``), so that it learns within a few minutes of CPU time.
    """
    model: str = 'resnet50_lambda_global32'
    model_kwargs: Dict[str, Any] = dataclasses.field(default_factory=lambda: {'layers': (1, 1, 1, 1)})
    num_classes: int = 8  # the first num_classes of SHAPE_CLASSES; chance = 1 / num_classes
    image_size: int = 32
    train_samples: int = 2048
    val_samples: int = 512
    epochs: int = 10
    batch_size: int = 32
    opt: str = 'adamw'
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_epochs: int = 1  # per-update linear warm-up from 0.1 x lr
    smoothing: float = 0.0
    scale: Tuple[float, float] = (0.8, 1.0)  # random-resized-crop area range
    seed: int = 0
    threads: Optional[int] = None  # torch.set_num_threads (None: leave torch's default)

    def validate(self) -> None:
        def positive_int(name, low=1, high=None):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
                rng = f'{low}..{high}' if high is not None else f'>= {low}'
                raise ValueError(f'{name} must be an int {rng}, got {v!r}')

        positive_int('num_classes', 2, len(SHAPE_CLASSES))
        for name in ('image_size', 'train_samples', 'val_samples', 'epochs', 'batch_size'):
            positive_int(name)
        positive_int('seed', 0)
        positive_int('warmup_epochs', 0, self.epochs - 1)
        if self.threads is not None:
            positive_int('threads')
        for name in ('lr', 'weight_decay', 'smoothing'):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or math.isinf(v):
                raise ValueError(f'{name} must be a finite number >= 0, got {v!r}')
        if not self.lr > 0 or not self.smoothing < 1:
            raise ValueError(f'lr must be > 0 and smoothing < 1, got lr={self.lr!r}, smoothing={self.smoothing!r}')
        lo, hi = self.scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f'scale must be (low, high) with 0 < low <= high <= 1, got {self.scale!r}')


def _seed_everything(seed: int) -> None:
    random.seed(seed)  # timm's random-resized crop and flip draw from Python's random
    np.random.seed(seed)
    torch.manual_seed(seed)  # weights, loader shuffling


def quick_train(cfg: QuickRunConfig = QuickRunConfig(), log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Train ``cfg.model`` on generated shapes and evaluate on a held-out split after every epoch.

    Returns a dict: ``epochs`` (per-epoch lr, train loss, train and held-out top-1 in %, seconds),
    ``val_top1`` (final held-out top-1, %), ``chance`` (100 / num_classes), ``params``, ``seconds``.
    """
    cfg.validate()
    threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, log)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: QuickRunConfig, log: Callable[[str], None]) -> Dict[str, Any]:
    _seed_everything(cfg.seed)
    start = time.time()
    model = timm.create_model(cfg.model, num_classes=cfg.num_classes, **cfg.model_kwargs)
    data_cfg = resolve_data_config({'input_size': (3, cfg.image_size, cfg.image_size), 'crop_pct': 1.0},
                                   model=model)
    classes = SHAPE_CLASSES[:cfg.num_classes]
    train_set = SyntheticShapes(cfg.train_samples, cfg.image_size, classes, split='train', seed=cfg.seed, cache=True)
    val_set = SyntheticShapes(cfg.val_samples, cfg.image_size, classes, split='val', seed=cfg.seed, cache=True)
    common = dict(input_size=data_cfg['input_size'], batch_size=cfg.batch_size, mean=data_cfg['mean'],
                  std=data_cfg['std'], interpolation=data_cfg['interpolation'], num_workers=0,
                  persistent_workers=False,  # timm < 1.0.29 passes its default True on with no workers: a ValueError
                  use_prefetcher=False, device=torch.device('cpu'))
    train_loader = create_loader(train_set, is_training=True, scale=cfg.scale, ratio=(3 / 4, 4 / 3), hflip=0.5,
                                 color_jitter=0.0, re_prob=0.0, **common)
    val_loader = create_loader(val_set, is_training=False, crop_pct=data_cfg['crop_pct'], **common)

    optimizer = create_optimizer_v2(model, opt=cfg.opt, lr=cfg.lr, weight_decay=cfg.weight_decay)
    updates_per_epoch = len(train_loader)
    scheduler, _ = create_scheduler_v2(optimizer, sched='cosine', num_epochs=cfg.epochs,
                                       warmup_epochs=cfg.warmup_epochs, warmup_lr=cfg.lr * 0.1,
                                       min_lr=cfg.lr * 0.01, step_on_epochs=False,
                                       updates_per_epoch=updates_per_epoch)
    loss_fn = LabelSmoothingCrossEntropy(cfg.smoothing)
    params = sum(p.numel() for p in model.parameters())
    chance = 100.0 / cfg.num_classes
    log(f'model {cfg.model} ({params / 1e6:.2f}M parameters, {cfg.num_classes} classes), '
        f'{cfg.train_samples} train / {cfg.val_samples} held-out {cfg.image_size}x{cfg.image_size} images, '
        f'{cfg.epochs} epochs of {updates_per_epoch} steps (batch {cfg.batch_size}), {cfg.opt} lr {cfg.lr:g}, '
        f'{torch.get_num_threads()} threads')

    history, updates = [], 0
    for epoch in range(cfg.epochs):
        t0 = time.time()
        model.train()
        loss_m, top1_m = AverageMeter(), AverageMeter()
        for x, y in train_loader:
            logits = model(x)
            loss = loss_fn(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            updates += 1
            scheduler.step_update(updates)
            loss_m.update(loss.item(), x.shape[0])
            top1_m.update(accuracy(logits.detach(), y)[0].item(), x.shape[0])
        val_top1 = evaluate(model, val_loader)
        row = dict(epoch=epoch + 1, lr=optimizer.param_groups[0]['lr'], train_loss=loss_m.avg,
                   train_top1=top1_m.avg, val_top1=val_top1, seconds=time.time() - t0)
        history.append(row)
        log(f'epoch {epoch + 1}/{cfg.epochs}  train loss {loss_m.avg:.3f}  train top-1 {top1_m.avg:5.1f}%  '
            f'held-out top-1 {val_top1:5.1f}%  lr {row["lr"]:.2e}  {row["seconds"]:.0f}s')
    seconds = time.time() - start
    final = history[-1]['val_top1']
    log(f'held-out top-1 {final:.1f}% on {cfg.val_samples} images vs chance {chance:.1f}% '
        f'({final / chance:.1f}x chance), {seconds:.0f}s')
    return dict(epochs=history, val_top1=final, chance=chance, params=params, seconds=seconds)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader) -> float:
    """Top-1 accuracy (%) of ``model`` in eval mode over ``loader``."""
    model.eval()
    top1 = AverageMeter()
    for x, y in loader:
        top1.update(accuracy(model(x), y)[0].item(), x.shape[0])
    return top1.avg
