"""d-li14/lambda.pytorch's ImageNet LambdaResNet-50 through timm: the two conventions as LambdaLayer options
(position-lambda bias, padding-counted stride-2 pooling) against the naive float64 reference, the key
conversion on a state_dict with their exact key names and shapes, loading through
``timm.create_model('resnet50_lambda_dli14.in1k', pretrained=True, pretrained_cfg_overlay=dict(file=PATH))``
(and through the deprecated tag ``resnet50_lambda.dli14_in1k``, which builds the same architecture), and the
converted model against an independent float64 forward of their network (tests/reference.py).

Their key names and shapes: ``dli14_state_dict`` (tests/_helpers.py) writes them from their published model definition
(github.com/d-li14/lambda.pytorch, commit 646de55: torchvision's ResNet-50 v1.5 layout whose ``conv2`` is
their LambdaLayer with ``conv_qkv``, ``norm_q``, ``norm_v`` and ``lambda_conv = Conv3d(du, dk, (1, 23, 23))``
with bias); tests/fixtures/dli14_lambda_resnet50_state_dict.txt is the list their code itself produces
(instantiated once outside this repository), which the first test compares it with.
"""
import warnings
from pathlib import Path

import pytest
import timm
import torch

from _helpers import dli14_state_dict, rel_err
from _layer_helpers import perturb_for_eval
from reference import dli14_lambda_reference, dli14_resnet_reference, lambda_layer_reference
from timm_lambda.layers import LambdaLayer
from timm_lambda.models.lambda_resnet import DLI14_MODEL_ARGS, checkpoint_filter_dli14

FORMS = ['einsum', 'conv', 'dense', 'tiled']
MANIFEST = Path(__file__).parent / 'fixtures' / 'dli14_lambda_resnet50_state_dict.txt'
NAMED = 'resnet50_lambda_dli14.in1k'  # the architecture by its name, the weights by their tag
TAGGED = 'resnet50_lambda.dli14_in1k'  # deprecated: a tag of resnet50_lambda that switched the architecture
TAGS = {NAMED: 'in1k', TAGGED: 'dli14_in1k'}


def _create(name, **kwargs):
    """timm.create_model; the deprecated tag must warn."""
    if name != TAGGED:
        return timm.create_model(name, **kwargs)
    with pytest.warns(DeprecationWarning, match='resnet50_lambda_dli14.in1k'):
        return timm.create_model(name, **kwargs)


# --- the two options on the layer -------------------------------------------------------------------

def _layer(form, seed=0, **kw) -> LambdaLayer:
    """A small layer with non-trivial BN statistics, a shrunken table and an O(1) position bias."""
    torch.manual_seed(seed)
    kw = {'dim': 8, 'dim_k': 4, 'heads': 2, **kw}
    layer = LambdaLayer(form=form, **kw)
    g = torch.Generator().manual_seed(seed)
    perturb_for_eval(layer, g)
    with torch.no_grad():
        if layer.pos_bias is not None:
            layer.pos_bias.copy_(torch.rand(layer.dim_k, generator=g) * 2 - 1)
    return layer.eval()


OPTION_CASES = [
    ('bias_local', dict(scope=3, position_bias=True), (2, 8, 5, 7)),
    ('bias_content_off', dict(scope=5, position_bias=True, content=False), (2, 8, 4, 6)),
    ('bias_global_u2', dict(scope='global', max_size=(6, 7), dim_u=2, position_bias=True), (2, 8, 5, 7)),
    ('countpad_stride2_odd', dict(scope=3, stride=2, pool_count_include_pad=True), (2, 8, 5, 7)),
    ('countpad_stride2_even', dict(scope=5, stride=2, pool_count_include_pad=True), (2, 8, 6, 4)),
    ('countpad_stride2_1x1', dict(scope=3, stride=2, pool_count_include_pad=True), (2, 8, 1, 1)),
    ('both_stride2_u2', dict(scope=5, dim_u=2, stride=2, position_bias=True, pool_count_include_pad=True),
     (2, 8, 7, 3)),
    ('both_lambdaresnet_defaults', dict(dim=16, dim_k=16, heads=4, position_bias=True, stride=2,
                                        pool_count_include_pad=True), (1, 16, 12, 9)),
]


@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('name,kw,shape', OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
def test_options_match_naive_reference(name, kw, shape, form):
    layer = _layer(form, **kw)
    assert layer.choose_form(*shape[2:]) == form
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    ref = lambda_layer_reference(layer, x)
    assert ref.abs().max() > 0.05
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5)


