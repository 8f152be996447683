"""Small inputs: the CIFAR-10 reproduction report's model (resnet50_lambda_global32) and the CIFAR-stem
LambdaResNets (resnet26_lambda_cifar, resnet50_lambda_cifar) at 32x32: parameter counts against counts
written out from the architectures (and the report's 12.8M / 23.5M), the resolutions the lambda layers see,
stems, feature reductions, cfgs, forward and backward."""
import pytest
import timm
import torch
from torch import nn

from timm_lambda.layers import LambdaLayer
from timm_lambda.models import CifarLambdaResNet
from timm_lambda.paper import CIFAR10_MEAN, CIFAR10_REPORT, CIFAR10_STD

CIFAR_MODELS = ['resnet50_lambda_global32', 'resnet26_lambda_cifar', 'resnet50_lambda_cifar']
K, H = 16, 4  # |k|, |h|


def _count(layers, num_classes=10, stem_kernel=7, table_params=0, bn_q=2 * H * K, bn_v=lambda width, i: width // 2):
    """Parameters of a vanilla (torchvision-layout) bottleneck ResNet whose every 3x3 conv is a multi-query
    lambda layer (|k|=16, |h|=4, |u|=1, |v| = width / 4), written out block by block. ``bn_q``/``bn_v(width,
    index)`` are the parameters of the query/value batch norms of one layer; ``table_params`` the embeddings."""
    total = 3 * 64 * stem_kernel ** 2 + 2 * 64  # stem conv + BN
    inplanes, index = 64, 0
    for planes, depth in zip((64, 128, 256, 512), layers):
        for i in range(depth):
            w = planes
            total += inplanes * w + 2 * w  # conv1 + bn1
            total += w * (H * K + K + w // 4) + bn_q + bn_v(w, index)  # lambda layer: W_Q, W_K, W_V, norms
            total += 2 * w + w * 4 * planes + 2 * 4 * planes  # bn2, conv3, bn3
            if i == 0:
                total += inplanes * 4 * planes + 2 * 4 * planes  # downsample conv + BN
            inplanes, index = 4 * planes, index + 1
    return total + 2048 * num_classes + num_classes + table_params


def _params(model, embeddings=True):
    return sum(p.numel() for n, p in model.named_parameters() if embeddings or 'pos_embedding' not in n)


def test_resnet50_baseline_is_the_reports_23_5m():
    n = _params(timm.create_model('resnet50', num_classes=10))
    assert n == 23_528_522 and round(n / 1e6, 1) == CIFAR10_REPORT['params_resnet50']


def test_report_model_parameter_count():
    """12.84M; the report's 12.8M is torchsummary's count without its embedding tables (12,828,926). The same
    network without tables has 12,831,658 here: the difference is exactly the report's batch-norm layout
    (queries normalised over |k| = 2 x 16 parameters instead of 2 x |h||k|; values over the |m| context
    positions of the layer, 2|m|, instead of 2|v| channels)."""
    model = timm.create_model('resnet50_lambda_global32')
    layers = (3, 4, 6, 3)
    table = K * 15 * 15  # one shared global table: offsets of an 8x8 map (the largest a lambda layer sees)
    assert _params(model) == _count(layers, table_params=table) == 12_835_258
    ours_no_tables = _params(model, embeddings=False)
    assert ours_no_tables == _count(layers) == 12_831_658

    # the report's layers see |m| = 64 (c2 and the first c3 block), 16, 4, 1 context positions
    contexts = [64] * 3 + [64] + [16] * 3 + [16] + [4] * 5 + [4] + [1] * 2
    report = _count(layers, bn_q=2 * K, bn_v=lambda width, i: 2 * contexts[i])
    assert report == CIFAR10_REPORT['params_lambda_torchsummary'] == 12_828_926
    assert report + CIFAR10_REPORT['position_embedding_params'] == CIFAR10_REPORT['params_lambda_all']
    assert round(_params(model) / 1e6, 1) == CIFAR10_REPORT['params_lambda']
    assert abs(_params(model) / CIFAR10_REPORT['params_lambda_torchsummary'] - 1) < 0.001


def test_report_model_lambda_layers_see_8_4_2_1_and_share_one_global_table():
    model = timm.create_model('resnet50_lambda_global32').eval()
    lambdas = [m for m in model.modules() if isinstance(m, LambdaLayer)]
    assert len(lambdas) == 16 and all(m.global_scope for m in lambdas)
    assert len({id(m.pos_embedding) for m in lambdas}) == 1
    assert tuple(lambdas[0].pos_embedding.weight.shape) == (K, 1, 15, 15)
    seen = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[-1])) for m in lambdas]
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    for h in hooks:
        h.remove()
    assert sorted(set(seen), reverse=True) == list(CIFAR10_REPORT['lambda_input_sizes'])
    with torch.no_grad():
        model(torch.randn(1, 3, 24, 24))  # smaller inputs use the table's central offsets
    with pytest.raises(ValueError, match=r'^input of 64x64 px is larger than this global-scope model covers '
                                         r'\(32x32 px, from img_size=\(32, 32\)\)'):
        model(torch.randn(1, 3, 64, 64))


