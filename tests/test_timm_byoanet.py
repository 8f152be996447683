"""timm's own lambda networks on this package's layer (timm_lambda/models/timm_byoanet.py), against timm's originals.

timm's :class:`timm.layers.lambda_layer.LambdaLayer` and its ``lambda_resnet26t``, ``lambda_resnet50ts`` and
``lambda_resnet26rpt_256`` (``timm.models.byoanet``) are the independent reference: a converted layer or model gives
timm's outputs and gradients (float64 within 1e-10, float32 within 1e-5, relative), eval and training, on every
backend this CPU serves; the ``_fast`` models load a timm checkpoint through timm's own ``pretrained=True`` machinery
(a local file standing in for timm's download), ``features_only`` too.
"""
import copy

import pytest
import timm
import torch
from timm.layers.lambda_layer import LambdaLayer as TimmLayer
from torch import nn

from timm_lambda.layers import LambdaLayer
from timm_lambda.layers import position_lambda as PL
from timm_lambda.models.timm_byoanet import (
    FAST_VARIANTS,
    TimmLambdaLayer,
    checkpoint_filter_timm_lambda_layers,
    convert_timm_lambda_layers,
)

BOUND = {torch.float64: 1e-10, torch.float32: 1e-5}
DTYPES = [torch.float64, torch.float32]
DTYPE_IDS = ['f64', 'f32']
BACKENDS = ['cpu_kernel', 'gemm', 'plain', 'auto']


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _perturb(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial batch norms everywhere (timm zero-initialises each residual branch's last one, which would hide
    the lambda layers from the output) and O(1) position weights; in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.running_mean.copy_(torch.rand(n, generator=g) - 0.5)
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
                m.weight.copy_(torch.rand(n, generator=g) * 0.5 + 0.5)
                m.bias.copy_(torch.rand(n, generator=g) * 0.4 - 0.2)
            if isinstance(m, TimmLayer):
                for p in (m.conv_lambda.weight, m.conv_lambda.bias) if m.conv_lambda is not None else (m.pos_emb,):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _run(model: nn.Module, x: torch.Tensor, train: bool) -> dict:
    """``model``'s output in eval or training mode and the gradients of one fixed projection of it (of ``x`` and, in
    our keys, of every parameter; a timm model's mapped as its weights are), in float64."""
    model.train(train).zero_grad()
    x = x.detach().clone().requires_grad_()
    y = model(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(y.dtype))
    grads = checkpoint_filter_timm_lambda_layers({n: p.grad for n, p in model.named_parameters()})
    return {'output': y.detach().double(), 'input': x.grad.double(), **{n: g.double() for n, g in grads.items()}}


def _errors(got: dict, want: dict) -> dict:
    """||got - want|| / ||want|| of each quantity of :func:`_run`; a gradient zero up to rounding (the qkv bias: the
    batch norms and the keys' softmax cancel it) measured against the norm of all parameter gradients instead."""
    assert set(got) == set(want) and got['output'].shape == want['output'].shape
    total = torch.cat([w.flatten() for n, w in want.items() if n not in ('output', 'input')]).norm()
    errors = {}
    for n, w in want.items():
        norm = w.norm()
        errors[n] = ((got[n] - w).norm() / (total if norm <= 1e-6 * total else norm)).item()
    return errors


def _compare(ref: nn.Module, fast: nn.Module, x: torch.Tensor, train: bool) -> None:
    """Output, input gradient and every parameter gradient of ``fast`` equal ``ref``'s within the dtype's bound (same
    dtype, same input)."""
    got, want = _run(fast, x, train), _run(ref, x, train)
    bad = {n: e for n, e in _errors(got, want).items() if e > BOUND[x.dtype]}
    assert not bad, bad
    tables = [n for n in got if n.endswith('pos_embedding.weight')]
    assert tables and all(got[n].norm() > 0 for n in tables)  # the position lambdas reach the output


# --- the layer ------------------------------------------------------------------------------------------------

LAYER_CASES = [  # timm's LambdaLayer kwargs, input shape
    ('local_s1', dict(r=5), (2, 16, 5, 7)),
    ('local_s2_even', dict(r=3, stride=2), (2, 16, 6, 8)),
    ('local_s2_odd', dict(r=5, stride=2), (2, 16, 7, 5)),  # 2x2 pooling floors: 3 x 2
    ('local_qkv_bias_qk_ratio', dict(dim_head=None, qk_ratio=0.5, qkv_bias=True, r=3), (2, 16, 4, 5)),
    ('rpt_s1', dict(r=None, feat_size=(5, 6)), (2, 16, 5, 6)),
    ('rpt_s2', dict(r=None, feat_size=(6, 4), stride=2), (2, 16, 6, 4)),
]


def _layer_pair(kw: dict, dtype: torch.dtype):
    torch.manual_seed(0)
    ref = _perturb(TimmLayer(16, **{'num_heads': 4, 'dim_head': 4, **kw})).to(dtype)
    fast = convert_timm_lambda_layers(copy.deepcopy(ref))
    return ref, fast


@pytest.mark.parametrize('backend_name', BACKENDS)
@pytest.mark.parametrize('dtype', DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize('name,kw,shape', LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_converted_layer_equals_timms(name, kw, shape, dtype, backend_name, backend):
    ref, fast = _layer_pair(kw, dtype)
    assert type(fast) is TimmLambdaLayer and fast.pool_size == 2
    if backend_name == 'cpu_kernel' and fast.global_scope:
        fast.form = 'tiled'  # the kernel computes the tiled form; a global scope's 'auto' form is dense
    backend(backend_name)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    PL.served_backends(reset=True)
    _compare(ref, fast, x, train=False)
    _compare(ref, fast, x, train=True)
    served = {k[1] for k in PL.served_backends()}
    assert served == ({backend_name} if backend_name != 'auto' else served) and served, PL.served_backends()


def test_layer_weights_map_and_modules_are_reused():
    """Conversion reuses timm's projection and norms (type, statistics, requires_grad) and maps the position weights:
    ``conv_lambda.weight [k, 1, r, r, 1]`` -> ``pos_embedding.weight [k, 1, r, r]``, its bias -> ``pos_bias``; ``pos_emb
    [2H-1, 2W-1, k]`` -> ``[k, 1, 2H-1, 2W-1]``."""
    ref, fast = _layer_pair(dict(r=5, stride=2), torch.float32)
    again = convert_timm_lambda_layers(ref)
    assert again.qkv is ref.qkv and again.norm_q is ref.norm_q and again.norm_v is ref.norm_v
    assert torch.equal(fast.pos_embedding.weight, ref.conv_lambda.weight[..., 0])
    assert torch.equal(fast.pos_bias, ref.conv_lambda.bias) and fast.scope == (5, 5) and fast.stride == 2
    ref, fast = _layer_pair(dict(r=None, feat_size=(3, 4)), torch.float32)
    assert fast.scope == 'global' and fast.pos_bias is None and fast.pos_embedding.weight.shape == (4, 1, 5, 7)
    assert torch.equal(fast.pos_embedding.weight[:, 0], ref.pos_emb.permute(2, 0, 1))
    ref.eval().pos_emb.requires_grad_(False)
    fast = convert_timm_lambda_layers(copy.deepcopy(ref))
    assert not fast.training and not fast.pos_embedding.weight.requires_grad


def test_rpt_layer_serves_smaller_inputs_than_its_feat_size():
    """timm's relative table serves exactly ``feat_size``; ours every input up to it, with the same offsets: a
    4 x 3 input through a (6, 5) layer equals a (4, 3) timm layer holding the centre of the same table."""
    ref, fast = _layer_pair(dict(r=None, feat_size=(6, 5)), torch.float64)
    small = TimmLayer(16, num_heads=4, dim_head=4, r=None, feat_size=(4, 3)).double().eval()
    state = {k: v for k, v in ref.state_dict().items() if k != 'pos_emb'}
    small.load_state_dict({**state, 'pos_emb': ref.pos_emb[2:-2, 2:-2]})
    x = torch.randn(2, 16, 4, 3, dtype=torch.float64)
    assert _rel(fast.eval()(x), small(x)) <= 1e-10
    with pytest.raises(ValueError, match='max_size'):
        fast(torch.randn(1, 16, 7, 5, dtype=torch.float64))


def test_timm_initialisation():
    """From scratch, the layer starts as timm's: projection std dim^-1/2, local table std |k|^-1/2, global 0.02."""
    torch.manual_seed(0)
    local, rpt = TimmLambdaLayer(256, dim_head=64, r=9), TimmLambdaLayer(256, r=None, feat_size=(16, 16))
    for layer, std in ((local, 64 ** -0.5), (rpt, 0.02)):
        assert abs(layer.qkv.weight.std().item() * 256 ** 0.5 - 1) < 0.05
        assert abs(layer.pos_embedding.weight.std().item() / std - 1) < 0.1
    assert 0.9 / 9 < local.pos_bias.abs().max() <= 1 / 9 and rpt.pos_bias is None  # a Conv3d bias, fan-in 9 x 9


@pytest.mark.parametrize('kw,name', [
    (dict(r=4), 'r'), (dict(r=True), 'r'), (dict(r=None), 'feat_size'),
])
def test_bad_arguments_name_the_parameter(kw, name):
    with pytest.raises(ValueError, match=rf'\b{name}\b'):
        TimmLambdaLayer(16, **kw)


@pytest.mark.parametrize('kw,name', [
    (dict(pool_size=4), 'pool_size'), (dict(pool_size=True), 'pool_size'),
    (dict(pool_size=2, pool_count_include_pad=True), 'pool_count_include_pad'),
])
def test_pool_size_bad_values(kw, name):
    with pytest.raises(ValueError, match=name):
        LambdaLayer(8, dim_k=4, heads=2, stride=2, **kw)


def test_pool_size_2_is_the_stride_1_layer_pooled_2x2():
    """``pool_size=2``: the stride-1 layer's output through ``nn.AvgPool2d(2, 2)``, floor sizes at odd maps; the
    default 3x3 pooling differs."""
    torch.manual_seed(0)
    def build(**kw):
        torch.manual_seed(0)
        return LambdaLayer(8, dim_k=4, heads=2, scope=3, **kw).double().eval()
    layer, one, three = build(stride=2, pool_size=2), build(stride=1), build(stride=2)
    x = torch.randn(2, 8, 7, 6, dtype=torch.float64)
    y = layer(x)
    assert y.shape == (2, 8, 3, 3)
    assert _rel(y, nn.functional.avg_pool2d(one(x), 2)) <= 1e-12
    assert three(x).shape == (2, 8, 4, 3) and _rel(three(x)[:, :, :3], y) > 1e-3
    assert 'pool_size=2' in repr(layer)


# --- the models -----------------------------------------------------------------------------------------------

def _timm_model(name: str, size: int, dtype=torch.float64, **kw) -> nn.Module:
    """timm's model at a quarter of its width (``width_factor=0.25``, ByobNet's own knob: every stage, block type,
    stride and lambda layer kept, lambda layers of 16 to 128 channels), 10 classes, perturbed."""
    torch.manual_seed(0)
    if 'rpt' in name:
        kw['img_size'] = size  # timm's rpt tables are sized for one input
    return _perturb(timm.create_model(name, **{'num_classes': 10, 'width_factor': 0.25, **kw})).to(dtype)


MODELS = list(FAST_VARIANTS.values())


def _converted(ref: nn.Module) -> nn.Module:
    fast = convert_timm_lambda_layers(copy.deepcopy(ref))
    assert not any(isinstance(m, TimmLayer) for m in fast.modules())
    assert sum(isinstance(m, TimmLambdaLayer) for m in fast.modules()) == \
        sum(isinstance(m, TimmLayer) for m in ref.modules()) > 0
    return fast


def _image(size: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(3), dtype=dtype)


@pytest.mark.parametrize('name', MODELS)
def test_converted_model_equals_timms_float64(name):
    """Eval and training (batch statistics, every gradient) at two input sizes, within 1e-10."""
    for size in (64, 96):
        ref = _timm_model(name, size)
        fast = _converted(ref)
        _compare(ref, fast, _image(size), train=False)
        _compare(ref, fast, _image(size), train=True)


@pytest.mark.parametrize('name', MODELS)
def test_converted_model_equals_timms_float32(name):
    """Eval: output and gradients within 1e-5 of timm's float32 model. Training on these tiny maps (batch norms over
    2 x 2 x 2 values) is ill-conditioned: timm's own float32 gradients are up to 1e-2 away from its float64 ones,
    so there the converted float32 model must be as close to timm's float64 model as timm's float32 model is (twice
    its error, at least 1e-5)."""
    truth = _timm_model(name, 64)
    ref = copy.deepcopy(truth).float()
    fast = _converted(ref)
    x = _image(64, torch.float32)
    _compare(ref, fast, x, train=False)
    exact = _run(truth, x.double(), train=True)
    theirs = _errors(_run(ref, x, train=True), exact)
    mine = _errors(_run(fast, x, train=True), exact)
    bad = {n: (e, theirs[n]) for n, e in mine.items() if e > max(1e-5, 2 * theirs[n])}
    assert not bad, bad


@pytest.mark.parametrize('backend_name', ['cpu_kernel', 'gemm', 'plain'])
def test_converted_model_on_each_backend(backend_name, backend):
    """lambda_resnet50ts (the local layers at stride 1 and 2) in training, each backend by name."""
    ref = _timm_model('lambda_resnet50ts', 64)
    fast = _converted(ref)
    backend(backend_name)
    PL.served_backends(reset=True)
    _compare(ref, fast, _image(64), train=True)
    assert {k[1] for k in PL.served_backends()} == {backend_name}


def test_pretrained_cfgs_are_timms():
    """Same tags, Hub ids, URLs and preprocessing as timm's cfgs: pretrained=True downloads timm's file."""
    for fast, name in FAST_VARIANTS.items():
        tags = [n.split('.', 1)[1] for n in timm.list_models(name, pretrained=True, include_tags=True)]
        ours = [n.split('.', 1)[1] for n in timm.list_models(fast, pretrained=True, include_tags=True)]
        assert ours == tags and tags
        for tag in tags:
            a = timm.models.get_pretrained_cfg(f'{name}.{tag}').to_dict()
            b = timm.models.get_pretrained_cfg(f'{fast}.{tag}').to_dict()
            assert b.pop('architecture') == fast and a.pop('architecture') == name
            assert b.pop('notes') and a.pop('notes', None) is None
            assert a == b and b['hf_hub_id'] == f'timm/{name}.{tag}' and b['url'].startswith('https://')


@pytest.mark.parametrize('name,size', [('lambda_resnet26t', 64), ('lambda_resnet26rpt_256', 64)])
def test_pretrained_file_through_timms_machinery(name, size, tmp_path):
    """timm's checkpoint (here a random timm model saved as timm's files are: a bare state_dict) through
    ``timm.create_model(NAME_fast.TAG, pretrained=True, pretrained_cfg_overlay=dict(file=...))``: the classifier
    model, a new classifier (``num_classes``), one input channel (``in_chans``) and ``features_only`` all equal timm's
    on it."""
    ref = _timm_model(name, size, torch.float32, num_classes=1000).eval()
    path = tmp_path / 'timm.pth'
    torch.save(ref.state_dict(), path)
    tag = timm.models.get_pretrained_cfg(name).tag
    kw = dict(pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), width_factor=0.25)
    if 'rpt' in name:
        kw['img_size'] = size
    fast = timm.create_model(f'{name}_fast.{tag}', **kw).eval()
    assert fast.pretrained_cfg['tag'] == tag and isinstance(fast.stages[3][0].self_attn, TimmLambdaLayer)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(4))
    assert _rel(fast(x), ref(x)) <= 1e-5
    head = timm.create_model(f'{name}_fast.{tag}', num_classes=3, **kw).eval()  # timm drops the classifier
    gray = timm.create_model(f'{name}_fast.{tag}', in_chans=1, **kw).eval()  # timm sums the stem's weights
    assert _rel(gray(x.mean(1, keepdim=True)), ref(x.mean(1, keepdim=True).expand(-1, 3, -1, -1))) <= 1e-5
    assert _rel(head.forward_head(head.forward_features(x), pre_logits=True),
                ref.forward_head(ref.forward_features(x), pre_logits=True)) <= 1e-5
    feats = timm.create_model(f'{name}_fast.{tag}', features_only=True, **kw).eval()
    want = timm.create_model(f'{name}.{tag}', features_only=True, **kw).eval()
    with torch.no_grad():
        got, ref_feats = feats(x), want(x)
    assert feats.feature_info.reduction() == [2, 4, 8, 16, 32] and len(got) == len(ref_feats) == 5
    for a, b in zip(got, ref_feats):
        assert _rel(a, b) <= 1e-5


def test_checkpoint_filter_passes_our_keys_through():
    fast = timm.create_model('lambda_resnet26t_fast', num_classes=10)
    state = fast.state_dict()
    assert checkpoint_filter_timm_lambda_layers(state) == state
    with pytest.raises(ValueError, match='conv_lambda.weight'):
        checkpoint_filter_timm_lambda_layers({'a.conv_lambda.weight': torch.zeros(4, 1, 3, 3)})


@pytest.mark.parametrize('kw', [dict(r=3, stride=2, qkv_bias=True), dict(r=None, feat_size=(6, 4), stride=2)],
                         ids=['local_s2_qkv_bias', 'rpt_s2'])
def test_converted_layer_reparameterizes_and_compiles(kw):
    """timm's ``reparameterize_model`` (the norms folded into the projection, its bias kept) and a full-graph
    ``torch.compile`` (aot_eager) of the converted layer give timm's eval output."""
    from timm.utils.model import reparameterize_model
    ref, fast = _layer_pair(kw, torch.float64)
    x = torch.randn(2, 16, 6, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        want = ref.eval()(x)
        folded = reparameterize_model(nn.Sequential(fast.eval()))[0]
        assert isinstance(folded.norm_q, nn.Identity) and folded.qkv.bias is not None
        assert _rel(folded(x), want) <= 1e-10
        torch._dynamo.reset()
        assert _rel(torch.compile(fast, backend='aot_eager', fullgraph=True)(x), want) <= 1e-10
