"""TimmLambdaResNet: features, norms, freezing, checkpointing, weights."""
import _det  # noqa: F401  (skips this module without the [det] extra)

# isort: split
import subprocess
import sys

import pytest
import timm
import torch
import torch.nn as nn
from mmdet.registry import MODELS
from mmengine.model import revert_sync_batchnorm
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from _helpers import dli14_state_dict
from _mmdet_helpers import REPO
from timm_lambda_mmdet import TimmLambdaResNet, norm_layer_from_cfg


def build(**kw):
    cfg = dict(type='TimmLambdaResNet', model_name='lambdaresnet50')
    cfg.update(kw)
    return MODELS.build(cfg)


def test_import_without_mmdet_names_the_extra():
    code = ("import sys\n"
            "sys.modules['mmdet'] = None\n"
            "try:\n"
            "    import timm_lambda_mmdet\n"
            "except ImportError as e:\n"
            "    print('MSG', e)\n"
            "else:\n"
            "    print('NO ERROR')\n")
    out = subprocess.run([sys.executable, '-c', code], cwd=REPO,
                         capture_output=True, text=True, timeout=120).stdout
    assert 'MSG' in out, out
    assert 'pip install "timm-lambda[det]"' in out
    assert 'mmdet' in out


@pytest.mark.parametrize('name', ['lambdaresnet50', 'resnetrs50_nose'])
def test_features_c2_to_c5(name):
    b = build(model_name=name).eval()
    with torch.no_grad():
        outs = b(torch.randn(1, 3, 64, 96))
    assert [tuple(o.shape) for o in outs] == [
        (1, 256, 16, 24), (1, 512, 8, 12), (1, 1024, 4, 6), (1, 2048, 2, 3)]
    b2 = build(model_name=name, out_indices=(1, 3)).eval()
    with torch.no_grad():
        outs = b2(torch.randn(1, 3, 64, 64))
    assert [o.shape[1] for o in outs] == [512, 2048]


def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match='model_name'):
        build(model_name='lambdaresnet_does_not_exist')
    with pytest.raises(ValueError, match='out_indices'):
        build(out_indices=(1, 4))
    with pytest.raises(ValueError, match='frozen_stages'):
        build(frozen_stages=7)
    with pytest.raises(ValueError, match='init_cfg'):
        build(init_cfg=dict(type='Kaiming'))


def test_input_not_divisible_by_32_raises_naming_pad_size_divisor():
    b = build().eval()
    with pytest.raises(ValueError, match='pad_size_divisor=32'):
        b(torch.randn(1, 3, 100, 64))


def _lambda_modules(model):
    return [m for m in model.modules() if 'lambda' in type(m).__name__.lower()]


@pytest.mark.parametrize('norm_cfg,expected', [
    (dict(type='GN', num_groups=16), nn.GroupNorm),
    (dict(type='SyncBN'), nn.SyncBatchNorm),
    (dict(type='BN'), nn.BatchNorm2d),
])
def test_norm_cfg_builds_every_norm(norm_cfg, expected):
    """norm_cfg becomes the timm model's norm_layer at construction (no norm is rebuilt afterwards)."""
    ref = timm.create_model('lambdaresnet50', features_only=True)
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in ref.modules())
    b = build(norm_cfg=norm_cfg)
    norms = [m for m in b.modules() if isinstance(m, expected)]
    assert len(norms) == n_bn
    if expected is not nn.BatchNorm2d:
        assert not any(type(m) is nn.BatchNorm2d for m in b.modules())
    # the lambda layers' own query/value norms are converted too
    lambdas = _lambda_modules(b.body)
    assert lambdas, 'lambdaresnet50 has no lambda layer?'
    assert any(isinstance(m, expected) for lam in lambdas for m in lam.modules())
    b.train()
    out = b(torch.randn(2, 3, 64, 64))
    out[-1].mean().backward()