def test_report_model_with_a_local_scope_serves_any_size():
    model = timm.create_model('resnet50_lambda_global32', scope=23).eval()
    assert not any(m.global_scope for m in model.modules() if isinstance(m, LambdaLayer))
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 48)).shape == (1, 10)


@pytest.mark.parametrize('name,layers', [('resnet26_lambda_cifar', (2, 2, 2, 2)),
                                         ('resnet50_lambda_cifar', (3, 4, 6, 3))])
def test_cifar_stem_models(name, layers):
    model = timm.create_model(name).eval()
    assert isinstance(model, CifarLambdaResNet)
    conv1 = model.conv1
    assert isinstance(conv1, nn.Conv2d) and conv1.kernel_size == (3, 3) and conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)
    table = K * 23 * 23 * sum(layers)  # one 23x23 table per lambda layer
    assert _params(model) == _count(layers, stem_kernel=3, table_params=table)
    features = timm.create_model(name, features_only=True).eval()
    assert features.feature_info.reduction() == [1, 1, 2, 4, 8]
    with torch.no_grad():
        assert [f.shape[-1] for f in features(torch.randn(1, 3, 32, 32))] == [32, 32, 16, 8, 4]


def test_cifar_stem_global_scope_sizes_tables_for_its_resolutions():
    """A global scope behind the stride-1 stem: a stage's tables cover what its first (downsampling) layer
    sees, the previous stage's resolution: 32x32 for c2 and c3 (63x63 tables), 16 for c4, 8 for c5."""
    model = timm.create_model('resnet26_lambda_cifar', scope='global', img_size=32).eval()
    tables = [tuple(m.pos_embedding.weight.shape[-2:]) for m in model.modules() if isinstance(m, LambdaLayer)]
    assert tables == [(63, 63)] * 4 + [(31, 31)] * 2 + [(15, 15)] * 2
    with torch.no_grad():
        assert model(torch.randn(1, 3, 32, 32)).shape == (1, 10)


@pytest.mark.parametrize('name', CIFAR_MODELS)
def test_forward_backward_at_32(name):
    torch.manual_seed(0)
    model = timm.create_model(name).train()
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize('name', CIFAR_MODELS)
def test_cifar_pretrained_cfgs(name):
    cfg = timm.models.get_pretrained_cfg(name)
    assert cfg.input_size == (3, 32, 32) and cfg.num_classes == 10 and cfg.crop_pct == 1.0
    assert cfg.mean == CIFAR10_MEAN and cfg.std == CIFAR10_STD
    assert not cfg.url and not cfg.hf_hub_id and not cfg.file
    data = timm.data.resolve_data_config({}, model=timm.create_model(name))
    assert data['input_size'] == (3, 32, 32) and data['mean'] == CIFAR10_MEAN


@pytest.mark.parametrize('kw', [dict(stem_type='deep'), dict(stem_width=32), dict(replace_stem_pool=True)])
def test_cifar_stem_refuses_other_stems(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        timm.create_model('resnet26_lambda_cifar', **kw)


@pytest.mark.parametrize('norm_layer', ['groupnorm1', 'layernorm2d', 'batchnorm2d'])
def test_cifar_models_take_any_norm_layer_timm_accepts(norm_layer):
    """GroupNorm1 gives per-sample gradients (docs/small_inputs.md); the stem used to read bn1.num_features."""
    model = timm.create_model('resnet26_lambda_cifar', norm_layer=norm_layer, num_classes=3)
    assert model.conv1.out_channels == 64 and model.conv1.kernel_size == (3, 3)
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 3)
    out.sum().backward()


@pytest.mark.filterwarnings('ignore::FutureWarning', 'ignore::RuntimeWarning', 'ignore::UserWarning')
def test_report_model_traced_or_scripted_refuses_a_larger_input_as_eager_mode_does():
    """A jit.trace keeps tensor ops only: the model's size check is then an operator of the graph
    (``timm_lambda::checked_input_size``), so a traced model that meets a larger input raises eager mode's message
    (in TorchScript's RuntimeError), not an index error from deep inside a layer; a scripted model runs the check
    itself. Both still serve the sizes the table covers."""
    model = timm.create_model('resnet50_lambda_global32').eval()
    with torch.no_grad():
        traced = torch.jit.trace(model, torch.randn(1, 3, 32, 32))
        scripted = torch.jit.script(model)
        message = (r'input of 64x48 px is larger than this global-scope model covers \(32x32 px, from '
                   r'img_size=\(32, 32\)\): create it with img_size=\(H, W\) of the largest input')
        for run in (traced, scripted):
            with pytest.raises(Exception, match=message) as e:
                run(torch.randn(1, 3, 64, 48))
            assert 'index out of range' not in str(e.value)
            assert run(torch.randn(2, 3, 24, 24)).shape == (2, 10)
            x = torch.randn(1, 3, 32, 32)
            torch.testing.assert_close(run(x), model(x))
