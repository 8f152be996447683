"""configs/timm/*.yaml: timm train.py --config recipes of appendix F.3 / Table 20.

timm's train.py is not in timm's PyPI distribution, so these checks use the argument
list committed in configs/timm/train_py_args.txt (written by tools/timm_train_args.py
from timm's train.py) and timm's library (model registry). The recipes are generated from
timm_lambda/paper.py (tests/test_generated.py); tests/test_paper_facts.py checks those facts
against the paper's text.
"""
from pathlib import Path

import pytest
import timm
import torch
import yaml
from timm.models import get_pretrained_cfg

import timm_lambda  # noqa: F401  (registers the models even without the autoload hook)
from _lib import recipes as timm_train_args
from timm_lambda.paper import TABLE20

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / 'configs' / 'timm'
ARGS_FILE = CONFIG_DIR / 'train_py_args.txt'

# Table 20: depth, image size, RandAugment magnitude, dropout, stochastic depth rate
ROWS = [(d, s, m, p, sd) for (d, s), (m, p, sd) in sorted(TABLE20.items())]
RECIPE_350 = {f'lambdaresnet{d}_r{s}_350ep.yaml': (d, s, m, p, sd) for d, s, m, p, sd in ROWS}
RECIPE_90 = ('resnet50_lambda_90ep.yaml', 'resnet50_lambda_u4_90ep.yaml')
RECIPE_MBV2 = 'mobilenetv2_100_lambda_350ep.yaml'
RECIPE_CIFAR = 'resnet50_lambda_global32_cifar10_90ep.yaml'  # the CIFAR-10 reproduction report's setup
ALL_CONFIGS = sorted([*RECIPE_350, *RECIPE_90, RECIPE_MBV2, RECIPE_CIFAR])

CORE_ARGS = {
    'model', 'img_size', 'input_size', 'batch_size', 'epochs', 'opt', 'momentum', 'weight_decay',
    'lr', 'lr_base', 'lr_base_size', 'lr_base_scale', 'sched', 'sched_on_updates', 'warmup_epochs',
    'warmup_lr', 'warmup_prefix', 'decay_epochs', 'decay_rate', 'aa', 'smoothing', 'drop', 'drop_path',
    'model_ema', 'model_ema_decay', 'interpolation', 'train_interpolation', 'bn_momentum', 'data_dir',
}


def load(name):
    return yaml.safe_load((CONFIG_DIR / name).read_text())


def train_py_args():
    return timm_train_args.read_args_file(ARGS_FILE)


# ---------------------------------------------------------------- argument list
def test_committed_arg_list_is_real():
    text = ARGS_FILE.read_text()
    assert 'aa4b5850' in text and '1.0.29.dev0' in text, 'header must name the timm commit/version'
    names = train_py_args()
    assert len(names) > 100, f'only {len(names)} names in {ARGS_FILE}'
    assert len(names) == len(set(names))
    missing = CORE_ARGS - set(names)
    assert not missing, f'core train.py arguments missing from {ARGS_FILE.name}: {sorted(missing)}'


def test_config_files_present():
    present = sorted(p.name for p in CONFIG_DIR.glob('*.yaml'))
    assert present == ALL_CONFIGS


@pytest.mark.parametrize('name', ALL_CONFIGS)
def test_every_key_is_a_train_py_argument(name):
    cfg = load(name)
    unknown = set(cfg) - (set(train_py_args()) - timm_train_args.NOT_IN_YAML)
    assert not unknown, f'{name}: train.py would silently ignore {sorted(unknown)}'


def test_check_configs_flags_unknown_keys(tmp_path):
    (tmp_path / 'ok.yaml').write_text('model: lambdaresnet50\nepochs: 1\n')
    (tmp_path / 'bad.yaml').write_text('model: lambdaresnet50\nweight-decay: 1.0e-4\nconfig: x.yaml\n')
    problems = timm_train_args.check_configs(train_py_args(), tmp_path)
    assert len(problems) == 2 and all(p.startswith('bad.yaml') for p in problems), problems
    assert timm_train_args.check_configs(train_py_args(), CONFIG_DIR) == []
    assert timm_train_args.check_configs(train_py_args(), tmp_path / 'empty') != []


def test_parser_follows_argparse_dest_rules():
    src = '''
import argparse
p = argparse.ArgumentParser()
g = p.add_argument_group('x')
p.add_argument('data', nargs='?')
g.add_argument('-b', '--batch-size', type=int)
g.add_argument('--decay-rate', '--dr', type=float)
g.add_argument('-j', type=int)
g.add_argument('--torchscript', dest='script_it', action='store_true')
p.add_argument_group('y').add_argument('--model-ema-decay')
c = argparse.ArgumentParser(add_help=False)  # a second parser, as train.py's config_parser
c.add_argument('--batch-size')
'''
    assert timm_train_args.parse_train_py(src) == [
        'data', 'batch_size', 'decay_rate', 'j', 'script_it', 'model_ema_decay']
    # and the same names as argparse itself gives for the snippet
    ns = {}
    exec(compile(src, '<snippet>', 'exec'), ns)  # our own snippet above, not timm's train.py
    real = {a.dest for parser in (ns['p'], ns['c']) for a in parser._actions if a.dest != 'help'}
    assert real == set(timm_train_args.parse_train_py(src))