class _FactoryDevices(TorchDispatchMode):
    """Devices of every tensor an operator creates (a CPU build then a move shows 'cpu')."""

    def __init__(self):
        super().__init__()
        self.devices = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.devices |= {t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        return out


@pytest.mark.parametrize('norm_cfg', [dict(type='BN'), dict(type='SyncBN'), dict(type='GN', num_groups=4)])
def test_norms_are_built_on_the_target_device(norm_cfg):
    """timm passes device=/dtype= to norm_layer: the norm is made there, never on the CPU first."""
    with _FactoryDevices() as seen:
        layer = norm_layer_from_cfg(norm_cfg)(8, device='meta', dtype=torch.float16)
    assert seen.devices == {'meta'}
    assert all(t.is_meta for t in (*layer.parameters(), *layer.buffers()))
    assert layer.weight.dtype == torch.float16
    b = build(norm_cfg=norm_cfg, model_kwargs=dict(device='meta'))
    assert all(t.is_meta for t in (*b.parameters(), *b.buffers()))


def test_requires_grad_false_in_norm_cfg():
    b = build(norm_cfg=dict(type='BN', requires_grad=False))
    bn_params = [p for m in b.modules() if isinstance(m, _BatchNorm)
                 for p in m.parameters()]
    assert bn_params and not any(p.requires_grad for p in bn_params)


def test_frozen_stages_and_norm_eval_survive_syncbn_revert():
    b = build(frozen_stages=1, norm_cfg=dict(type='SyncBN'))
    # what mmengine's Runner does without a process group
    b = revert_sync_batchnorm(b)
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in b.modules())
    b.train()
    for name in ('conv1', 'bn1', 'layer1'):
        mod = b.body[name]
        assert all(not p.requires_grad for p in mod.parameters())
        assert all(not m.training for m in mod.modules()), name
    assert all(p.requires_grad for p in b.body['layer2'].parameters())
    assert b.body['layer2'].training
    before = b.body['layer1'][0].bn1.running_mean.clone()
    b(torch.randn(2, 3, 64, 64))
    assert torch.equal(before, b.body['layer1'][0].bn1.running_mean)

    b = build(norm_eval=True)
    b.train()
    assert all(not m.training for m in b.modules()
               if isinstance(m, _BatchNorm))
    assert b.body['layer3'].training  # only norms are put in eval mode


def test_with_cp_uses_timm_checkpointing_and_matches_gradients():
    torch.manual_seed(0)
    a = build(model_name='resnetrs50_nose', norm_cfg=None).eval()
    c = build(model_name='resnetrs50_nose', norm_cfg=None,
              with_cp=True).eval()
    c.load_state_dict(a.state_dict())
    assert c.body.grad_checkpointing and not a.body.grad_checkpointing
    x = torch.randn(1, 3, 64, 64)
    for m in (a, c):
        sum(o.sum() for o in m(x)).backward()
    ga = a.body['layer2'][0].conv1.weight.grad
    gc = c.body['layer2'][0].conv1.weight.grad
    torch.testing.assert_close(ga, gc, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('wrap', ['plain', 'state_dict', 'model'])
def test_pretrained_timm_checkpoint(tmp_path, wrap):
    full = timm.create_model('lambdaresnet50', num_classes=1000)
    sd = {f'module.{k}' if wrap == 'model' else k: v
          for k, v in full.state_dict().items()}
    assert any(k.endswith('fc.weight') for k in sd)
    path = tmp_path / 'timm.pth'
    torch.save(sd if wrap == 'plain' else {wrap: sd}, path)
    b = build(init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    b.init_weights()  # what mmengine's Runner calls: timm loaded the weights at construction, nothing changes
    ref = full.state_dict()
    for k, v in b.body.state_dict().items():
        torch.testing.assert_close(v, ref[k], msg=k)


@pytest.mark.parametrize('use_ema', [None, True, False])
def test_pretrained_prefers_ema_weights_as_timm(tmp_path, use_ema):
    """A timm train.py checkpoint holds 'state_dict' and 'state_dict_ema' (every recipe here trains with EMA):
    the EMA weights are loaded unless use_ema=False, as timm's own load_checkpoint does."""
    torch.manual_seed(0)
    raw = timm.create_model('lambdaresnet50', num_classes=10).state_dict()
    ema = {k: v + 1 if v.is_floating_point() else v for k, v in raw.items()}
    path = tmp_path / 'checkpoint-9.pth.tar'
    torch.save({'epoch': 9, 'arch': 'lambdaresnet50', 'state_dict': raw, 'state_dict_ema': ema}, path)
    init_cfg = dict(type='Pretrained', checkpoint=str(path))
    if use_ema is not None:
        init_cfg['use_ema'] = use_ema
    b = build(init_cfg=init_cfg)
    expected = raw if use_ema is False else ema
    for k, v in b.body.state_dict().items():
        torch.testing.assert_close(v, expected[k], msg=k)


def test_pretrained_safetensors(tmp_path):
    from safetensors.torch import save_file
    full = timm.create_model('lambdaresnet50')
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(tmp_path / 'w.safetensors'))
    b = build(init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'w.safetensors')))
    ref = full.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in b.body.state_dict().items())


