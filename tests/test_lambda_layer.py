"""Tests of the multi-query LambdaLayer (NCHW) against the paper, via a naive float64 reference."""
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from _layer_helpers import CUSTOM_OP_FLOPS, perturb_for_eval
from reference import lambda_layer_reference
from timm_lambda.layers import LambdaLayer, RelativePositionEmbedding

FORMS = ['einsum', 'conv', 'dense', 'tiled']


def _make(seed=0, emb_scale=0.3, **kw) -> LambdaLayer:
    torch.manual_seed(seed)
    kw.setdefault('dim', 8)
    kw.setdefault('dim_k', 4)
    kw.setdefault('heads', 2)
    return perturb_for_eval(LambdaLayer(**kw), torch.Generator().manual_seed(seed), emb_scale).eval()


# (name, layer kwargs, input shape [B, C, H, W]); every case runs with both implementations.
REF_CASES = [
    ('local_u1_nonsquare', dict(scope=3), (2, 8, 5, 7)),
    ('local_u2_nonsquare', dict(scope=5, dim_u=2), (2, 8, 6, 4)),
    ('local_nonsquare_scope', dict(scope=(3, 5)), (2, 8, 6, 7)),
    ('global_u1', dict(scope='global', max_size=(6, 7)), (2, 8, 5, 7)),
    ('global_u3_small_input', dict(scope='global', max_size=(6, 7), dim_u=3), (2, 8, 3, 2)),
    ('smaller_than_scope', dict(scope=23), (2, 8, 4, 5)),
    ('smaller_than_scope_u2', dict(scope=7, dim_u=2), (2, 8, 2, 3)),
    ('one_by_one', dict(scope=3), (2, 8, 1, 1)),
    ('one_row', dict(scope=5), (2, 8, 1, 6)),
    ('stride2_odd', dict(scope=3, stride=2), (2, 8, 5, 7)),
    ('stride2_odd_u2_global', dict(scope='global', max_size=(7, 7), stride=2, dim_u=2), (2, 8, 7, 3)),
    ('stride2_one_by_one', dict(scope=3, stride=2), (2, 8, 1, 1)),
    ('batch1', dict(scope=5), (1, 8, 4, 6)),
    ('content_only', dict(scope=3, position=False), (2, 8, 4, 5)),
    ('position_only', dict(scope=3, content=False), (2, 8, 4, 5)),
    ('key_norm_l2', dict(scope=3, key_norm='l2'), (2, 8, 4, 5)),
    ('key_norm_none', dict(scope=3, key_norm='none'), (2, 8, 4, 5)),
    ('qv_norm_false', dict(scope=3, qv_norm=False), (2, 8, 4, 5)),
    ('dim_out_heads', dict(scope=3, dim_out=12, heads=3, dim_k=2), (2, 8, 4, 3)),
]


