"""timm's model contract beyond create_model: factory kwargs, FX, TorchScript, tracing and ONNX export
that are right at every input size, what timm's train.py does with --torchscript and --model-dtype, and
clear errors for bad arguments. timm's own tests/test_models.py runs on every model in test_timm_suite.py."""
import warnings

import numpy as np
import pytest
import timm
import torch
from torch import nn

from _helpers import dynamo_onnx_export_error, rel_err
from timm_lambda import registered_models
from timm_lambda.layers import LambdaLayer, MaskedLambdaLayer1d, MultiHeadLambdaLayer

OUR_MODELS = registered_models()
FORMS = ['einsum', 'conv', 'dense', 'tiled']


def _tiny(name='lambdaresnet50', **kw):
    """A small LambdaResNet with lambda layers in c4 and c5 (one block per stage)."""
    torch.manual_seed(0)
    kw.setdefault('layers', (1, 1, 1, 1))
    kw.setdefault('lambda_blocks', (None, None, 'all', 'all'))
    return timm.create_model(name, num_classes=10, **kw).eval()


def test_every_registered_model_is_covered():
    assert len(OUR_MODELS) >= 24 and 'lambdaresnet101' in OUR_MODELS


@pytest.mark.parametrize('name', OUR_MODELS)
def test_factory_kwargs_meta_device(name):
    """create_model(device='meta') puts every parameter and buffer there, and the forward runs there."""
    model = timm.create_model(name, device='meta').eval()
    misplaced = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != 'meta']
    assert not misplaced
    res = model.pretrained_cfg['input_size'][-1]
    out = model(torch.randn(1, 3, res, res, device='meta'))
    assert out.shape == (1, model.num_classes) and out.device.type == 'meta'  # 10 for the CIFAR models


# Models whose position tables are sized for img_size (global scope, AA / global / axial attention): they refuse
# larger inputs, so their cfgs say fixed_input_size and timm passes input_size on to them as img_size.
FIXED_INPUT_SIZE = {'aa_resnet34', 'aa_resnet50', 'aa_resnet101', 'aa_resnet152', 'resnet50_global_attn',
                    'resnet50_axial_attn', 'resnet50_lambda_global32', 'lambda_resnet26rpt_256_fast'}


@pytest.mark.parametrize('name', OUR_MODELS)
def test_pretrained_cfgs_state_license_and_input_size_semantics(name):
    """Every pretrained cfg names a license (ours Apache-2.0; d-li14's weights: none stated, 'unknown'), says
    fixed_input_size exactly where the model refuses larger inputs, and has no test_input_size that merely
    repeats input_size. A fixed-size model serves its input size and refuses twice that."""
    for tag in timm.models.get_arch_pretrained_cfgs(name):
        cfg = timm.models.get_pretrained_cfg(f"{name}.{tag.split('.')[-1]}")
        assert cfg.license == ('unknown' if 'dli14' in tag else 'apache-2.0'), tag
        assert cfg.fixed_input_size == (name in FIXED_INPUT_SIZE), tag
        assert cfg.test_input_size is None or cfg.test_input_size != cfg.input_size, tag
    if name in FIXED_INPUT_SIZE:
        model = timm.create_model(name, device='meta').eval()
        size = model.pretrained_cfg['input_size'][-1]
        assert model(torch.randn(1, 3, size, size, device='meta')).shape[0] == 1
        with pytest.raises(ValueError):
            model(torch.randn(1, 3, 2 * size, 2 * size, device='meta'))


def test_report_model_with_a_local_scope_is_not_fixed_size():
    model = timm.create_model('resnet50_lambda_global32', scope=23, device='meta')
    assert model.pretrained_cfg['fixed_input_size'] is False


