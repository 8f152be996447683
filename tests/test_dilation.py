"""Dilated lambda and attention layers and backbones with output_stride 16 / 8 (our extension, see
docs/paper_choices.md "Dilation"): the layer against the per-query reference, every form in float64 (outputs
and gradients, train and eval), traces and exports, and timm / segmentation_models_pytorch backbones."""
import io

import pytest
import timm
import torch
import torch.nn.functional as F

import timm_lambda  # noqa: F401  (registers the models)
from _layer_helpers import perturb_for_eval
from reference import lambda_layer_reference
from timm_lambda.layers import LambdaLayer, LocalSelfAttention2d
from timm_lambda.layers.dilation import batch_to_space, space_to_batch

FORMS = ('einsum', 'conv', 'dense', 'tiled', 'auto')


def _layer(dilation, form='auto', scope=5, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    layer = LambdaLayer(8, 8, dim_k=4, heads=2, dim_u=2, scope=scope, form=form, dilation=dilation, **kw).double()
    return perturb_for_eval(layer, g)


def _dense_form(layer, x):
    """A differentiable [n, m] form of the layer (any mode): the layer's own projections and norms, the
    position term from an explicit dilated e_nm (m = n + d o, o inside the table), no form of the package."""
    B, _, H, W = x.shape
    h, k, u, v, d = layer.heads, layer.dim_k, layer.dim_u, layer.dim_v, layer.dilation
    q, keys, vals = torch.split(layer.qkv(x), [h * k, k * u, v * u], dim=1)
    q = layer.norm_q(q).reshape(B, h, k, H * W)
    vals = layer.norm_v(vals).reshape(B, u, v, H * W)
    keys = keys.reshape(B, u, k, H * W).softmax(-1)
    table = layer.pos_embedding.weight  # [k, u, Rh, Rw]
    rh, rw = table.shape[-2:]
    ys, xs = torch.meshgrid(torch.arange(H), torch.arange(W), indexing='ij')
    ys, xs = ys.reshape(-1), xs.reshape(-1)
    dy, dx = ys[None, :] - ys[:, None], xs[None, :] - xs[:, None]  # m - n, [n, m]
    ok = (dy % d == 0) & (dx % d == 0) & ((dy // d).abs() <= rh // 2) & ((dx // d).abs() <= rw // 2)
    iy, ix = (dy // d + rh // 2).clamp(0, rh - 1), (dx // d + rw // 2).clamp(0, rw - 1)
    emb = table[:, :, iy, ix] * ok  # [k, u, n, m]
    content = torch.einsum('bukm,buvm->bkv', keys, vals)  # lambda^c, global over all positions
    y = torch.einsum('bhkn,bkv->bhvn', q, content)
    y = y + torch.einsum('bhkn,kunm,buvm->bhvn', q, emb, vals)
    return y.reshape(B, h * v, H, W)


def test_space_to_batch_round_trip():
    x = torch.randn(2, 3, 7, 10)
    for d in (1, 2, 3):
        s = space_to_batch(x, d)
        assert s.shape == (2 * d * d, 3, -(-7 // d), -(-10 // d))
        assert torch.equal(batch_to_space(s, d, 7, 10), x)
    s = space_to_batch(x, 2)  # sub-grid (i, j) = 1, 0 of sample 0 holds positions (2a + 1, 2b)
    assert torch.equal(s[2, :, :3, :], x[0, :, 1::2, 0::2])


@pytest.mark.parametrize('dilation', [2, 3])
def test_dense_form_is_the_per_query_reference(dilation):
    layer = _layer(dilation, 'einsum').eval()
    x = torch.randn(1, 8, 9, 11, dtype=torch.float64)
    torch.testing.assert_close(_dense_form(layer, x), lambda_layer_reference(layer, x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('dilation,hw', [(2, (19, 21)), (3, (19, 21)), (2, (8, 8)), (3, (7, 5))])
def test_matches_reference_eval(form, dilation, hw):
    layer = _layer(dilation, form).eval()
    x = torch.randn(2, 8, *hw, dtype=torch.float64)
    torch.testing.assert_close(layer(x), lambda_layer_reference(layer, x), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('dilation', [2, 3])
@pytest.mark.parametrize('train', [True, False], ids=['train', 'eval'])
def test_outputs_and_gradients_match_dense_form(form, dilation, train):
    layer = _layer(dilation, form).train(train)
    x = torch.randn(2, 8, 19, 21, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(2, 8, 19, 21, dtype=torch.float64)
    params = [x, layer.qkv.weight, layer.pos_embedding.weight]
    y = layer(x)
    grads = torch.autograd.grad(y, params, gy)
    y_ref = _dense_form(layer, x)
    grads_ref = torch.autograd.grad(y_ref, params, gy)
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-9)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-8, atol=1e-9)


def test_dilation_one_is_the_plain_layer():
    a, b = _layer(1, 'einsum'), LambdaLayer(8, 8, dim_k=4, heads=2, dim_u=2, scope=5, form='einsum').double()
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 8, 6, 7, dtype=torch.float64)
    torch.testing.assert_close(a.eval()(x), b.eval()(x))
    assert 'dilation' not in repr(a) and 'dilation=2' in repr(_layer(2))


@pytest.mark.parametrize('kw,match', [
    (dict(dilation=0), 'dilation must be an int >= 1'),
    (dict(dilation=2.0), 'dilation must be an int >= 1'),
    (dict(dilation=True), 'dilation must be an int >= 1'),
    (dict(dilation=2, stride=2), 'needs a local scope and stride=1'),
    (dict(dilation=2, scope='global', max_size=(8, 8)), 'needs a local scope and stride=1'),
])
def test_bad_dilation_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        LambdaLayer(8, 8, dim_k=4, heads=2, **kw)


def test_jit_trace_and_onnx_export_match_eager():
    layer = _layer(2, 'auto').float().eval()
    x = torch.randn(1, 8, 11, 13)
    traced = torch.jit.trace(layer, x)
    torch.testing.assert_close(traced(x), layer(x), rtol=1e-5, atol=1e-5)
    ort = pytest.importorskip('onnxruntime')
    f = io.BytesIO()
    torch.onnx.export(layer, (x,), f, dynamo=False, input_names=['x'], output_names=['y'], opset_version=17)
    sess = ort.InferenceSession(f.getvalue(), providers=['CPUExecutionProvider'])
    (y,) = sess.run(None, {'x': x.numpy()})
    torch.testing.assert_close(torch.from_numpy(y), layer(x), rtol=1e-4, atol=1e-4)


def test_local_attention_dilated_is_attention_on_sub_grids():
    torch.manual_seed(0)
    plain = LocalSelfAttention2d(16, 16, num_heads=2, kernel_size=3).eval()
    dil = LocalSelfAttention2d(16, 16, num_heads=2, kernel_size=3, dilation=2).eval()
    dil.load_state_dict(plain.state_dict())
    x = torch.randn(1, 16, 8, 10)
    y = dil(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y[:, :, 1::2, 0::2], plain(x[:, :, 1::2, 0::2]))
    with pytest.raises(ValueError, match='needs stride=1'):
        LocalSelfAttention2d(16, 16, num_heads=2, stride=2, dilation=2)


# ---- backbones -------------------------------------------------------------------------------------------
_IMG = dict(aa_resnet50=64, resnet50_global_attn=64, resnet50_axial_attn=64, resnet50_lambda_global32=64)
MODELS = ['lambdaresnet50', 'resnet50_lambda', 'lambdaresnet50_c4', 'resnet50_lambda_global32', 'aa_resnet50',
          'resnet50_global_attn', 'resnet50_axial_attn', 'resnet50_local_attn7', 'mobilenetv2_100_lambda']


@pytest.mark.parametrize('output_stride', [16, 8])
@pytest.mark.parametrize('name', MODELS)
def test_features_match_timm_resnet50(name, output_stride):
    x = torch.randn(2, 3, 64, 64)
    ref = timm.create_model('resnet50', features_only=True, output_stride=output_stride)
    kw = {'img_size': _IMG[name]} if name in _IMG else {}
    model = timm.create_model(name, features_only=True, output_stride=output_stride, **kw)
    assert model.feature_info.reduction() == ref.feature_info.reduction()
    feats = model(x)
    assert [f.shape[-2:] for f in feats] == [f.shape[-2:] for f in ref(x)]
    sum(f.float().mean() for f in feats).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_dilated_lambda_layers_get_timm_dilation():
    model = timm.create_model('lambdaresnet50', output_stride=8)
    c4, c5 = model.layer3, model.layer4
    # timm: a dilated stage's first block keeps the previous dilation (first_dilation), the others double it
    assert [b.conv2.dilation for b in c4 if isinstance(b.conv2, LambdaLayer)] == [2]  # c4 block 3
    assert c5[0].conv2.dilation == 2 and c5[0].conv2.stride == 1 and {b.conv2.dilation for b in c5[1:]} == {4}


def test_cifar_output_stride_counts_timm_strides():
    model = timm.create_model('resnet26_lambda_cifar', features_only=True, output_stride=16)
    assert model.feature_info.reduction() == [1, 1, 2, 4, 4]
    assert [f.shape[-1] for f in model(torch.randn(1, 3, 32, 32))] == [32, 32, 16, 8, 8]


@pytest.mark.parametrize('name', ['lambdaresnet50', 'resnet50_lambda', 'aa_resnet50', 'resnet50_lambda_global32'])
def test_output_stride_32_unchanged(name):
    kw = {'img_size': 64} if name in _IMG else {}
    a, b = timm.create_model(name, **kw), timm.create_model(name, output_stride=32, **kw)
    assert list(a.state_dict()) == list(b.state_dict())
    assert all(a.state_dict()[k].shape == v.shape for k, v in b.state_dict().items())


@pytest.mark.parametrize('name', ['lambdaresnet50', 'aa_resnet50', 'resnet50_local_attn7', 'resnet50_global_attn'])
def test_dilated_state_dict_matches_undilated(name):
    """A dilated backbone has the parameters of the plain one (a classification checkpoint loads), only
    global tables grow with the larger maps."""
    kw = {'img_size': 64} if name in _IMG else {}
    a, b = timm.create_model(name, **kw).state_dict(), timm.create_model(name, output_stride=16, **kw).state_dict()
    assert list(a) == list(b)
    grown = [k for k in a if a[k].shape != b[k].shape]
    assert all('rel' in k for k in grown), grown


def test_bad_output_stride_names_accepted_values():
    with pytest.raises(ValueError, match=r'output_stride must be one of \(8, 16, 32\)'):
        timm.create_model('lambdaresnet50', output_stride=4)
    with pytest.raises(ValueError, match=r'output_stride must be one of \(8, 16, 32\)'):
        timm.create_model('aa_resnet50', output_stride=12)


# ---- segmentation_models_pytorch --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize('arch,kw', [
    ('DeepLabV3', {}),  # smp's default encoder_output_stride: 8
    ('DeepLabV3', dict(encoder_output_stride=16)),
    ('DeepLabV3Plus', dict(encoder_output_stride=16)),
    ('DeepLabV3Plus', dict(encoder_output_stride=8)),
    ('PAN', dict(encoder_output_stride=16)),
], ids=['deeplabv3-os8', 'deeplabv3-os16', 'deeplabv3plus-os16', 'deeplabv3plus-os8', 'pan-os16'])
def test_smp_training_steps(arch, kw):
    smp = pytest.importorskip('segmentation_models_pytorch')
    torch.manual_seed(0)
    model = getattr(smp, arch)(encoder_name='tu-lambdaresnet50', encoder_weights=None, classes=3, **kw)
    size = 128 if arch == 'PAN' else 64  # PAN's feature pyramid attention pools c5 three times: 8x8 at least
    x = torch.randn(2, 3, size, size)
    target = torch.randint(0, 3, (2, size, size))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    losses = []
    for _ in range(3):
        out = model(x)
        assert out.shape == (2, 3, size, size)
        loss = F.cross_entropy(out, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert min(losses[1:]) < losses[0], losses
