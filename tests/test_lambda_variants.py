"""Tests of the masked (causal) 1-D lambda layer (Fig. 6) and the multi-head lambda layer (Fig. 7)."""
import pytest
import torch

from _layer_helpers import perturb_for_eval
from reference import masked_lambda_reference, multihead_lambda_reference
from timm_lambda.layers import MaskedLambdaLayer1d, MultiHeadLambdaLayer


def _masked(seed=0, emb_scale=0.3, **kw):
    torch.manual_seed(seed)
    kw.setdefault('dim', 8)
    kw.setdefault('dim_k', 4)
    kw.setdefault('heads', 2)
    kw.setdefault('max_len', 12)
    layer = MaskedLambdaLayer1d(**kw)
    with torch.no_grad():
        layer.rel_emb.mul_(emb_scale)
    return layer


def _random_mask(n, seed=0, p=0.5):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, n, generator=g) < p
    mask[0] = False  # a query with an empty context: lambda_0 = 0
    mask[1, 1] = True
    return mask


MASKED_CASES = [
    ('causal', dict(), None),
    ('causal_local_scope', dict(scope=3), None),
    ('causal_key_norm_none', dict(key_norm='none'), None),
    ('not_causal', dict(causal=False), None),
    ('explicit_causal_mask', dict(), 'causal'),
    ('explicit_random_mask', dict(), 'random'),
    ('explicit_random_mask_scope', dict(scope=5, dim_out=12, heads=3), 'random'),
]


def _mask_for(kind, n):
    if kind == 'causal':
        idx = torch.arange(n)
        return idx[None, :] <= idx[:, None]
    if kind == 'random':
        return _random_mask(n)
    return None


@pytest.mark.parametrize('name,kw,mask_kind', MASKED_CASES, ids=[c[0] for c in MASKED_CASES])
def test_masked_matches_naive_reference(name, kw, mask_kind):
    layer = _masked(**kw)
    N = 9
    x = torch.randn(2, N, 8, generator=torch.Generator().manual_seed(1))
    mask = _mask_for(mask_kind, N)
    y = layer(x, mask)
    ref = masked_lambda_reference(layer, x, mask)
    assert ref.abs().max() > 0.05
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    # float64 end to end (no silent float32 downcast inside the layer)
    torch.testing.assert_close(layer.double()(x.double(), mask), ref, rtol=1e-10, atol=1e-10)