@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('name,kw,shape', REF_CASES, ids=[c[0] for c in REF_CASES])
def test_matches_naive_reference(name, kw, shape, form):
    layer = _make(form=form, **kw)
    assert layer.choose_form(*shape[2:]) == (form if layer.position else 'none')
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    y = layer(x)
    ref = lambda_layer_reference(layer, x)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert ref.abs().max() > 0.05, 'reference output is trivially small; the comparison would be vacuous'
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_reference_detects_wrong_embedding_offset():
    """The reference comparison can fail: a transposed (n - m instead of m - n) table is caught."""
    layer = _make(form='conv', scope=3, content=False)
    x = torch.randn(1, 8, 4, 5, generator=torch.Generator().manual_seed(2))
    ref = lambda_layer_reference(layer, x)
    with torch.no_grad():
        layer.pos_embedding.weight.copy_(layer.pos_embedding.weight.flip(-1, -2))
    assert not torch.allclose(layer(x).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('form', FORMS)
def test_impls_agree_at_lambdaresnet_defaults(form):
    """Default |k|=16, |h|=4, scope 23 on an input larger than the scope: both match the reference."""
    layer = _make(dim=16, dim_k=16, heads=4, form=form, emb_scale=0.05)
    x = torch.randn(1, 16, 12, 9, generator=torch.Generator().manual_seed(3)) * 0.5
    ref = lambda_layer_reference(layer, x)
    assert ref.abs().max() > 0.05
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('kw', [dict(scope=3, dim_u=2, stride=2), dict(scope='global', max_size=(3, 4))],
                         ids=['local_u2_stride2', 'global'])
def test_gradcheck_float64(form, kw):
    torch.manual_seed(0)
    layer = LambdaLayer(4, dim_k=2, heads=2, form=form, **kw).double().train()  # BN batch stats
    x = torch.randn(2, 4, 3, 4, dtype=torch.float64, requires_grad=True)
    names = ['qkv.weight', 'pos_embedding.weight', 'norm_q.weight', 'norm_v.bias']
    params = {n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters() if n in names}
    assert len(params) == len(names)

    def fn(x, *ps):
        return torch.func.functional_call(layer, dict(zip(params, ps)), (x,))

    assert torch.autograd.gradcheck(fn, (x, *params.values()), eps=1e-6, atol=1e-6, rtol=1e-5, fast_mode=True)


def _shift_zero(x, sy, sx):
    out = torch.zeros_like(x)
    out[..., sy:, sx:] = x[..., :x.shape[-2] - sy, :x.shape[-1] - sx]
    return out


@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('mode', ['circular', 'zero'])
def test_position_term_translation_equivariant(form, mode):
    """content=False: shifting the input shifts the output away from the borders (section 3.3)."""
    scope, (sy, sx) = 5, (2, 3)
    r = scope // 2
    layer = _make(form=form, scope=scope, content=False)
    x = torch.randn(2, 8, 12, 13, generator=torch.Generator().manual_seed(4))
    xs = torch.roll(x, (sy, sx), dims=(-2, -1)) if mode == 'circular' else _shift_zero(x, sy, sx)
    y, ys = layer(x), layer(xs)
    H, W = x.shape[-2:]
    # query i in the shifted image only sees rows i-r..i+r >= sy (un-wrapped content) and
    # query i - sy in the original sees rows inside the image: margin r + shift on each side
    rows, cols = slice(sy + r, H - r), slice(sx + r, W - r)
    rows0, cols0 = slice(r, H - r - sy), slice(r, W - r - sx)
    assert rows.stop - rows.start >= 3 and cols.stop - cols.start >= 3
    torch.testing.assert_close(ys[..., rows, cols], y[..., rows0, cols0], rtol=1e-5, atol=1e-5)
    # and the check is not vacuous: without the shift the interiors differ
    assert not torch.allclose(ys[..., rows, cols], y[..., rows, cols], atol=1e-3)


@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('hw,stride', [((1, 1), 1), ((1, 7), 1), ((9, 2), 1), ((3, 30), 1),
                                       ((7, 5), 2), ((5, 5), 2), ((1, 1), 2), ((2, 9), 2)])
def test_any_size_shapes(form, hw, stride):
    layer = _make(form=form, scope=23, stride=stride, dim_out=12, heads=3)
    x = torch.randn(1, 8, *hw, requires_grad=True)
    y = layer(x)
    assert y.shape == (1, 12, math.ceil(hw[0] / stride), math.ceil(hw[1] / stride))
    assert torch.isfinite(y).all()
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16], ids=['bf16', 'fp16'])
def test_cpu_autocast(form, dtype):
    layer = _make(form=form, scope=5, dim_u=2, stride=2)
    x = torch.randn(2, 8, 7, 6, generator=torch.Generator().manual_seed(5))
    ref = layer(x)
    with torch.autocast('cpu', dtype=dtype):
        y = layer(x)
    assert y.dtype == dtype
    assert torch.isfinite(y).all()
    # low-precision result is close to the float32 one (half/bfloat16 round-off only), and farther from it than the
    # float32 result rounded once to the 16-bit dtype: computed in that dtype, not in float32 and rounded at the end
    err = ((y.float() - ref).norm() / ref.norm()).item()
    rounded_once = ((ref.to(dtype).float() - ref).norm() / ref.norm()).item()
    assert 1.2 * rounded_once < err < (0.05 if dtype == torch.bfloat16 else 0.01), (err, rounded_once)
    y.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in layer.parameters())