def test_reference_sees_both_options():
    """The two options change the output (so the comparisons above are not vacuous): dropping the bias or
    switching the pooling back changes the reference by far more than the tolerance."""
    x = torch.randn(2, 8, 5, 7, generator=torch.Generator().manual_seed(1))
    both = _layer('einsum', scope=3, stride=2, position_bias=True, pool_count_include_pad=True)
    ref = lambda_layer_reference(both, x)
    no_bias = _layer('einsum', scope=3, stride=2, pool_count_include_pad=True)
    no_pad = _layer('einsum', scope=3, stride=2, position_bias=True)
    for other in (no_bias, no_pad):
        assert (lambda_layer_reference(other, x) - ref).abs().max() > 0.05
    # at stride 2 only the border windows (partly outside the 5x7 input) differ between the two poolings
    inner = (lambda_layer_reference(no_pad, x) - ref)[..., 1:-1, 1:-1]
    assert inner.abs().max() < 1e-12


def test_defaults_unchanged():
    layer = LambdaLayer(8, dim_k=4, heads=2, stride=2)
    assert layer.pos_bias is None and 'pos_bias' not in layer.state_dict()
    assert layer.pool.count_include_pad is False
    assert sum(p.numel() for p in timm.create_model('resnet50_lambda').parameters()) == 14_995_592


@pytest.mark.parametrize('form', FORMS)
def test_position_bias_gradient(form):
    torch.manual_seed(0)
    layer = LambdaLayer(4, dim_k=2, heads=2, scope=3, stride=2, form=form, position_bias=True,
                       pool_count_include_pad=True).double().train()
    x = torch.randn(2, 4, 3, 4, dtype=torch.float64, requires_grad=True)
    names = ['pos_bias', 'pos_embedding.weight', 'qkv.weight']
    params = {n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters() if n in names}

    def fn(x, *ps):
        return torch.func.functional_call(layer, dict(zip(params, ps)), (x,))

    assert torch.autograd.gradcheck(fn, (x, *params.values()), eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)


def test_position_bias_init_like_conv3d_bias():
    """PyTorch's Conv3d(u, k, (1, r, r)) bias init: U(-a, a) with a = (u r^2)^-1/2."""
    torch.manual_seed(0)
    layer = LambdaLayer(64, dim_k=512, heads=4, dim_u=2, scope=7, position_bias=True)
    bound = (2 * 7 * 7) ** -0.5
    b = layer.pos_bias.detach()
    assert b.abs().max() <= bound and b.abs().max() > 0.9 * bound and abs(b.mean()) < 0.1 * bound


@pytest.mark.parametrize('kw,name', [
    (dict(position_bias=1), 'position_bias'),
    (dict(pool_count_include_pad='yes'), 'pool_count_include_pad'),
    (dict(position_bias=True, position=False), 'position_bias'),
])
def test_bad_option_values_name_the_parameter(kw, name):
    with pytest.raises(ValueError, match=name):
        LambdaLayer(8, dim_k=4, heads=2, **kw)


def _tiny_dli14(name=NAMED, **kw):
    torch.manual_seed(0)
    model = _create(name, layers=(1, 1, 1, 1), num_classes=5, **kw).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LambdaLayer):
                m.pos_bias.uniform_(-1, 1)
    return model


def test_options_under_torchscript_fx_and_trace():
    """scriptable model + torch.jit.script, FX symbolic trace, and a trace at one size run at another."""
    with timm.layers.set_layer_config(scriptable=True):
        model = _tiny_dli14()
    x = torch.randn(2, 3, 96, 80)
    with torch.no_grad():
        ref = model(x)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            scripted = torch.jit.script(model)
            traced = torch.jit.trace(model, torch.randn(1, 3, 64, 64), check_trace=False)
        gm = torch.fx.symbolic_trace(model)
        for out in (scripted(x), traced(x), gm(x)):
            assert rel_err(out, ref) < 1e-5


def test_options_in_onnx_export(tmp_path):
    model = _tiny_dli14()
    path = tmp_path / 'dli14.onnx'
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        torch.onnx.export(model, (torch.randn(1, 3, 64, 64),), str(path), dynamo=False, input_names=['x'],
                          opset_version=17, dynamic_axes={'x': {0: 'batch', 2: 'height', 3: 'width'}})
    import onnxruntime as ort
    session = ort.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    x = torch.randn(2, 3, 96, 72)
    with torch.no_grad():
        ref = model(x)
    assert rel_err(torch.from_numpy(session.run(None, {'x': x.numpy()})[0]), ref) < 1e-4


# --- their state_dict ------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def peer_sd():
    return dli14_state_dict()