def test_pretrained_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match='init_cfg.checkpoint.*missing.pth'):
        build(init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'missing.pth')))
    # a checkpoint of another architecture: keys and shapes differ
    torch.save(timm.create_model('resnet18').state_dict(), tmp_path / 'r18.pth')
    with pytest.raises(ValueError, match=rf"init_cfg.checkpoint {tmp_path / 'r18.pth'} does not match.*missing keys"):
        build(init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'r18.pth')))
    # a detector checkpoint without prefix, and a prefix that no key has
    torch.save({'state_dict': {'backbone.body.' + k: v for k, v in build().body.state_dict().items()}},
               tmp_path / 'det.pth')
    with pytest.raises(ValueError, match='is prefix set'):
        build(init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'det.pth')))
    with pytest.raises(ValueError, match="no key starts with prefix='neck.'"):
        build(init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'det.pth'), prefix='neck.'))
    # same keys, one shape differs
    sd = timm.create_model('lambdaresnet50').state_dict()
    sd['conv1.0.weight'] = sd['conv1.0.weight'][:, :2]
    torch.save(sd, tmp_path / 'shape.pth')
    with pytest.raises(ValueError, match=r"shapes of \['conv1.0.weight'\] differ"):
        build(init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'shape.pth')))
    with pytest.raises(ValueError, match='use_ema'):
        build(init_cfg=dict(type='Pretrained', checkpoint='x.pth', ema=True))
    for bad in ('', 3, ['x.pth']):
        with pytest.raises(ValueError, match='init_cfg.checkpoint must be a file path'):
            build(init_cfg=dict(type='Pretrained', checkpoint=bad))


def test_pretrained_detector_backbone_with_prefix(tmp_path):
    """prefix='backbone.' takes the backbone of a detector checkpoint (keys backbone.body.<timm key>)."""
    torch.manual_seed(0)
    trained = build()
    state = {'backbone.' + k: v for k, v in trained.state_dict().items()}
    state['neck.lateral_convs.0.conv.weight'] = torch.zeros(1)
    torch.save({'meta': {'epoch': 1}, 'state_dict': state}, tmp_path / 'det.pth')
    b = build(init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'det.pth'), prefix='backbone.'))
    ref = trained.body.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in b.body.state_dict().items())