@pytest.mark.parametrize('form', FORMS)
def test_channels_last_same_output(form):
    layer = _make(form=form, scope=3, dim_u=2)
    x = torch.randn(2, 8, 6, 5)
    y = layer(x)
    y_cl = layer(x.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(y_cl, y, rtol=1e-5, atol=1e-5)
    layer_cl = layer.to(memory_format=torch.channels_last)
    torch.testing.assert_close(layer_cl(x.contiguous(memory_format=torch.channels_last)), y, rtol=1e-5, atol=1e-5)


# fullgraph=True from the floor on: torch 2.4's dynamo cannot trace torch.amp.is_autocast_available, which the
# kernels' autocast check therefore asks for devices other than cpu / cuda only (tested: 2.4.1, 2.14.1).


@pytest.mark.parametrize('form,backend', [(form, 'aot_eager') for form in FORMS] + [
    pytest.param(form, 'inductor', marks=pytest.mark.slow) for form in ('dense', 'tiled')])
def test_torch_compile_matches_eager(form, backend, monkeypatch):
    """A training step of the compiled layer (many chunks of query blocks, stride 2, |u| = 2): output and every
    gradient equal to eager, with the operators' own backward (not the higher-order fallback) in the compiled
    backward. Inductor (C++ code generation) for the two forms that run custom operators: the reference forms are
    plain ops, which ``aot_eager`` already traces."""
    from timm_lambda.layers.position_lambda import custom_ops, gemm
    monkeypatch.setattr(gemm, 'CPU_CHUNK_ROWS', 64)
    fallback = []
    plain_vjp = custom_ops._higher_order
    monkeypatch.setattr(custom_ops, '_higher_order', lambda *a: fallback.append(1) or plain_vjp(*a))
    torch._dynamo.reset()
    layer = _make(form=form, scope=3, dim_u=2).train()
    x = torch.randn(2, 8, 5, 6, requires_grad=True)
    y = layer(x)
    (gx,) = torch.autograd.grad(y.square().sum(), x)
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    xc = x.detach().clone().requires_grad_(True)
    yc = compiled(xc)
    (gxc,) = torch.autograd.grad(yc.square().sum(), xc)
    torch.testing.assert_close(yc, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gxc, gx, rtol=1e-5, atol=1e-5)
    assert not fallback


@pytest.mark.parametrize('form', FORMS)
def test_torchscript_trace_and_script(form):
    """torch.jit.trace and torch.jit.script both compile the layer (TorchScript runs the plain-op forms and warns
    once that it does); the trace fixes the form chosen for the traced input size."""
    import warnings
    layer = _make(form=form, scope=3)
    x = torch.randn(2, 8, 5, 6)
    traced = torch.jit.trace(layer, (x,), check_trace=False)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # torch.jit.script is deprecated; the layer's one-time RuntimeWarning
        scripted = torch.jit.script(layer)
    x2 = torch.randn(2, 8, 5, 6)
    torch.testing.assert_close(traced(x2), layer(x2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scripted(x2), layer(x2), rtol=1e-5, atol=1e-5)


def test_global_scope_larger_than_max_size_raises():
    layer = LambdaLayer(8, dim_k=4, heads=2, scope='global', max_size=(4, 6))
    layer(torch.randn(1, 8, 4, 6))  # at max_size: fine
    for hw in [(5, 6), (4, 7)]:
        for form in FORMS:
            layer.form = form
            with pytest.raises(ValueError, match='max_size'):
                layer(torch.randn(1, 8, *hw))


def test_global_scope_requires_max_size():
    with pytest.raises(ValueError, match='max_size'):
        LambdaLayer(8, dim_k=4, heads=2, scope='global')


def test_initialisation_appendix_f2():
    """Embeddings N(0, 1); W_K, W_V std d^-1/2; W_Q std (|k| d)^-1/2 (appendix F.2)."""
    torch.manual_seed(0)
    d, k, h, u = 1024, 16, 4, 1
    layer = LambdaLayer(d, dim_out=512, dim_k=k, heads=h, dim_u=u, scope=23)
    w = layer.qkv.weight.detach()[:, :, 0, 0]
    v = layer.dim_v
    w_q, w_k, w_v = w[:h * k], w[h * k:h * k + k * u], w[h * k + k * u:]
    assert w_v.shape[0] == v * u
    for name, t, std in [('W_Q', w_q, (k * d) ** -0.5), ('W_K', w_k, d ** -0.5), ('W_V', w_v, d ** -0.5),
                         ('E', layer.pos_embedding.weight.detach(), 1.0)]:
        assert abs(t.std().item() / std - 1) < 0.03, (name, t.std().item(), std)
        assert abs(t.mean().item()) < 0.03 * std, (name, t.mean().item())


class _NumelTracker(TorchDispatchMode):
    """Records the numel of every tensor produced by an aten op (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel, self.max_op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.max_numel:
                self.max_numel, self.max_op = t.numel(), str(func)
        return out


def _largest_intermediate(form, device, B=2, H=64, W=64):
    torch.manual_seed(0)
    layer = LambdaLayer(16, dim_k=16, heads=4, scope=23, form=form).to(device)  # |v| = 4
    x = torch.randn(B, 16, H, W, device=device, requires_grad=True)
    with _NumelTracker() as tr:
        layer(x).square().sum().backward()
    assert x.grad is not None and layer.pos_embedding.weight.grad is not None
    return tr


def test_conv_impl_never_materialises_n_by_m():
    """Lambda convolution (section 3.4): no b x n x m (not even n x m) tensor in forward/backward."""
    B, n = 2, 64 * 64
    tr = _largest_intermediate('conv', 'cpu', B)
    assert tr.max_numel < n * n <= B * n * n, (tr.max_numel, tr.max_op)


def test_einsum_impl_does_materialise_n_by_m():
    """The same tracker flags the einsum implementation ([k, u, n, m] embeddings), so the check above
    can fail. Run on the meta device: identical dispatch, no 1 GiB allocation."""
    B, n = 2, 64 * 64
    tr = _largest_intermediate('einsum', 'meta', B)
    assert tr.max_numel >= 16 * n * n > B * n * n, (tr.max_numel, tr.max_op)


def test_bad_arguments_raise_value_error_naming_parameter():
    cases = [
        (dict(dim=8, heads=3), 'heads'),
        (dict(dim=8, dim_out=10, heads=4), 'heads'),
        (dict(dim=8, scope=4), 'scope'),
        (dict(dim=8, scope=0), 'scope'),
        (dict(dim=8, scope=-3), 'scope'),
        (dict(dim=8, scope=(3, 2)), 'scope'),
        (dict(dim=8, form='fft'), 'form'),
        (dict(dim=8, key_norm='sigmoid'), 'key_norm'),
        (dict(dim=8, stride=3), 'stride'),
        (dict(dim=8, dim_k=4, pos_embedding=RelativePositionEmbedding(8, 1, 23)), 'pos_embedding'),
        (dict(dim=8, dim_k=4, dim_u=2, pos_embedding=RelativePositionEmbedding(4, 1, 23)), 'pos_embedding'),
        (dict(dim=8, dim_k=4, scope=5, pos_embedding=RelativePositionEmbedding(4, 1, 3)), 'pos_embedding'),
    ]
    for kw, name in cases:
        with pytest.raises(ValueError, match=name):
            LambdaLayer(**kw)
    layer = LambdaLayer(8, dim_k=4, heads=2, scope=3)
    with pytest.raises(ValueError, match=r'x of shape \[B, 8, H, W\]'):
        layer(torch.randn(1, 6, 4, 4))
    with pytest.raises(ValueError, match='x of shape'):
        layer(torch.randn(8, 4, 4))
    for h, w in ((0, 0), (0, 5), (5, 0)):
        with pytest.raises(ValueError, match=rf'at least 1x1 \(H, W >= 1\), got {h}x{w}'):
            layer(torch.randn(1, 8, h, w))


def _emb(layer):
    return layer.pos_embedding


def test_shared_embedding_counted_once_and_grads_accumulate():
    """Table 4: layers given one RelativePositionEmbedding share its parameter."""
    torch.manual_seed(0)
    emb = RelativePositionEmbedding(4, 2, 5)
    kw = dict(dim=8, dim_k=4, heads=2, dim_u=2, scope=5)
    l1 = LambdaLayer(**kw, pos_embedding=emb, form='einsum')
    l2 = LambdaLayer(**kw, pos_embedding=emb, form='conv')
    model = nn.Sequential(l1, nn.ReLU(), l2).train()
    params = list(model.parameters())
    assert sum(p is emb.weight for p in params) == 1
    assert _emb(l1) is emb and _emb(l2) is emb
    # an unshared twin: each layer owns a copy of the same table; all other weights equal
    u1, u2 = LambdaLayer(**kw, form='einsum'), LambdaLayer(**kw, form='conv')
    twin = nn.Sequential(u1, nn.ReLU(), u2).train()
    with torch.no_grad():
        for src, dst in ((l1, u1), (l2, u2)):
            for (name, p), (name2, q) in zip(
                    [(n, p) for n, p in src.named_parameters() if 'pos_embedding' not in n],
                    [(n, q) for n, q in dst.named_parameters() if 'pos_embedding' not in n]):
                assert name == name2
                q.copy_(p)
            _emb(dst).weight.copy_(emb.weight)
    n_twin = sum(p.numel() for p in twin.parameters())
    assert sum(p.numel() for p in params) == n_twin - emb.weight.numel()

    x = torch.randn(2, 8, 6, 5)
    y = model(x)
    torch.testing.assert_close(y, twin(x), rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    twin(x).square().sum().backward()
    g1, g2 = _emb(u1).weight.grad, _emb(u2).weight.grad
    assert g1.abs().sum() > 0 and g2.abs().sum() > 0
    # the shared parameter receives the sum of both layers' gradients
    torch.testing.assert_close(emb.weight.grad, g1 + g2, rtol=1e-5, atol=1e-6)


def _position_macs(layer, B, H, W, form):
    """Multiply-adds of the two contractions of the position lambdas of the form ``form`` (a LambdaLayer forward),
    computed from their equations."""
    k, h, u, v, n = layer.dim_k, layer.heads, layer.dim_u, layer.dim_v, H * W
    th, tw = (2 * H - 1, 2 * W - 1) if layer.global_scope else layer.scope  # the table cut to the input
    if form == 'einsum':  # lambda^p_n = E_n v for every n (|k||v||u||m| per query), then (lambda^p_n)^T q_n^h
        return B * n * k * v * u * n, B * h * k * v * n
    if form == 'conv':  # the lambda convolution: |k||v| outputs per position, |u| K_h K_w deep
        return B * k * v * n * u * th * tw, B * h * k * v * n
    if form == 'dense':  # logits q_n . E_nm, then logits x values: |h|(|k| + |v|) per (n, m) pair and |u|
        return B * h * n * u * n * k, B * h * n * u * n * v
    # tiled: each query against its own K_h x K_w scope (the CPU kernel's arithmetic): logits |k| (pooled: 9|k| deep
    # against the 3x3-shifted tables, K + 2 wide) per offset, output |v| per offset that meets the image (a stride-2
    # output o's window starts at input row 2 o - 1 - K // 2)
    step, c = (1, k) if layer.stride == 1 else (2, 9 * k)
    th, tw = th + 2 * (step - 1), tw + 2 * (step - 1)
    queries_y, queries_x = -(-H // layer.stride), -(-W // layer.stride)
    rows = B * queries_y * queries_x * h

    def meeting(size, queries, k):  # (query, offset) pairs along one axis whose input position is in the image
        return sum(0 <= step * o + e - (k - 1) // 2 < size for o in range(queries) for e in range(k))

    return rows * c * u * th * tw, B * h * u * v * meeting(H, queries_y, th) * meeting(W, queries_x, tw)


def _content_macs(layer, B, H, W):
    """Multiply-adds of the content lambda's application to the queries (eq. 2): |h||k||v| per output (a stride-2
    layer applies it to the pooled queries)."""
    n_out = -(-H // layer.stride) * -(-W // layer.stride)
    return B * layer.heads * layer.dim_k * layer.dim_v * n_out


def _macs_by_hand(layer, B, H, W, form):
    """Multiply-adds of a LambdaLayer forward: the 1x1 projections, the content lambda (eq. 1) and its application
    to the queries (eq. 2), and the position lambdas."""
    d, k, h, u, v, n = layer.dim, layer.dim_k, layer.heads, layer.dim_u, layer.dim_v, H * W
    return B * n * d * (h * k + k * u + v * u) + B * u * k * n * v + _content_macs(layer, B, H, W) + sum(
        _position_macs(layer, B, H, W, form))


@CUSTOM_OP_FLOPS
@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('kw,size', [(dict(scope=5, dim_u=2), (13, 10)), (dict(scope=7, stride=2), (19, 17)),
                                     (dict(scope='global', max_size=(9, 9)), (9, 7))], ids=['u2', 'stride2', 'global'])
def test_flop_counter_counts_every_form(form, kw, size):
    """torch.utils.flop_counter.FlopCounterMode sees the position lambdas of every form (the custom operators have
    FLOP formulas), 2 FLOPs per multiply-add; the operators' backward: the logits recomputed and the gradients,
    3x the first contraction and 2x the second (the tiled one's content term at stride 1: 2x, the gradients of the
    queries and of the content lambda)."""
    from torch.utils.flop_counter import FlopCounterMode
    layer = LambdaLayer(8, dim_k=4, heads=2, form=form, **kw)
    x = torch.randn(2, 8, *size, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        y = layer(x)
    assert counter.get_total_flops() == 2 * _macs_by_hand(layer, 2, *size, form)
    if form in ('dense', 'tiled'):
        with FlopCounterMode(display=False) as counter:
            y.sum().backward()
        ops = {str(op): n for op, n in counter.get_flop_counts()['Global'].items()}
        first, second = _position_macs(layer, 2, *size, form)
        # the operator computes the content lambda and its term inside, their gradients twice each
        n = size[0] * size[1]
        content = 2 * (_content_macs(layer, 2, *size) + 2 * layer.dim_u * layer.dim_k * n * layer.dim_v)
        assert ops['timm_lambda.lambda_layer_backward'] == 2 * (3 * first + 2 * second + content)


@CUSTOM_OP_FLOPS
def test_flop_count_of_the_issue_example():
    """LambdaLayer(256) at 64x64 (|k|=16, |h|=4, |v|=64, 23x23 scope, the tiled form): 0.77 GMACs, of which the
    position lambdas are 0.60 G (FlopCounterMode saw 0.17 G before their operators had FLOP formulas; the GEMM
    path, against whole 30x30 windows, does 1.08 G)."""
    from torch.utils.flop_counter import FlopCounterMode
    layer = LambdaLayer(256)
    with FlopCounterMode(display=False) as counter:
        layer(torch.randn(1, 256, 64, 64))
    assert layer.choose_form(64, 64) == 'tiled'
    assert counter.get_total_flops() == 2 * _macs_by_hand(layer, 1, 64, 64, 'tiled')


@pytest.mark.parametrize('kw', [dict(), dict(stride=2), dict(dim_u=2, scope=5), dict(scope='global', max_size=(6, 7)),
                                dict(position_bias=True, key_norm='l2')], ids=['s1', 's2', 'u2', 'global', 'bias_l2'])
def test_reparameterize_folds_the_norms_and_keeps_eval_outputs(kw):
    """``reparameterize()`` (timm's ``reparameterize_model``): the query and value batch norms folded into the
    projection, replaced by ``nn.Identity``; the eval output equals the float64 per-query reference of the layer
    before (its running statistics and affine parameters non-trivial)."""
    from timm.utils.model import reparameterize_model
    g = torch.Generator().manual_seed(3)
    layer = perturb_for_eval(LambdaLayer(8, dim_k=4, heads=2, **kw).double().eval(), g)
    x = torch.randn(2, 8, 6, 7, generator=g, dtype=torch.float64)
    ref = lambda_layer_reference(layer, x)
    folded = reparameterize_model(nn.Sequential(layer))[0]
    assert isinstance(folded.norm_q, nn.Identity) and isinstance(folded.norm_v, nn.Identity)
    assert folded.qkv.bias is not None and isinstance(layer.norm_q, nn.BatchNorm2d)  # (a copy: the layer unchanged)
    with torch.no_grad():
        torch.testing.assert_close(folded(x), ref, rtol=1e-10, atol=1e-10)


def test_reparameterize_leaves_other_norms_and_compiles():
    """A GroupNorm (no running statistics) is not folded; a folded layer's compiled forward (one convolution each for
    q, keys, values, with the bias's slices) equals its eager forward."""
    gn = LambdaLayer(8, dim_k=4, heads=2, scope=3, norm_layer=lambda c, **k: nn.GroupNorm(2, c, **k)).eval()
    gn.reparameterize()
    assert isinstance(gn.norm_q, nn.GroupNorm) and gn.qkv.bias is None
    g = torch.Generator().manual_seed(4)
    layer = perturb_for_eval(LambdaLayer(8, dim_k=4, heads=2, scope=3).double().eval(), g)
    layer.reparameterize()
    x = torch.randn(1, 8, 5, 4, generator=g, dtype=torch.float64)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(layer, backend='aot_eager', fullgraph=True)(x), layer(x),
                                   rtol=1e-12, atol=1e-12)
