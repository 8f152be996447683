"""The pieces of timm's train.py / validate.py pipeline that CI can run without train.py.

timm's scripts (train.py, validate.py, ...) are not in timm's PyPI distribution; the real
scripts were run locally against these configs (README, "Training with timm"). Here the
library calls those scripts make are driven by our configs and model default configs:
``resolve_data_config`` + ``create_transform`` (image sizes of Table 18, RandAugment of
Table 20), ``create_optimizer_v2`` and ``create_scheduler_v2`` (F.3 optimizer and lr
schedule). That the installed package registers the models on ``import timm`` (what
makes ``--model lambdaresnet101`` work in those scripts) is tested in tests/test_install.py.
"""
import math
from argparse import Namespace
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image
from timm.data import create_transform, resolve_data_config
from timm.data.auto_augment import RandAugment
from timm.models import get_pretrained_cfg
from timm.optim import create_optimizer_v2, optimizer_kwargs
from timm.scheduler import create_scheduler_v2, scheduler_kwargs
from torchvision import transforms as T

import timm_lambda  # noqa: F401

CONFIG_DIR = Path(__file__).resolve().parents[1] / 'configs' / 'timm'

# Table 18 of the paper: (depth, image size) of every LambdaResNet row.
TABLE_18 = [(50, 128), (50, 160), (101, 160), (101, 192), (152, 192), (152, 224), (152, 256),
            (152, 288), (270, 256), (350, 256), (350, 288), (350, 320), (420, 320)]
# The same rows' RandAugment magnitudes (Table 20).
TABLE_20_RA = {(50, 128): 10, (50, 160): 10, (101, 160): 10, (101, 192): 15, (152, 192): 15,
               (152, 224): 15, (152, 256): 15, (152, 288): 15, (270, 256): 15, (350, 256): 15,
               (350, 288): 15, (350, 320): 15, (420, 320): 15}
CIFAR_CONFIG = 'resnet50_lambda_global32_cifar10_90ep.yaml'  # tested on its own below
CONFIGS = sorted(p.name for p in CONFIG_DIR.glob('*.yaml') if p.name != CIFAR_CONFIG)  # the ImageNet recipes


def load(name):
    return yaml.safe_load((CONFIG_DIR / name).read_text())


def image(w=300, h=200):
    return Image.new('RGB', (w, h), (120, 60, 30))


@pytest.mark.parametrize('depth,size', TABLE_18)
def test_table_18_resolution_from_model_default_config(depth, size):
    """validate.py path: resolve_data_config(model) + create_transform(eval) give Table 18's size."""
    name = f'lambdaresnet{depth}.r{size}'
    cfg = resolve_data_config({}, pretrained_cfg=get_pretrained_cfg(name, allow_unregistered=False).to_dict())
    assert cfg['input_size'] == (3, size, size)
    assert cfg['interpolation'] == 'bicubic'
    out = create_transform(**cfg, is_training=False)(image())
    assert tuple(out.shape) == (3, size, size)


@pytest.mark.parametrize('name', CONFIGS)
def test_train_and_eval_transforms_of_config(name):
    """train.py path: resolve_data_config(args, model) then create_transform, with the config as args."""
    cfg = load(name)
    size = cfg['img_size']
    args = dict(cfg)
    data_cfg = resolve_data_config(args, pretrained_cfg=get_pretrained_cfg(cfg['model']).to_dict())
    assert data_cfg['input_size'] == (3, size, size)
    assert data_cfg['interpolation'] == 'bicubic'
    train_tf = create_transform(
        data_cfg['input_size'], is_training=True, scale=cfg['scale'], ratio=cfg['ratio'], hflip=cfg['hflip'],
        color_jitter=cfg['color_jitter'], auto_augment=cfg.get('aa'), interpolation=cfg['train_interpolation'],
        mean=data_cfg['mean'], std=data_cfg['std'], re_prob=cfg['reprob'])
    eval_tf = create_transform(**data_cfg, is_training=False)
    for tf in (train_tf, eval_tf):
        assert tuple(tf(image()).shape) == (3, size, size)
    ops = list(train_tf.transforms)
    rrc = [t for t in ops if type(t).__name__.startswith('RandomResizedCrop')]  # timm's own class
    assert len(rrc) == 1 and tuple(rrc[0].scale) == (0.08, 1.0)
    assert any(isinstance(t, T.RandomHorizontalFlip) and t.p == 0.5 for t in ops)
    jitter = [t for t in ops if isinstance(t, T.ColorJitter)]
    assert all(j.brightness is None and j.contrast is None and j.saturation is None for j in jitter)
    ra = [t for t in ops if isinstance(t, RandAugment)]
    if 'aa' not in cfg:  # 90-epoch and MobileNet recipes: random crop + flip only
        assert not ra
        return
    depth = int(cfg['model'].split('.')[0].replace('lambdaresnet', ''))
    magnitude = TABLE_20_RA[(depth, size)]
    assert len(ra) == 1 and ra[0].num_layers == 2
    for op in ra[0].ops:
        assert op.magnitude == magnitude and op.magnitude_std == 0 and op.prob == 1.0
        # timm clips magnitudes to 10 unless magnitude_max is raised: M=15 must really be 15
        assert min(op.magnitude, op.magnitude_max or 10) == magnitude


def _train_py_namespace(cfg, global_batch):
    """The args train.py hands to the optimizer/scheduler factories, with its lr_base rule."""
    args = Namespace(**{'opt_eps': None, 'opt_betas': None, 'layer_decay': None, **cfg})
    args.lr = cfg['lr_base'] * global_batch / cfg['lr_base_size']  # train.py, lr_base_scale 'linear'
    return args