def test_state_dict_has_their_exact_keys_and_shapes(peer_sd):
    rows = [line.split() for line in MANIFEST.read_text().splitlines() if not line.startswith('#')]
    theirs = [(key, dtype, tuple(int(s) for s in shape.split('x')) if shape != '-' else ()) for key, dtype, shape
              in rows]
    ours = [(key, str(t.dtype).replace('torch.', ''), tuple(t.shape)) for key, t in peer_sd.items()]
    assert ours == theirs
    params = sum(t.numel() for key, t in peer_sd.items() if 'running_' not in key and 'num_batches' not in key)
    assert params == 14_995_848  # their README: 14.995M
    model = timm.create_model(NAMED)
    assert sum(p.numel() for p in model.parameters()) == params


def _wrapped(sd):
    """What a DataParallel training script saves (the PyTorch ImageNet example's checkpoint dict)."""
    return {'epoch': 130, 'arch': 'lambda_resnet50', 'best_acc1': torch.tensor(78.208),
            'state_dict': {'module.' + k: v for k, v in sd.items()}}


@pytest.mark.parametrize('wrap', ['plain', 'module_prefix', 'state_dict', 'model'])
def test_filter_converts_their_keys(peer_sd, wrap):
    src = {'plain': peer_sd, 'module_prefix': {'module.' + k: v for k, v in peer_sd.items()},
           'state_dict': _wrapped(peer_sd), 'model': {'model': peer_sd, 'epoch': 3}}[wrap]
    model = timm.create_model(NAMED)
    converted = checkpoint_filter_dli14(src, model)
    model.load_state_dict(converted, strict=True)
    ours = model.state_dict()
    assert set(ours) == set(converted)
    for key, value in peer_sd.items():
        if key.endswith('lambda_conv.weight'):
            assert torch.equal(ours[key.replace('lambda_conv.weight', 'pos_embedding.weight')], value[:, :, 0])
        elif key.endswith('lambda_conv.bias'):
            assert torch.equal(ours[key.replace('lambda_conv.bias', 'pos_bias')], value)
        else:
            assert torch.equal(ours[key.replace('conv_qkv', 'qkv')], value), key


def test_filter_passes_our_own_checkpoints_through():
    model = timm.create_model(NAMED, layers=(1, 1, 1, 1), num_classes=5)
    sd = model.state_dict()
    out = checkpoint_filter_dli14(dict(sd), model)
    assert list(out) == list(sd) and all(out[k] is sd[k] for k in sd)


@pytest.fixture(scope='module')
def peer_file(tmp_path_factory, peer_sd):
    path = tmp_path_factory.mktemp('dli14') / 'lambda_resnet50.pth.tar'
    torch.save(_wrapped(peer_sd), path)
    return str(path)


@pytest.fixture(scope='module', params=[NAMED, TAGGED])
def loaded(request, peer_file):
    return _create(request.param, pretrained=True, pretrained_cfg_overlay=dict(file=peer_file)).eval()


def test_create_model_loads_their_file(loaded, peer_sd):
    cfg = loaded.pretrained_cfg
    name = f"{cfg['architecture']}.{cfg['tag']}"
    assert cfg['tag'] == TAGS[name] and cfg['origin_url'] == 'https://github.com/d-li14/lambda.pytorch'
    assert cfg['input_size'] == (3, 224, 224) and cfg['num_classes'] == 1000 and not cfg.get('url')
    layers = [m for m in loaded.modules() if isinstance(m, LambdaLayer)]
    assert len(layers) == 16 and all(m.pos_bias is not None for m in layers)
    assert all(m.pool.count_include_pad for m in layers if m.stride == 2)
    assert torch.equal(loaded.layer3[2].conv2.pos_bias, peer_sd['layer3.2.conv2.lambda_conv.bias'])
    assert torch.equal(loaded.fc.weight, peer_sd['fc.weight'])


def test_loaded_model_reproduces_their_network(loaded, peer_sd):
    """Our converted model against the float64 forward of their network (tests/reference.py), in float64
    (to rounding) and as loaded, in float32."""
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    ref = dli14_resnet_reference(peer_sd, x)
    assert ref.abs().max() > 0.5 and ref.std() > 0.1
    with torch.no_grad():
        out32 = loaded(x)
        name = f"{loaded.pretrained_cfg['architecture']}.{loaded.pretrained_cfg['tag']}"
        model64 = _create(name, pretrained=True, pretrained_cfg_overlay=dict(state_dict=peer_sd))
        out64 = model64.double().eval()(x.double())
    assert rel_err(out64, ref) < 1e-10
    assert rel_err(out32, ref) < 1e-4