def test_pretrained_flattened_feature_keys(tmp_path):
    """A model whose features_only wrapper renames modules (MobileNetV2: blocks.0.0 -> blocks_0.0) loads a plain
    timm checkpoint: timm loads the classification model before it wraps it."""
    full = timm.create_model('mobilenetv2_100_lambda')
    torch.save(full.state_dict(), tmp_path / 'mbv2.pth')
    b = build(model_name='mobilenetv2_100_lambda', norm_cfg=None,
              init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'mbv2.pth')))
    got = b.body.state_dict()
    assert 'blocks_0.0.conv_dw.weight' in got and 'blocks.0.0.conv_dw.weight' not in got
    for k, v in full.state_dict().items():
        parts = k.split('.')
        flat = '_'.join(parts[:2]) + '.' + '.'.join(parts[2:]) if parts[0] == 'blocks' else k
        if flat in got:
            assert torch.equal(got[flat], v), k
    assert sum(k.startswith('blocks_') for k in got) > 100


def test_unreadable_checkpoint_names_the_file(tmp_path):
    """An empty or truncated file gave torch's bare EOFError (or miniz's / safetensors' message without a path)."""
    torch.save(timm.create_model('lambdaresnet50').state_dict(), tmp_path / 'full.pth')
    data = (tmp_path / 'full.pth').read_bytes()
    torch.save({'a': torch.zeros(100)}, tmp_path / 'legacy.pth', _use_new_zipfile_serialization=False)
    files = {'empty.pth': b'', 'empty.safetensors': b'', 'truncated.pth': data[:len(data) // 2],
             'truncated_legacy.pth': (tmp_path / 'legacy.pth').read_bytes()[:300], 'garbage.safetensors': b'x' * 64}
    problems = {'empty.pth': r'is empty \(0 bytes\)', 'empty.safetensors': r'is empty \(0 bytes\)',
                'truncated.pth': 'is truncated', 'truncated_legacy.pth': 'cannot read the file as a checkpoint',
                'garbage.safetensors': 'cannot read the file as safetensors'}
    for name, content in files.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=rf'init_cfg.checkpoint.*{path}.*{problems[name]}'):
            build(init_cfg=dict(type='Pretrained', checkpoint=str(path)))


def test_checkpoint_none_trains_from_scratch():
    """dict(type='Pretrained', checkpoint=None), the configs' default, is timm's from-scratch initialisation."""
    torch.manual_seed(0)
    scratch = build(init_cfg=None).body.state_dict()
    torch.manual_seed(0)
    b = build(init_cfg=dict(type='Pretrained', checkpoint=None))
    b.init_weights()
    assert b.is_init
    for k, v in b.body.state_dict().items():
        assert torch.equal(v, scratch[k]), k


def test_backbone_1024_lambdaresnet101_cpu():
    """The paper's detection input size: 1024x1024, batch 1, eval."""
    b = build(model_name='lambdaresnet101').eval()
    with torch.no_grad():
        outs = b(torch.randn(1, 3, 1024, 1024))
    assert [tuple(o.shape[-2:]) for o in outs] == [(256, 256), (128, 128),
                                                   (64, 64), (32, 32)]
    assert all(torch.isfinite(o).all() for o in outs)


def test_is_registered_class():
    assert MODELS.get('TimmLambdaResNet') is TimmLambdaResNet


@pytest.mark.parametrize('name', ['resnet50_lambda_dli14', 'resnet50_lambda'])
def test_pretrained_through_a_model_that_has_its_own_filter(tmp_path, name):
    """resnet50_lambda(_dli14) convert d-li14/lambda.pytorch keys with their own pretrained_filter_fn; the
    backbone's key checks run after it, on the converted keys, and the weights equal timm's own load."""
    torch.save(dli14_state_dict(), tmp_path / 'dli14.pth')
    kwargs = (dict(model_kwargs=dict(position_bias=True, pool_count_include_pad=True))
              if name == 'resnet50_lambda' else {})
    b = build(model_name=name, init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'dli14.pth')), **kwargs)
    ref = timm.create_model('resnet50_lambda_dli14.in1k', pretrained=True,
                            pretrained_cfg_overlay=dict(file=str(tmp_path / 'dli14.pth'))).state_dict()
    for k, v in b.body.state_dict().items():
        torch.testing.assert_close(v, ref[k], msg=k)
