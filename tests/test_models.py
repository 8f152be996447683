"""LambdaResNet family: architecture fidelity (appendix F.2, Table 19), the paper's parameter
counts (Tables 3, 8, 12, 13, 15, 17) and timm integration (features, cfgs, weight loading)."""
import functools
import pickle

import pytest
import timm
import torch
from timm.layers import BlurPool2d, SEModule
from timm.models import save_for_hf
from timm.models.resnet import BasicBlock, Bottleneck
from torch import nn

from _timm_suite_filters import excluded_models
from timm_lambda import registered_models
from timm_lambda._compat import parse_version
from timm_lambda.layers import AugmentedConv2d, AxialSelfAttention2d, LambdaLayer, LocalSelfAttention2d
from timm_lambda.paper import LAMBDA_BLOCKS, PARAM_COUNTS, STAGE_DEPTHS

DEPTHS = sorted(STAGE_DEPTHS)
ALL_NAMES = ([f'lambdaresnet{d}' for d in DEPTHS] + [f'lambdaresnet{d}_c4' for d in DEPTHS]
             + [f'resnetrs{d}_nose' for d in DEPTHS]
             + ['resnet50_lambda', 'resnet50_lambda_u4', 'mobilenetv2_100_lambda'])
# Forward and backward of every registered model (finite outputs, a gradient for every parameter) are timm's own
# model tests, run on our models by tests/test_timm_suite.py; the deepest models, which it leaves out as timm's CI
# does (tests/_timm_suite_filters.py), get the same checks here: test_deepest_models_forward_backward.


@functools.lru_cache(maxsize=None)
def _num_params(name: str, **kwargs) -> float:
    model = timm.create_model(name, **kwargs)
    return sum(p.numel() for p in model.parameters()) / 1e6


def _is_lambda(block) -> bool:
    return isinstance(getattr(block, 'conv2', None), LambdaLayer)


def test_every_name_is_registered_with_a_pretrained_cfg():
    for name in ALL_NAMES:
        assert timm.is_model(name), name
        cfg = timm.models.get_pretrained_cfg(name)
        assert cfg is not None and cfg.input_size[1] >= 128, name
        # no invented weight locations
        assert not cfg.url and not cfg.hf_hub_id, name


# Paper parameter counts (millions) and where they come from: timm_lambda.paper.PARAM_COUNTS.
PAPER_PARAMS = [(name, {}, millions) for name, (millions, _) in PARAM_COUNTS.items()]


@pytest.mark.parametrize('name,kwargs,paper', PAPER_PARAMS, ids=[p[0] for p in PAPER_PARAMS])
def test_parameter_counts_match_paper(name, kwargs, paper):
    assert _num_params(name, **kwargs) == pytest.approx(paper, rel=0.02)


# Table 12: lambda (L) / convolution (C) placement in a vanilla ResNet-50, and Table 8 (|k|, |h|, |u|).
TABLE12 = [('LCCC', 25.5), ('LLCC', 25.0), ('LLLC', 21.7), ('LLLL', 15.0), ('CLLL', 15.1), ('CCLL', 15.4),
           ('CCCL', 18.8)]


@pytest.mark.parametrize('placement,paper', TABLE12)
def test_table12_hybrid_placements(placement, paper):
    blocks = tuple('all' if c == 'L' else None for c in placement)
    assert _num_params('resnet50_lambda', lambda_blocks=blocks) == pytest.approx(paper, rel=0.02)


TABLE8 = [(8, 2, 1, 14.8), (2, 4, 1, 14.7), (4, 4, 1, 14.7), (8, 4, 1, 14.8), (16, 4, 1, 15.0), (32, 4, 1, 15.4),
          (2, 8, 1, 14.7), (4, 8, 1, 14.7), (8, 8, 1, 14.7), (16, 8, 1, 15.1), (32, 8, 1, 15.7), (8, 8, 4, 15.3),
          (8, 8, 8, 16.0), (16, 4, 4, 16.0)]


