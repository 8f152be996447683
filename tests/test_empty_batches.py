"""Empty batches (detection pipelines and samplers produce them) through the layers and every registered model:
the shapes a batch of one gives with 0 in front (timm's resnet50: [0, num_classes]), and a backward that gives
every parameter a (zero) gradient."""
import functools

import pytest
import timm
import torch

import timm_lambda
from timm_lambda.layers import (
    AugmentedConv2d,
    AxialSelfAttention2d,
    LambdaLayer,
    LocalSelfAttention2d,
    MaskedLambdaLayer1d,
    MultiHeadLambdaLayer,
    RelPosSelfAttention2d,
)

ATTN = (0, 8, 5, 6)
LAMBDA = [(f'lambda_{form}_stride{s}',
           functools.partial(LambdaLayer, 8, dim_k=4, heads=2, scope=5, stride=s, form=form),
           (0, 8, 12, 13)) for form in ('dense', 'tiled') for s in (1, 2)]
LAYERS = LAMBDA + [
    ('masked_causal', lambda: MaskedLambdaLayer1d(8, dim_k=4, heads=2, max_len=12), (0, 5, 8)),
    ('masked_not_causal', lambda: MaskedLambdaLayer1d(8, dim_k=4, heads=2, max_len=12, causal=False), (0, 5, 8)),
    ('masked_no_key_norm_scope', lambda: MaskedLambdaLayer1d(8, dim_k=4, heads=2, max_len=12, key_norm='none',
                                                             scope=3), (0, 5, 8)),
    ('multihead_local', lambda: MultiHeadLambdaLayer(8, dim_k=2, heads=2, scope=3), ATTN),
    ('multihead_global_stride2', lambda: MultiHeadLambdaLayer(8, dim_k=2, heads=2, scope='global', max_size=(5, 6),
                                                              stride=2), ATTN),
    ('relpos', lambda: RelPosSelfAttention2d(8, num_heads=2, feat_size=(5, 6)), ATTN),
    ('relpos_stride2', lambda: RelPosSelfAttention2d(8, num_heads=2, feat_size=(5, 6), stride=2), ATTN),
    ('axial_stride2', lambda: AxialSelfAttention2d(8, num_heads=2, feat_size=(5, 6), stride=2), ATTN),
    ('local', lambda: LocalSelfAttention2d(8, num_heads=2, kernel_size=3), ATTN),
    ('local_stride2', lambda: LocalSelfAttention2d(8, num_heads=2, kernel_size=3, stride=2), ATTN),
    ('augmented', lambda: AugmentedConv2d(8, 16, heads=2, max_size=(5, 6), min_dim_head_k=2, upsilon=0.25),
     ATTN),
    ('augmented_downsample_stride2', lambda: AugmentedConv2d(8, 16, stride=2, heads=2, max_size=(2, 2),
                                                             attn_downsample=True, min_dim_head_k=2, upsilon=0.25),
     ATTN),
]


@pytest.mark.parametrize('train', [True, False], ids=['train', 'eval'])
@pytest.mark.parametrize('name,make,shape', LAYERS, ids=[c[0] for c in LAYERS])
def test_layer_empty_batch(name, make, shape, train):
    torch.manual_seed(0)
    layer = make().train(train)
    expected = (0,) + tuple(layer(torch.randn(1, *shape[1:])).shape[1:])
    x = torch.randn(*shape, requires_grad=True)
    y = layer(x)
    assert tuple(y.shape) == expected
    y.sum().backward()
    assert x.grad.shape == x.shape
    for pname, p in layer.named_parameters():
        assert p.grad is not None and (p.grad == 0).all(), pname  # DDP needs every parameter to be used
    for bname, b in layer.named_buffers():
        assert torch.isfinite(b.float()).all(), bname


def _non_lambda_models():
    names = []
    for name in timm_lambda.registered_models():
        with torch.device('meta'):  # structure only: fast
            model = timm.create_model(name)
        if not any(isinstance(m, LambdaLayer) for m in model.modules()):
            names.append(name)
    return names


_SHALLOW = ['aa_resnet34', 'aa_resnet50', 'resnet50_global_attn', 'resnet50_axial_attn', 'resnet50_local_attn7',
            'resnetrs50_nose']
_DEEP = ['aa_resnet101', 'aa_resnet152', 'resnetrs101_nose', 'resnetrs152_nose', 'resnetrs200_nose',
         'resnetrs270_nose', 'resnetrs350_nose', 'resnetrs420_nose']  # same blocks, deeper: slow
NON_LAMBDA_MODELS = _SHALLOW + [pytest.param(n, marks=pytest.mark.slow) for n in _DEEP]


def test_non_lambda_model_list_is_complete():
    """The models below are every registered model without a LambdaLayer (those are tested with the lambda
    layer's empty-batch tests)."""
    assert sorted(_non_lambda_models()) == sorted(_SHALLOW + _DEEP)


@pytest.mark.parametrize('name', NON_LAMBDA_MODELS)
def test_model_empty_batch(name):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=7).eval()
    x1 = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        feats = model.forward_features(x1).shape
        assert tuple(model(torch.randn(0, 3, 64, 64)).shape) == (0, 7)
        assert tuple(model.forward_features(torch.randn(0, 3, 64, 64)).shape) == (0,) + tuple(feats[1:])
    assert tuple(timm.create_model('resnet18', num_classes=7).eval()(torch.randn(0, 3, 64, 64)).shape) == (0, 7)
    model.train()
    x = torch.randn(0, 3, 64, 64, requires_grad=True)
    model(x).sum().backward()
    assert x.grad.shape == x.shape
    assert all(p.grad is not None for p in model.parameters())


def _lambda_models():
    shallow, deep = [], []
    for name in timm_lambda.registered_models():
        if name in _SHALLOW + _DEEP:
            continue
        depth = ''.join(c for c in name.split('_')[0] if c.isdigit())
        (deep if depth and int(depth) > 101 else shallow).append(name)
    return shallow + [pytest.param(n, marks=pytest.mark.slow) for n in deep]


@pytest.mark.parametrize('name', _lambda_models())
def test_lambda_model_empty_batch(name):
    """Every model with lambda layers, at its default input size: [0, num_classes] in eval mode, and a
    training-mode backward that reaches every parameter."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=7).eval()
    size = timm.models.get_pretrained_cfg(name).input_size
    with torch.no_grad():
        assert tuple(model(torch.randn(0, *size)).shape) == (0, 7)
    model.train()
    x = torch.randn(0, *size, requires_grad=True)
    model(x).sum().backward()
    assert x.grad.shape == x.shape
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize('name', ['relpos_stride2', 'local_stride2', 'augmented'])
def test_scripted_and_fx_layers_take_empty_batches(name):
    """The empty-batch handling is TorchScript- and FX-compatible (and leaves non-empty batches alone)."""
    import warnings
    make, shape = next((m, s) for n, m, s in LAYERS if n == name)
    torch.manual_seed(0)
    layer = make().eval()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # torch.jit.script is deprecated
        graphs = {'script': torch.jit.script(layer), 'fx': torch.fx.symbolic_trace(layer)}
    for kind, graph in graphs.items():
        for batch in (0, 2):
            x = torch.randn(batch, *shape[1:])
            assert torch.equal(graph(x), layer(x)), (kind, batch)
        assert graph(torch.randn(*shape)).shape[0] == 0