@pytest.mark.parametrize('name', CONFIGS)
def test_optimizer_and_lr_schedule_of_config(name):
    cfg = load(name)
    assert cfg['lr_base_scale'] == 'linear'
    args = _train_py_namespace(cfg, global_batch=4096)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    opt = create_optimizer_v2(model, **optimizer_kwargs(cfg=args))
    group = opt.param_groups[0]
    assert group['momentum'] == 0.9
    if cfg['opt'] == 'momentum':
        assert type(opt).__name__ == 'SGD' and group['nesterov'] is False
        peak = 0.1 * 4096 / 256  # F.3: 0.1 * B / 256
    else:
        assert type(opt).__name__ == 'RMSpropTF' and group['alpha'] == 0.9
        peak = 0.1  # F.3 MobileNet: warmed up to 0.1 at B = 4096
    decayed = [g for g in opt.param_groups if g['weight_decay'] > 0]
    assert decayed and all(g['weight_decay'] == cfg['weight_decay'] for g in decayed)

    updates = 20  # per epoch
    sched, num_epochs = create_scheduler_v2(opt, **scheduler_kwargs(args), updates_per_epoch=updates)
    assert num_epochs == cfg['epochs']  # warm-up inside the epochs, no cool-down
    warm, end = cfg['warmup_epochs'] * updates, cfg['epochs'] * updates
    if cfg['sched'] == 'cosine':  # cosine to 0 over all updates; warm-up replaces its start (as TF code)
        decay = lambda t: peak * 0.5 * (1 + math.cos(math.pi * t / end))  # noqa: E731
    else:  # x0.99 every 3 epochs, staircase
        decay = lambda t: peak * 0.99 ** (t // (3 * updates))  # noqa: E731
    expected = [t * peak / warm if t < warm else decay(t) for t in range(end)]
    got = [sched._get_lr(t)[0] for t in range(end)]
    assert got[0] == 0.0  # linear warm-up from 0 (per update)
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert got[warm] == pytest.approx(peak, rel=0.02)
    assert got[-1] < 1e-4 * peak if cfg['sched'] == 'cosine' else got[-1] == pytest.approx(peak * 0.99 ** 116)


# ---------------------------------------------------------------- CIFAR-10 report recipe
def test_cifar10_report_recipe_transforms():
    """train.py's data path for the CIFAR recipe: 32x32, the report's mean/std, a mild random crop + flip, no
    colour jitter; evaluation keeps the whole 32x32 image (resize and centre crop are identities)."""
    from timm_lambda.paper import CIFAR10_MEAN, CIFAR10_STD
    cfg = load(CIFAR_CONFIG)
    data_cfg = resolve_data_config(dict(cfg), pretrained_cfg=get_pretrained_cfg(cfg['model']).to_dict())
    assert data_cfg['input_size'] == (3, 32, 32) and data_cfg['crop_pct'] == 1.0
    assert data_cfg['mean'] == CIFAR10_MEAN and data_cfg['std'] == CIFAR10_STD
    train_tf = create_transform(
        data_cfg['input_size'], is_training=True, scale=cfg['scale'], ratio=cfg['ratio'], hflip=cfg['hflip'],
        color_jitter=cfg['color_jitter'], interpolation=cfg['train_interpolation'], mean=data_cfg['mean'],
        std=data_cfg['std'], re_prob=cfg['reprob'])
    ops = list(train_tf.transforms)
    rrc = [t for t in ops if type(t).__name__.startswith('RandomResizedCrop')]
    assert len(rrc) == 1 and tuple(rrc[0].scale) == (0.75, 1.0) and tuple(rrc[0].ratio) == (1.0, 1.0)
    assert any(isinstance(t, T.RandomHorizontalFlip) and t.p == 0.5 for t in ops)
    assert not any(isinstance(t, RandAugment) for t in ops)
    jitter = [t for t in ops if isinstance(t, T.ColorJitter)]
    assert all(j.brightness is None and j.contrast is None and j.saturation is None for j in jitter)
    eval_tf = create_transform(**data_cfg, is_training=False)
    img = Image.fromarray((torch.rand(32, 32, 3) * 255).to(torch.uint8).numpy())
    expected = (T.functional.to_tensor(img) - torch.tensor(CIFAR10_MEAN)[:, None, None]) / torch.tensor(
        CIFAR10_STD)[:, None, None]
    torch.testing.assert_close(eval_tf(img), expected)


def test_cifar10_report_recipe_optimizer_and_schedule():
    """Adam (betas 0.9, 0.9999) and, epoch by epoch, the report's lr: 0.0005 x (e + 1) for e < 5, then
    0.0025 (1 + cos(pi (e - 4) / 85)) / 2 (its LambdaLR then CosineAnnealingLR), over 90 epochs."""
    cfg = load(CIFAR_CONFIG)
    args = Namespace(**{'opt_eps': None, 'layer_decay': None, 'momentum': 0.9, **cfg})  # train.py defaults
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    opt = create_optimizer_v2(model, **optimizer_kwargs(cfg=args))
    # tuple(): the YAML list reaches Adam as is, and the Adam of torch 2.4 and 2.5 keeps it a list (2.14's a tuple)
    assert type(opt).__name__ == 'Adam' and tuple(opt.param_groups[0]['betas']) == (0.9, 0.9999)
    assert sorted(g['weight_decay'] for g in opt.param_groups) == [0.0, 1e-4]  # timm: none on biases/norms
    sched, num_epochs = create_scheduler_v2(opt, **scheduler_kwargs(args))
    assert num_epochs == 90
    report = [0.0005 * (e + 1) if e < 5 else 0.0025 * (1 + math.cos(math.pi * (e - 4) / 85)) / 2
              for e in range(90)]
    got = [sched._get_lr(e)[0] for e in range(90)]
    assert got == pytest.approx(report, rel=1e-9, abs=1e-12)