@pytest.mark.parametrize('dim_k,heads,dim_u,paper', TABLE8)
def test_table8_hyperparameters(dim_k, heads, dim_u, paper):
    # Table 8 rows; F.2: |u| > 1 runs with a 7x7 scope.
    scope = 7 if dim_u > 1 else 23
    n = _num_params('resnet50_lambda', dim_k=dim_k, heads=heads, dim_u=dim_u, scope=scope)
    assert n == pytest.approx(paper, rel=0.02)


def test_table8_row_k8_h16_is_inconsistent_in_the_paper():
    """Table 8 lists |k|=8, |h|=16 at 15.6M, above |k|=16, |h|=8 at 15.1M; yet it has the same
    query projection (|k||h| = 128), a smaller key projection, half the values and half the
    embeddings, so it must have fewer parameters. We reproduce 14.9M (documented in README)."""
    small = _num_params('resnet50_lambda', dim_k=8, heads=16)
    assert small < _num_params('resnet50_lambda', dim_k=16, heads=8) < 15.6
    assert small == pytest.approx(14.9, abs=0.05)


def test_literal_se_reading_is_off_the_paper():
    """SE in every conv bottleneck (se_stages c2..c5) misses 36.9M by far: why c2/c3 is the default."""
    assert _num_params('lambdaresnet101', se_stages=(0, 1, 2, 3)) > 36.9 * 1.2


@pytest.mark.parametrize('depth', [50, 101, 152, 420])
def test_table19_lambda_positions_and_se(depth):
    model = timm.create_model(f'lambdaresnet{depth}')
    stages = [model.layer1, model.layer2, model.layer3, model.layer4]
    assert tuple(len(s) for s in stages) == STAGE_DEPTHS[depth]
    assert [i + 1 for i, b in enumerate(model.layer3) if _is_lambda(b)] == list(LAMBDA_BLOCKS[depth])
    assert all(_is_lambda(b) for b in model.layer4)
    assert not any(_is_lambda(b) for b in list(model.layer1) + list(model.layer2))
    for stage_idx, stage in enumerate(stages):
        for blk in stage:
            # timm's Bottleneck (its forward, names and zero_init_last), a subclass where a lambda layer replaced conv2
            assert isinstance(blk, Bottleneck) and (type(blk) is Bottleneck) != _is_lambda(blk)
            if _is_lambda(blk):
                assert blk.se is None  # no SE in lambda bottlenecks (F.2)
                lam = blk.conv2
                assert (lam.dim_k, lam.heads, lam.dim_u, lam.scope) == (16, 4, 1, (23, 23))
            elif stage_idx < 2:
                assert isinstance(blk.se, SEModule)
                assert blk.se.fc1.out_channels == blk.conv3.out_channels // 4  # squeeze ratio 4
            else:
                assert blk.se is None
            # last BN gamma of every bottleneck starts at zero (F.2)
            assert torch.count_nonzero(blk.bn3.weight) == 0


def test_resnet_rs_base():
    """ResNet-D shortcuts, deep stem, stem max pool replaced by a strided 3x3 conv (F.2)."""
    model = timm.create_model('lambdaresnet101')
    assert isinstance(model.conv1, nn.Sequential)
    pool = model.maxpool
    assert isinstance(pool, nn.Sequential) and isinstance(pool[0], nn.Conv2d) and pool[0].stride == (2, 2)
    assert isinstance(model.layer2[0].downsample[0], nn.AvgPool2d)
    down = [b for b in model.layer4 if b.conv2.stride == 2]
    assert len(down) == 1 and isinstance(down[0].conv2.pool, nn.AvgPool2d)
    assert down[0].conv2.pool.kernel_size == 3 and down[0].conv2.pool.stride == 2


def test_c4_variant_replaces_every_c4_c5_conv():
    model = timm.create_model('lambdaresnet101_c4')
    assert all(_is_lambda(b) for b in list(model.layer3) + list(model.layer4))
    assert not any(_is_lambda(b) for b in list(model.layer1) + list(model.layer2))