# ---------------------------------------------------------------- recipe values
COMMON_SGD = dict(opt='momentum', momentum=0.9, lr_base=0.1, lr_base_size=256, lr_base_scale='linear',
                  sched='cosine', sched_on_updates=True, warmup_epochs=5, warmup_lr=0.0, warmup_prefix=False,
                  min_lr=0.0, cooldown_epochs=0, smoothing=0.1, model_ema=True, model_ema_decay=0.9999,
                  interpolation='bicubic', train_interpolation='bicubic', hflip=0.5, reprob=0.0,
                  mixup=0.0, cutmix=0.0, scale=[0.08, 1.0])


def _assert_subset(cfg, expected, name):
    diff = {k: (cfg.get(k, '<missing>'), v) for k, v in expected.items() if cfg.get(k, '<missing>') != v}
    assert not diff, f'{name}: (config, expected) {diff}'


def _no_fixed_lr(cfg, name):
    # lr must come from lr_base * global_batch / lr_base_size so it follows the real batch size
    assert 'lr' not in cfg, f'{name} sets lr; it must be derived from lr_base/lr_base_size'
    assert 'input_size' not in cfg, f'{name}: input_size would override --img-size on the command line'


@pytest.mark.parametrize('name', sorted(RECIPE_350))
def test_350_epoch_recipe_matches_table_20(name):
    depth, size, magnitude, dropout, drop_path = RECIPE_350[name]
    cfg = load(name)
    _assert_subset(cfg, dict(
        COMMON_SGD, model=f'lambdaresnet{depth}.r{size}', img_size=size, epochs=350, weight_decay=4e-5,
        drop=dropout, drop_path=drop_path, aa=f'rand-m{magnitude}-n2-mmax{magnitude}-p1.0',
    ), name)
    _no_fixed_lr(cfg, name)
    assert 0.1 * 4096 / cfg['lr_base_size'] == pytest.approx(1.6)


@pytest.mark.parametrize('name', RECIPE_90)
def test_90_epoch_vanilla_recipe(name):
    cfg = load(name)
    _assert_subset(cfg, dict(
        COMMON_SGD, model=name.replace('_90ep.yaml', '.r224'), img_size=224, epochs=90,
        weight_decay=1e-4, drop=0.0, drop_path=0.0, color_jitter=0.0, bn_momentum=1e-4,
    ), name)
    assert 'aa' not in cfg, 'F.3 90-epoch setup: random crops and flips only'
    _no_fixed_lr(cfg, name)


def test_mobilenet_recipe():
    cfg = load(RECIPE_MBV2)
    _assert_subset(cfg, dict(
        model='mobilenetv2_100_lambda.r224', img_size=224, epochs=350, opt='rmsproptf', momentum=0.9,
        weight_decay=1e-5, drop=0.2, sched='step', decay_epochs=3, decay_rate=0.99, warmup_lr=0.0,
        lr_base=0.1, lr_base_size=4096, lr_base_scale='linear', color_jitter=0.0,
    ), RECIPE_MBV2)
    assert 'aa' not in cfg
    _no_fixed_lr(cfg, RECIPE_MBV2)


def test_cifar10_report_recipe():
    """timm_lambda.paper.CIFAR10_REPORT: its model, batch, Adam, lr, smoothing and flip, in train.py's terms."""
    from timm_lambda.paper import CIFAR10_REPORT as R
    cfg = load(RECIPE_CIFAR)
    _assert_subset(cfg, dict(
        model='resnet50_lambda_global32.cifar10', num_classes=R['num_classes'], img_size=R['input_size'],
        dataset='torch/cifar10', batch_size=R['batch_size'], opt='adam', opt_betas=list(R['betas']),
        weight_decay=R['weight_decay'], smoothing=R['smoothing'], hflip=0.5, color_jitter=0.0, mixup=0.0,
        cutmix=0.0, reprob=0.0, crop_pct=1.0, warmup_lr=R['lr'], lr=R['lr'] * R['warmup_epochs'],
    ), RECIPE_CIFAR)
    # warm-up prefix + cosine + one cool-down epoch = the report's 90 epochs (schedule: test_timm_scripts.py)
    assert cfg['warmup_epochs'] + cfg['epochs'] + cfg['cooldown_epochs'] == R['epochs']
    assert 'aa' not in cfg and 'lr_base' not in cfg


# ---------------------------------------------------------------- models
@pytest.mark.parametrize('name', ALL_CONFIGS)
def test_model_exists_and_builds_as_train_py_builds_it(name):
    cfg = load(name)
    assert timm.is_model(cfg['model']), cfg['model']
    # raises for an unregistered tag (a typo would otherwise fall back to the default resolution)
    pretrained_cfg = get_pretrained_cfg(cfg['model'], allow_unregistered=False)
    assert pretrained_cfg.input_size == (3, cfg['img_size'], cfg['img_size'])
    # the same create_model() keyword arguments train.py passes (None values are dropped by timm)
    kwargs = dict(
        num_classes=cfg.get('num_classes'), drop_rate=cfg.get('drop', 0.0),
        drop_path_rate=cfg.get('drop_path'), drop_block_rate=cfg.get('drop_block'),
        global_pool=cfg.get('gp'), bn_momentum=cfg.get('bn_momentum'), bn_eps=cfg.get('bn_eps'),
        **cfg.get('model_kwargs', {}),
    )
    with torch.device('meta'):  # same constructor, no memory/initialisation cost
        model = timm.create_model(cfg['model'], **kwargs)
    assert model.drop_rate == cfg['drop']
    assert model.pretrained_cfg['input_size'][-1] == cfg['img_size']
    drop_probs = [m.drop_prob for m in model.modules() if type(m).__name__ == 'DropPath']
    if cfg['drop_path']:
        assert max(drop_probs) == pytest.approx(cfg['drop_path'])
    else:
        assert not any(drop_probs)