def test_their_conventions_matter_for_the_outputs(peer_sd):
    """Built without either convention (weights otherwise equal), the model misses their outputs: the
    comparison above can fail."""
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    ref = dli14_resnet_reference(peer_sd, x)
    converted = checkpoint_filter_dli14(peer_sd)
    for kwargs in (dict(position_bias=False), dict(pool_count_include_pad=False)):
        model = timm.create_model(NAMED, **kwargs).eval()
        model.load_state_dict(converted, strict=False)
        with torch.no_grad():
            assert rel_err(model(x), ref) > 1e-2, kwargs


def test_layer_reference_of_their_conventions_matches_ours(loaded, peer_sd):
    """Layer by layer: our converted stride-2 lambda layer against the per-query reference written from their
    conv3d-with-bias + count_include_pad definition."""
    x = torch.randn(2, 256, 9, 7, generator=torch.Generator().manual_seed(3))
    ref = dli14_lambda_reference(peer_sd, 'layer3.0.conv2.', x, stride=2)
    with torch.no_grad():
        out = loaded.layer3[0].conv2(x)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_fine_tuning_from_their_weights_drops_only_the_head(peer_file, peer_sd):
    model = timm.create_model(NAMED, pretrained=True, num_classes=10, pretrained_cfg_overlay=dict(file=peer_file))
    assert model.fc.out_features == 10
    assert torch.equal(model.layer4[2].conv2.qkv.weight, peer_sd['layer4.2.conv2.conv_qkv.weight'])


@pytest.mark.parametrize('name', [NAMED, TAGGED])
def test_tagged_model_round_trips_through_save_for_hf(tmp_path, name):
    """timm's save_for_hf keeps the architecture (and the tag) in config.json, so local-dir: rebuilds the model
    with both conventions."""
    from timm.models import save_for_hf
    model = _tiny_dli14(name)
    save_for_hf(model, tmp_path, model_args=dict(layers=(1, 1, 1, 1), num_classes=5))
    with pytest.warns(DeprecationWarning) if name == TAGGED else warnings.catch_warnings():  # the tag, again
        again = timm.create_model(f'local-dir:{tmp_path}', pretrained=True).eval()
    assert again.layer2[0].conv2.pos_bias is not None and again.layer2[0].conv2.pool.count_include_pad
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(again(x), model(x))


def test_their_checkpoint_into_the_default_model_is_refused(peer_file):
    with pytest.raises(ValueError, match='dli14_in1k') as info:
        timm.create_model('resnet50_lambda', pretrained=True, pretrained_cfg_overlay=dict(file=peer_file))
    assert NAMED in str(info.value)


@pytest.mark.parametrize('name', [NAMED, TAGGED])
def test_tag_without_a_file_says_how_to_get_one(name):
    with pytest.raises(RuntimeError, match='pretrained_cfg_overlay=dict\\(file=PATH\\)'):
        _create(name, pretrained=True)
    assert DLI14_MODEL_ARGS == dict(position_bias=True, pool_count_include_pad=True)


def test_architecture_comes_from_the_name_and_the_old_tag_is_deprecated():
    """resnet50_lambda_dli14 has both conventions under any tag; resnet50_lambda.dli14_in1k builds the same
    network (keys, shapes, outputs) with a DeprecationWarning naming the new name; plain resnet50_lambda has
    neither convention."""
    torch.manual_seed(0)
    named = timm.create_model('resnet50_lambda_dli14', layers=(1, 1, 1, 1), num_classes=5).eval()
    torch.manual_seed(0)
    with pytest.warns(DeprecationWarning, match="'resnet50_lambda.dli14_in1k' is deprecated.*resnet50_lambda_dli14"):
        tagged = timm.create_model(TAGGED, layers=(1, 1, 1, 1), num_classes=5).eval()
    plain = timm.create_model('resnet50_lambda', layers=(1, 1, 1, 1), num_classes=5)
    for model, conventions in ((named, True), (tagged, True), (plain, False)):
        layers = [m for m in model.modules() if isinstance(m, LambdaLayer)]
        assert all((m.pos_bias is not None) == conventions for m in layers)
        assert all(m.pool.count_include_pad == conventions for m in layers if m.stride == 2)
    assert ([(k, v.shape) for k, v in named.state_dict().items()]
            == [(k, v.shape) for k, v in tagged.state_dict().items()])
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(named(x), tagged(x))
    assert named.pretrained_cfg['license'] == tagged.pretrained_cfg['license'] == 'unknown'  # their repo has none