def test_vanilla_resnet50_lambda_has_plain_stem():
    model = timm.create_model('resnet50_lambda')
    assert isinstance(model.conv1, nn.Conv2d) and model.conv1.kernel_size == (7, 7)
    assert isinstance(model.maxpool, nn.MaxPool2d)
    assert all(_is_lambda(b) for s in (model.layer1, model.layer2, model.layer3, model.layer4) for b in s)


def test_study_kwargs_reach_the_layers():
    model = timm.create_model('lambdaresnet50', dim_k=8, heads=2, dim_u=2, scope=7, form='conv',
                              key_norm='l2', se_stages=(), shared_embeddings=True)
    lams = [b.conv2 for b in model.modules() if _is_lambda(b)]
    assert len(lams) == 4
    assert {(m.dim_k, m.heads, m.dim_u, m.scope, m.form, m.key_norm) for m in lams} == {(8, 2, 2, (7, 7), 'conv', 'l2')}
    assert len({id(m.pos_embedding) for m in lams}) == 1
    assert not any(isinstance(m, SEModule) for m in model.modules())
    out = model(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 1000)


def test_global_scope_model_needs_img_size():
    with pytest.raises(ValueError, match='img_size'):
        timm.create_model('lambdaresnet50', scope='global')
    model = timm.create_model('lambdaresnet50', scope='global', img_size=64).eval()
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 1000)
    with pytest.raises(ValueError) as e:
        model(torch.randn(1, 3, 96, 80))
    assert str(e.value).startswith('input of 96x80 px is larger than this global-scope model covers (64x64 px, from '
                                   'img_size=(64, 64)): create it with img_size=(H, W) of the largest input')


@pytest.mark.parametrize('name, kw, img_size', [
    ('lambdaresnet50', dict(output_stride=16, lambda_blocks=(None, None, (2,), 'all')), (100, 60)),
    ('lambdaresnet50_c4', {}, (64, 70)),
    ('resnet50_lambda', dict(output_stride=8), (40, 33)),
    ('resnet50_lambda_global32', {}, (17, 20)),
])
def test_global_scope_model_refuses_exactly_what_its_tables_do_not_cover(name, kw, img_size):
    """The model's check (naming the image size, issue 39) refuses an input exactly where a lambda layer's table
    check (naming its feature map) would: the largest covered input, and one pixel more in either direction."""
    small = {} if name.endswith('global32') else dict(channels=(8, 16, 32, 64), stem_width=8)
    model = timm.create_model(name, num_classes=3, scope='global', img_size=img_size, layers=(1, 1, 2, 1), dim_k=4,
                              heads=2, **small, **kw).eval()
    lh, lw = model.max_input_size
    assert lh >= img_size[0] and lw >= img_size[1]
    for hw in [(lh, lw), (lh + 1, lw), (lh, lw + 1)]:
        refused = []
        for check in (model.max_input_size, None):  # the model's check, then the layers' alone
            model.max_input_size = check
            try:
                with torch.no_grad():
                    model(torch.randn(1, 3, *hw))
                refused.append(False)
            except ValueError as e:
                refused.append(str(e).split(' ')[2] if check else str(e).split(' ')[-1] != '')
            model.max_input_size = (lh, lw)
        assert refused == ([False, False] if hw == (lh, lw) else [f'{hw[0]}x{hw[1]}', True]), (hw, refused)


def _projection(layer: nn.Module):
    """The projection weight a layer initialises itself (F.2 for lambda layers: W_K, W_V ~ N(0, d^-1/2); timm's
    attention layers: trunc_normal(fan_in^-1/2) on q/k/v) and that std."""
    if isinstance(layer, LambdaLayer):
        return layer.qkv.weight[layer.heads * layer.dim_k:], layer.dim ** -0.5
    if isinstance(layer, AugmentedConv2d):
        layer = layer.attn
    elif isinstance(layer, AxialSelfAttention2d):
        layer = layer.height_attn
    w = (layer.q if isinstance(layer, LocalSelfAttention2d) else layer.qkv).weight
    return w, w.shape[1] ** -0.5