def test_masked_reference_detects_global_key_normalisation():
    """The Fig. 6 reference normalises keys per query context; a layer that normalised over the
    whole sequence (leaking the future) would not match it."""
    layer = _masked()
    x = torch.randn(1, 7, 8, generator=torch.Generator().manual_seed(2))
    ref = masked_lambda_reference(layer, x)
    leaky = masked_lambda_reference(layer, x, torch.ones(7, 7, dtype=torch.bool))
    torch.testing.assert_close(layer(x).double(), ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(layer(x).double(), leaky, atol=1e-3)


def _input_grads(layer, x, mask=None):
    """jac[t, m] = |d y_t / d x_m| summed over batch/features; exact zeros where independent."""
    N = x.shape[1]
    jac = torch.zeros(N, N, dtype=torch.float64)
    for t in range(N):
        xg = x.detach().clone().requires_grad_(True)
        y = layer(xg, mask)
        (g,) = torch.autograd.grad(y[:, t].sum() + y[:, t].square().sum(), xg)
        jac[t] = g.abs().sum(dim=(0, 2)).double()
    return jac


@pytest.mark.parametrize('kw', [dict(), dict(scope=3), dict(key_norm='none')], ids=['global', 'scope3', 'no_norm'])
def test_causal_default_no_dependence_on_future(kw):
    layer = _masked(**kw)
    N = 8
    x = torch.randn(2, N, 8)
    jac = _input_grads(layer, x)
    future = torch.triu(torch.ones(N, N, dtype=torch.bool), diagonal=1)
    assert (jac[future] == 0).all(), jac
    assert (jac[~future] > 0).all()  # and it does depend on the past/present


def test_explicit_mask_no_dependence_outside_context():
    layer = _masked(causal=False)
    N = 8
    mask = _random_mask(N, seed=3)
    x = torch.randn(2, N, 8)
    jac = _input_grads(layer, x, mask)
    outside = ~mask & ~torch.eye(N, dtype=torch.bool)  # y_n always depends on x_n (its query)
    assert (jac[outside] == 0).all(), jac
    inside = mask & ~torch.eye(N, dtype=torch.bool)
    assert (jac[inside] > 0).all()
    # without the mask the same layer (causal=False) sees everything, so the check can fail
    assert (_input_grads(layer, x)[outside] > 0).all()


def test_causal_outputs_unchanged_when_future_changes():
    """Value-level causality: replacing future inputs leaves past outputs unchanged
    (keys of moderate magnitude; see report for the extreme-magnitude caveat)."""
    layer = _masked()
    x = torch.randn(2, 10, 8)
    y = layer(x)
    x2 = x.clone()
    x2[:, 6:] = 5 * torch.randn(2, 4, 8)
    y2 = layer(x2)
    torch.testing.assert_close(y2[:, :6], y[:, :6], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(y2[:, 6:], y[:, 6:], atol=1e-3)


def test_masked_gradcheck_float64():
    layer = _masked(dim=4, dim_k=2, heads=2, max_len=5).double()
    x = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    mask = _random_mask(5, seed=4)
    assert torch.autograd.gradcheck(lambda t: layer(t), (x,), fast_mode=True)
    assert torch.autograd.gradcheck(lambda t: layer(t, mask), (x,), fast_mode=True)


def test_masked_bad_arguments():
    for kw, name in [(dict(dim=8, heads=3), 'heads'), (dict(dim=8, scope=4), 'scope'),
                     (dict(dim=8, key_norm='l2x'), 'key_norm'), (dict(dim=8, max_len=0), 'max_len')]:
        with pytest.raises(ValueError, match=name):
            MaskedLambdaLayer1d(**kw)
    layer = MaskedLambdaLayer1d(8, max_len=4)
    with pytest.raises(ValueError, match='max_len'):
        layer(torch.randn(1, 5, 8))
    with pytest.raises(ValueError, match='mask'):
        layer(torch.randn(1, 3, 8), torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match='x must have shape'):
        layer(torch.randn(1, 3, 7))


def _multihead(seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault('dim', 8)
    kw.setdefault('dim_k', 3)
    kw.setdefault('heads', 2)
    layer = MultiHeadLambdaLayer(**kw)
    g = torch.Generator().manual_seed(seed)
    return perturb_for_eval(layer, g).eval()


MH_CASES = [
    ('local', dict(scope=3), (2, 8, 5, 6)),
    ('local_scope_larger_than_input', dict(scope=23), (1, 8, 3, 4)),
    ('global', dict(scope='global', max_size=(5, 6)), (2, 8, 4, 6)),
    ('stride2_odd', dict(scope=3, stride=2), (2, 8, 5, 3)),
    ('four_heads_l2', dict(scope=5, heads=4, dim_k=2, key_norm='l2'), (2, 8, 4, 4)),
    ('qv_norm_false', dict(scope=3, qv_norm=False, dim_out=6, heads=3), (2, 8, 3, 5)),
]


@pytest.mark.parametrize('name,kw,shape', MH_CASES, ids=[c[0] for c in MH_CASES])
def test_multihead_matches_naive_reference(name, kw, shape):
    layer = _multihead(**kw)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    y = layer(x)
    ref = multihead_lambda_reference(layer, x)
    assert ref.abs().max() > 0.05
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_multihead_heads_are_independent():
    """Per-head lambdas: head h's output depends only on head h's key/value projections."""
    layer = _multihead(scope=3, heads=2, dim_k=3)
    x = torch.randn(1, 8, 4, 4)
    y = layer(x)
    hk, v = 2 * 3, layer.dim_v
    with torch.no_grad():
        layer.qkv.weight[hk:hk + 3].add_(0.5)  # keys of head 0
        layer.qkv.weight[2 * hk:2 * hk + v].add_(0.5)  # values of head 0
    y2 = layer(x)
    torch.testing.assert_close(y2[:, v:], y[:, v:], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(y2[:, :v], y[:, :v], atol=1e-3)


def test_multihead_bad_arguments():
    for kw, name in [(dict(dim=8, heads=3), 'heads'), (dict(dim=8, stride=3), 'stride'),
                     (dict(dim=8, scope=2), 'scope'), (dict(dim=8, key_norm='x'), 'key_norm')]:
        with pytest.raises(ValueError, match=name):
            MultiHeadLambdaLayer(**kw)
    with pytest.raises(ValueError, match='x of shape'):
        MultiHeadLambdaLayer(8, dim_k=2, heads=2, scope=3)(torch.randn(1, 4, 3, 3))


def test_causal_is_exact_for_extreme_key_magnitudes():
    """Future keys ~100x larger must not underflow the past: prefix log-sum-exp normalisation."""
    layer = _masked()
    x = torch.randn(2, 10, 8)
    y = layer(x)
    x2 = x.clone()
    x2[:, 6:] *= 100
    y2 = layer(x2)
    torch.testing.assert_close(y2[:, :6], y[:, :6], rtol=1e-5, atol=1e-5)
    ref = masked_lambda_reference(layer, x2.double())
    torch.testing.assert_close(y2.double(), ref, rtol=1e-4, atol=1e-4)


def test_general_mask_falls_back_exactly_when_keys_underflow():
    """A general mask whose contexts sit far below the global key maximum is recomputed per query
    (fails without the fallback: every exp underflows to 0)."""
    layer = _masked(causal=False)
    N = 8
    mask = _random_mask(N, seed=3)
    x = torch.randn(2, N, 8)
    x[:, 5] *= 1000  # one huge key drags the global shift ~1000 above the other contexts
    out = layer(x, mask)
    ref = masked_lambda_reference(layer, x.double(), mask)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


def _outputs_and_grads(layer, x, mask, unseen):
    """Outputs, and the input and parameter gradients of a loss on the queries ``unseen`` only."""
    layer.zero_grad()
    xg = x.clone().requires_grad_(True)
    y = layer(xg, mask)
    (y[:, unseen].square().sum() + y[:, unseen].sum()).backward()
    return y.detach(), xg.grad, {name: p.grad.clone() for name, p in layer.named_parameters()}


@pytest.mark.parametrize('value', [1e20, 1e38, 3e38, -3e38, float('inf'), float('nan')])
@pytest.mark.parametrize('key_norm', ['softmax', 'none'])
@pytest.mark.parametrize('mask_kind,scope', [('default', None), ('default', 3), ('causal', None), ('random', None),
                                             ('random', 5)],
                         ids=['default_causal', 'default_causal_scope3', 'explicit_causal_mask',
                              'explicit_random_mask', 'explicit_random_mask_scope5'])
def test_masked_causal_for_overflowing_inputs(value, key_norm, mask_kind, scope):
    """A huge or non-finite input at position m leaves every query that does not see m (and its gradients:
    input, projections, embedding table) as with a clean input. Overflowing keys/values must not enter
    the masked queries' contractions with weight 0 (0 x inf = NaN), in the forward or the backward."""
    torch.manual_seed(0)
    N, m = 10, 6
    layer = MaskedLambdaLayer1d(16, dim_k=8, heads=4, max_len=16, key_norm=key_norm, scope=scope)
    mask = _mask_for(mask_kind, N)
    if mask_kind == 'random':
        mask = _random_mask(N, seed=5, p=0.6)
    ctx = _mask_for('causal', N) if mask is None else mask
    eye = torch.eye(N, dtype=torch.bool)
    unseen = (~(ctx | eye)[:, m]).nonzero().flatten()  # queries that see neither x_m nor are m
    unused = ~(ctx | eye)[unseen].any(0)  # inputs that no such query sees (m among them)
    assert 4 <= len(unseen) < N - 1 and unused[m]
    x = torch.randn(2, N, 16)
    x_bad = x.clone()
    x_bad[0, m] = value  # a whole position
    x_bad[1, m, 3] = value  # one feature
    y, gx, gp = _outputs_and_grads(layer, x, mask, unseen)
    y_bad, gx_bad, gp_bad = _outputs_and_grads(layer, x_bad, mask, unseen)
    if mask is None:  # the prefix-sum path: nothing of position m reaches earlier queries at all
        assert torch.equal(y_bad[:, unseen], y[:, unseen])
    torch.testing.assert_close(y_bad[:, unseen], y[:, unseen], rtol=1e-6, atol=1e-6)
    assert torch.isfinite(y_bad[:, unseen]).all()
    # explicit masks: the huge key moves the shared shift (the exact per-query fallback runs), so float32
    # rounding differs; a leak gives NaN or O(1) differences
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx_bad, gx, **tol)
    assert (gx_bad[:, unused] == 0).all() and (gx[:, unused] == 0).all()
    assert gp_bad.keys() == gp.keys() and 'rel_emb' in gp
    for name in gp:
        assert torch.isfinite(gp_bad[name]).all(), name
        torch.testing.assert_close(gp_bad[name], gp[name], **tol, msg=lambda s: f'{name}: {s}')