@pytest.mark.parametrize('name', ['lambdaresnet50', 'resnet50_lambda_u4', 'mobilenetv2_100_lambda'])
def test_factory_kwargs_bfloat16(name):
    model = timm.create_model(name, dtype=torch.bfloat16, num_classes=3)
    wrong = [n for n, t in model.named_parameters() if t.dtype != torch.bfloat16]
    assert not wrong
    out = model(torch.randn(2, 3, 64, 64, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_norm_layer_reaches_every_norm():
    """norm_layer (and bn_momentum/bn_eps) is used by every norm layer, lambda layers' included."""
    model = _tiny(norm_layer=nn.SyncBatchNorm, bn_momentum=1e-4, bn_eps=1e-3)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert norms and all(isinstance(m, nn.SyncBatchNorm) for m in norms)
    assert {(m.momentum, m.eps) for m in norms} == {(1e-4, 1e-3)}
    lam = model.layer3[0].conv2
    assert isinstance(lam, LambdaLayer) and isinstance(lam.norm_q, nn.SyncBatchNorm)


# --- FX ------------------------------------------------------------------------------------------

def test_fx_symbolic_trace_runs_size_logic_at_call_time():
    model = _tiny()
    gm = torch.fx.symbolic_trace(model)
    for size in (64, 96, 160):  # 160: c4 at 10x10 (dense form), 32: ... different forms per size
        x = torch.randn(1, 3, size, size)
        with torch.no_grad():
            assert rel_err(gm(x), model(x)) < 1e-5


def test_fx_feature_extraction():
    torch.manual_seed(0)
    model = timm.create_model('lambdaresnet50', features_only=True, feature_cls='fx').eval()
    torch.manual_seed(0)
    ref = timm.create_model('lambdaresnet50', features_only=True).eval()
    x = torch.randn(1, 3, 96, 64)
    with torch.no_grad():
        for a, b in zip(model(x), ref(x)):
            assert rel_err(a, b) < 1e-5
    full = _tiny()
    extractor = timm.models.create_feature_extractor(full, {'layer3': 'c4', 'layer4': 'c5'})
    with torch.no_grad():
        feats = extractor(torch.randn(1, 3, 64, 64))
    assert feats['c4'].shape == (1, 1024, 4, 4) and feats['c5'].shape == (1, 2048, 2, 2)


# --- TorchScript and tracing -------------------------------------------------------------------------

def test_torchscript_model_matches_eager_at_every_size():
    with timm.layers.set_layer_config(scriptable=True):
        model = _tiny()
    scripted = torch.jit.script(model)
    for size in (32, 96, 300):  # c4 at 2, 6 and 19 px; with 'auto' the c4 layers switch form at 30 px
        x = torch.randn(2, 3, size, size)
        with torch.no_grad():
            assert rel_err(scripted(x), model(x)) < 1e-5


@pytest.mark.parametrize('form', FORMS + ['auto'])
@pytest.mark.parametrize('scope', [23, 'global'])
def test_jit_trace_is_right_at_other_sizes(form, scope):
    """A trace made at one input size gives the eager result at every other size (the issue's bug: a
    trace at 160 px ran at 224 px with a relative error of 1.0): smaller and larger, non-square, the 23x23 scope
    both past the c4 map (160, 224 px) and inside it (416 px: 26x26), a global scope up to its largest size. Narrow
    stages (what is traced does not depend on the width) and ``zero_init_last=False``, so that every lambda branch
    reaches the output (a zero-initialised last norm of the block would hide it)."""
    kw = dict(scope=scope, img_size=416) if scope == 'global' else {}
    model = _tiny(form=form, channels=(16, 32, 64, 128), stem_width=16, zero_init_last=False, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        traced = torch.jit.trace(model, torch.randn(1, 3, 160, 160), check_trace=False)
    for size in (224, 96, 416, 200):
        x = torch.randn(2, 3, size, size + 32 if size < 416 else size)
        with torch.no_grad():
            assert rel_err(traced(x), model(x)) < 1e-4, size


def test_jit_trace_of_global_scope_refuses_larger_inputs():
    model = _tiny(scope='global', img_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        traced = torch.jit.trace(model, torch.randn(1, 3, 64, 64), check_trace=False)
    with pytest.raises(RuntimeError, match=r'input of 96x96 px is larger than this global-scope model covers'):
        traced(torch.randn(1, 3, 96, 96))
    with pytest.raises(ValueError, match=r'input of 96x96 px is larger than this global-scope model covers'):
        model(torch.randn(1, 3, 96, 96))


# --- ONNX ------------------------------------------------------------------------------------------

def _skip_without_dynamo_exporter():
    """Skip where torch's dynamo ONNX exporter cannot export a plain Conv + BatchNorm (older torch / onnxscript)."""
    error = dynamo_onnx_export_error()
    if error:
        pytest.skip(error)


def _onnx_check(model, path, dynamo: bool, sizes, example=(2, 3, 96, 64)):
    if dynamo:
        _skip_without_dynamo_exporter()
    x0 = torch.randn(*example)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        if dynamo:
            dims = {0: torch.export.Dim('batch', min=1, max=16), 2: torch.export.Dim('height', min=32, max=1024),
                    3: torch.export.Dim('width', min=32, max=1024)}
            torch.onnx.export(model, (x0,), str(path), dynamo=True, dynamic_shapes={'x': dims},
                              input_names=['x'], verbose=False)
        else:
            torch.onnx.export(model, (x0,), str(path), dynamo=False, input_names=['x'], output_names=['y'],
                              opset_version=17, dynamic_axes={'x': {0: 'batch', 2: 'height', 3: 'width'}})
    import onnxruntime as ort  # the [test] extra installs onnx, onnxscript and onnxruntime
    session = ort.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    for hw in sizes:
        x = torch.randn(1, 3, *hw)
        with torch.no_grad():
            ref = model(x)
        out = torch.from_numpy(session.run(None, {'x': x.numpy()})[0])
        assert rel_err(out, ref) < 1e-4, hw
    return session


@pytest.mark.parametrize('dynamo', [False, True], ids=['legacy', 'dynamo'])
@pytest.mark.parametrize('form', ['auto', 'conv'])
def test_onnx_round_trip_dynamic_sizes(tmp_path, dynamo, form):
    """Exported with dynamic H/W at 96x64, run in onnxruntime at other sizes (c4 from 2x2 to 20x20)."""
    model = _tiny(form=form)
    _onnx_check(model, tmp_path / 'm.onnx', dynamo, [(96, 64), (224, 160), (32, 32), (320, 288)])


@pytest.mark.parametrize('dynamo', [False, True], ids=['legacy', 'dynamo'])
def test_onnx_global_scope_errors_above_max_size(tmp_path, dynamo):
    model = _tiny(scope='global', img_size=128)
    session = _onnx_check(model, tmp_path / 'g.onnx', dynamo, [(96, 64), (128, 128), (64, 96)])
    with pytest.raises(Exception, match='(?i)out of (data )?bounds|index'):
        session.run(None, {'x': torch.randn(1, 3, 160, 128).numpy()})


@pytest.mark.parametrize('dynamo', [False, True], ids=['legacy', 'dynamo'])
def test_onnx_holds_the_block_index_as_a_constant(tmp_path, dynamo):
    """A local scope's gather index of the block embedding is data in the file (onnxruntime then folds the
    embedding at load time), not a graph recomputed at every run: the file holds an int64 constant equal to
    ``block_index`` (8x8 query blocks, 23x23 scope)."""
    if dynamo:
        _skip_without_dynamo_exporter()
    import onnx
    from onnx import numpy_helper

    from timm_lambda.layers.relative_embedding import block_index
    layer = LambdaLayer(32, 32, scope=23, form='tiled').eval()
    x = torch.randn(1, 32, 16, 16)
    path = tmp_path / 'layer.onnx'
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        if dynamo:
            torch.onnx.export(layer, (x,), str(path), dynamo=True,
                              dynamic_shapes=({2: torch.export.Dim('h', min=4, max=512)},), verbose=False)
        else:
            torch.onnx.export(layer, (x,), str(path), dynamo=False, opset_version=17, input_names=['x'],
                              dynamic_axes={'x': {2: 'h'}})
    graph = onnx.load(str(path)).graph
    constants = [numpy_helper.to_array(t) for t in graph.initializer]
    constants += [numpy_helper.to_array(a.t) for n in graph.node if n.op_type == 'Constant' for a in n.attribute
                  if a.name == 'value']
    expected = block_index(8, 1, 23, 23, torch.device('cpu')).numpy()
    assert any(c.shape == expected.shape and (c == expected).all() for c in constants)


# --- what timm's train.py does ----------------------------------------------------------------------

def _train_step(model, dtype=torch.float32, seed=0):
    """One SGD step of train.py's kind; returns the updated parameters."""
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 3, 64, 64).to(dtype)  # the same input in every dtype (torch 2.4's bf16 randn draws others)
    y = torch.randint(0, 10, (4,))
    loss = nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    opt.step()
    return [p.detach().float() for p in model.parameters()]


def _small(**kw):
    torch.manual_seed(0)
    return timm.create_model('lambdaresnet50', num_classes=10, layers=(1, 1, 1, 1),
                             lambda_blocks=(None, None, 'all', 'all'), **kw).train()


def test_train_py_torchscript_flow():
    """train.py --torchscript: create_model(scriptable=True), torch.jit.script, then train: the scripted
    model takes the same step as the eager one."""
    eager = _train_step(_small())
    scripted = _train_step(torch.jit.script(_small(scriptable=True)))
    for a, b in zip(scripted, eager):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_train_py_model_dtype_bfloat16_flow():
    """train.py --model-dtype bfloat16: the model and the inputs in bfloat16; the step tracks float32's."""
    eager = _train_step(_small())
    bf16 = _train_step(_small().to(dtype=torch.bfloat16), torch.bfloat16)
    moved = [(a - b).abs().max() for a, b in zip(bf16, eager)]
    assert max(moved) < 0.05


# --- clear errors for bad arguments ---------------------------------------------------------------

def test_img_size_as_height_width_pair():
    model = timm.create_model('lambdaresnet50', scope='global', img_size=(96, 64), num_classes=3).eval()
    assert model(torch.randn(1, 3, 96, 64)).shape == (1, 3)
    lam = model.layer4[-1].conv2
    assert lam.pos_embedding.max_size == (6, 4)
    with pytest.raises(ValueError, match=r'input of 64x96 px is larger than .* \(96x64 px, from img_size=\(96, 64\)\)'):
        model(torch.randn(1, 3, 64, 96))


def test_img_size_with_local_scope_is_refused():
    with pytest.raises(ValueError, match='img_size'):
        timm.create_model('lambdaresnet50', img_size=224)


def test_bare_int_and_numpy_arguments():
    model = timm.create_model('lambdaresnet50', lambda_blocks=(None, None, 2, 'all'), dim_k=np.int64(8),
                              heads=np.int32(2), scope=np.int64(7))
    assert [i for i, b in enumerate(model.layer3) if isinstance(b.conv2, LambdaLayer)] == [1]
    lam = model.layer3[1].conv2
    assert (lam.dim_k, lam.heads, lam.scope) == (8, 2, (7, 7))
    assert type(lam.dim_k) is int
    LambdaLayer(np.int64(16), dim_k=np.int16(4), heads=2, scope='global', max_size=(np.int64(5), 6))


@pytest.mark.parametrize('kwargs,name', [
    (dict(scope=None), 'scope'),
    (dict(stride=2.0), 'stride'),
    (dict(stride=True), 'stride'),
    (dict(stride=3), 'stride'),
    (dict(dim_k=4.0), 'dim_k'),
    (dict(heads=True), 'heads'),
    (dict(scope='local'), 'scope'),
    (dict(form='fft'), 'form'),
    (dict(content='yes'), 'content'),
    (dict(scope=5, max_size=(8, 8)), 'max_size'),
])
def test_layer_arguments_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LambdaLayer(16, **{'dim_k': 4, 'heads': 2, **kwargs})


@pytest.mark.parametrize('kwargs,name', [
    (dict(scope='local'), 'scope'),
    (dict(lambda_blocks=(None, None, 'some', 'all')), 'lambda_blocks'),
    (dict(lambda_blocks=(None, None, 0, 'all')), 'lambda_blocks'),
    (dict(lambda_blocks='all'), 'lambda_blocks'),
    (dict(bn_momentum=1.5), 'bn_momentum'),
    (dict(img_size=(64, 0), scope='global'), 'img_size'),
])
def test_model_arguments_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        timm.create_model('lambdaresnet50', **kwargs)


def test_masked_layer_causal_must_be_bool():
    with pytest.raises(ValueError, match='causal'):
        MaskedLambdaLayer1d(8, dim_k=4, heads=2, causal='no')
    MultiHeadLambdaLayer(8, dim_k=2, heads=2, scope=np.int64(3), stride=np.int64(2))


@pytest.mark.parametrize('bad', [float('nan'), float('inf')])
@pytest.mark.parametrize('use_mask', [False, True], ids=['default_causal', 'explicit_causal_mask'])
def test_masked_layer_stays_causal_for_non_finite_inputs(bad, use_mask):
    """A NaN or Inf at a future position leaves every earlier output unchanged (no 0 x NaN leak)."""
    torch.manual_seed(0)
    layer = MaskedLambdaLayer1d(8, dim_k=4, heads=2, max_len=12)
    x = torch.randn(2, 10, 8)
    mask = torch.tril(torch.ones(10, 10, dtype=torch.bool)) if use_mask else None
    y = layer(x, mask)
    x_bad = x.clone()
    x_bad[:, 6, 3] = bad
    y_bad = layer(x_bad, mask)
    torch.testing.assert_close(y_bad[:, :6], y[:, :6], rtol=1e-6, atol=1e-6)
    assert torch.isnan(y_bad[:, 6:]).all()  # every output that sees it is NaN