@pytest.mark.parametrize('name,kwargs', [
    ('resnet50_lambda', {}),
    ('aa_resnet34', dict(kappa=0.1, upsilon=0.1)),
    ('aa_resnet50', {}),
    ('resnet50_global_attn', dict(img_size=64)),
    ('resnet50_axial_attn', dict(img_size=64, qk_ratio=1.0)),
    ('resnet50_local_attn7', {}),
])
def test_init_weights_gives_the_layers_their_own_init_after_timms(name, kwargs):
    """timm's ResNet.init_weights draws every Conv2d from kaiming_normal(fan_out); each block's lambda or
    attention layer then re-draws its projections with its own init, at construction and on a later
    ``init_weights()``."""
    model = timm.create_model(name, layers=(1, 1, 1, 1), **kwargs)
    for _ in range(2):
        blocks = [b for b in model.modules() if type(b) not in (Bottleneck, BasicBlock)
                  and isinstance(b, (Bottleneck, BasicBlock))]
        assert len(blocks) >= 3
        for blk in blocks:
            w, std = _projection(blk.conv1 if isinstance(blk, BasicBlock) else blk.conv2)
            kaiming = (2 / w.shape[0]) ** 0.5  # 1x1 convolutions: fan_out = output channels
            assert abs(std - kaiming) > 0.1 * std  # the two inits are told apart
            assert w.std().item() == pytest.approx(std, rel=0.05), (name, blk)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        model.init_weights()


@pytest.mark.parametrize('kwargs', [dict(aa_layer=BlurPool2d), dict(cardinality=32, base_width=4)])
def test_blocks_with_a_lambda_layer_refuse_grouped_or_anti_aliased_convolutions(kwargs):
    with pytest.raises(ValueError, match='cardinality=1, no aa_layer'):
        timm.create_model('resnet50_lambda', layers=(1, 1, 1, 1), **kwargs)


def test_bad_lambda_blocks_are_rejected():
    with pytest.raises(ValueError, match='lambda_blocks'):
        timm.create_model('lambdaresnet50', lambda_blocks=(None, None, (7,), 'all'))
    with pytest.raises(ValueError, match='se_stages'):
        timm.create_model('lambdaresnet50', se_stages=(4,))


def test_default_resolutions_follow_table18():
    expected = {'lambdaresnet50': 160, 'lambdaresnet101': 192, 'lambdaresnet152': 256, 'lambdaresnet270': 256,
                'lambdaresnet350': 320, 'lambdaresnet420': 320, 'lambdaresnet101_c4': 224}
    for name, res in expected.items():
        model = timm.create_model(name)
        cfg = timm.data.resolve_data_config({}, model=model)
        assert cfg['input_size'] == (3, res, res), name
        # evaluated at the training resolution (F.1): timm's test-time input size is the same
        assert timm.data.resolve_data_config({}, model=model, use_test_size=True)['input_size'] == (3, res, res)
        assert model.pretrained_cfg['first_conv'] == 'conv1.0' and model.pretrained_cfg['classifier'] == 'fc'
    tags = {n.split('.')[1] for n in timm.list_models('lambdaresnet152', pretrained=False, include_tags=True)
            if '.' in n} | set(timm.models.get_arch_pretrained_cfgs('lambdaresnet152'))
    assert {'r192', 'r224', 'r256'} <= tags


@pytest.fixture(scope='module')
def small_model():
    torch.manual_seed(0)
    return timm.create_model('lambdaresnet50', num_classes=10).eval()


def test_features_only_shapes_and_reductions():
    model = timm.create_model('lambdaresnet101', features_only=True).eval()
    assert model.feature_info.reduction() == [2, 4, 8, 16, 32]
    assert model.feature_info.channels() == [64, 256, 512, 1024, 2048]
    feats = model(torch.randn(1, 3, 96, 64))
    assert [f.shape[-2:] for f in feats] == [(48, 32), (24, 16), (12, 8), (6, 4), (3, 2)]
    sub = timm.create_model('lambdaresnet50', features_only=True, out_indices=(1, 2, 3, 4))
    assert sub.feature_info.reduction() == [4, 8, 16, 32]


def test_forward_api(small_model):
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        feats = small_model.forward_features(x)
        assert feats.shape == (2, 2048, 2, 2)
        logits = small_model.forward_head(feats)
        assert torch.allclose(logits, small_model(x))
        assert small_model.forward_head(feats, pre_logits=True).shape == (2, 2048)
        inter = small_model.forward_intermediates(x, indices=(1, 3), intermediates_only=True)
        assert [t.shape[1] for t in inter] == [256, 1024]
    model = timm.create_model('lambdaresnet50', num_classes=10)
    model.reset_classifier(3)
    assert model(x).shape == (2, 3)


def test_grad_checkpointing_matches():
    torch.manual_seed(0)
    model = timm.create_model('lambdaresnet50', num_classes=4)
    x = torch.randn(2, 3, 64, 64)
    ref = model(x)
    ref.sum().backward()
    g_ref = model.layer4[0].conv2.qkv.weight.grad.clone()
    model.zero_grad()
    model.set_grad_checkpointing(True)
    out = model(x)
    out.sum().backward()
    # BN running stats are updated twice with checkpointing; outputs in train mode are unaffected
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.allclose(model.layer4[0].conv2.qkv.weight.grad, g_ref, atol=1e-4, rtol=1e-4)


def test_weights_round_trip_through_timm_machinery(small_model, tmp_path):
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        ref = small_model(x)
    path = tmp_path / 'lambdaresnet50.pth'
    torch.save(small_model.state_dict(), path)
    loaded = [
        timm.create_model('lambdaresnet50', pretrained=True, num_classes=10,
                          pretrained_cfg_overlay=dict(file=str(path), num_classes=10)),
        timm.create_model('lambdaresnet50', num_classes=10, checkpoint_path=str(path)),
    ]
    save_for_hf(small_model, tmp_path / 'hf', safe_serialization='both')
    loaded.append(timm.create_model(f'local-dir:{tmp_path / "hf"}', pretrained=True))
    for model in loaded:
        with torch.no_grad():
            assert torch.equal(model.eval()(x), ref)


def test_shared_embeddings_saved_once(tmp_path):
    model = timm.create_model('lambdaresnet50', shared_embeddings=True, num_classes=5).eval()
    keys = [k for k in model.state_dict() if 'pos_embedding' in k]
    assert len(keys) == 1
    save_for_hf(model, tmp_path, model_args=dict(shared_embeddings=True), safe_serialization=True)
    if parse_version(timm.__version__) >= (1, 0, 26):
        again = timm.create_model(f'local-dir:{tmp_path}', pretrained=True).eval()
    else:  # timm < 1.0.26 reads a local-dir: checkpoint with torch.load, which cannot read safetensors (any model)
        with pytest.raises(pickle.UnpicklingError):
            timm.create_model(f'local-dir:{tmp_path}', pretrained=True)
        overlay = dict(file=str(tmp_path / 'model.safetensors'), num_classes=5)
        again = timm.create_model('lambdaresnet50', shared_embeddings=True, num_classes=5, pretrained=True,
                                  pretrained_cfg_overlay=overlay).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


def test_pretrained_without_weights_fails_clearly():
    with pytest.raises(RuntimeError, match='(?i)no pretrained weights'):
        timm.create_model('lambdaresnet101', pretrained=True)


@pytest.mark.slow
@pytest.mark.parametrize('name', excluded_models(registered_models()))
def test_deepest_models_forward_backward(name):
    """timm's test_model_forward and test_model_backward on the models tests/test_timm_suite.py leaves out (as timm's
    CI leaves out its deepest ResNet-RS models), at 64 px: finite outputs, grad checkpointing changes no output, a
    gradient for every parameter."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=42).eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        out = model(x[:1])
        assert out.shape == (1, 42) and torch.isfinite(out).all()
        model.set_grad_checkpointing()
        torch.testing.assert_close(model(x[:1]), out, rtol=1e-4, atol=1e-5)
    model.set_grad_checkpointing(False)
    model.train()
    out = model(x)
    out.mean().backward()
    assert out.shape == (2, 42) and torch.isfinite(out).all()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing
