"""The position-lambda forms (timm_lambda/layers/position_lambda.py) in every execution mode PyTorch offers,
against the float64 per-query reference (tests/reference.py) and the einsum form, at shapes with many query
blocks and many kernel chunks (the chunk size is shrunk so that a few blocks make many chunks, whole rows and
parts of rows), stride 1 and 2, local and global scopes, |u| > 1."""
import pytest
import torch
from torch import nn

from timm_lambda.layers import LambdaLayer
from timm_lambda.layers import position_lambda as PL

from reference import position_term_reference

FORMS = ['dense', 'tiled']

# (B, H, W, heads, |k|, |u|, |v|, scope (None: global), stride, count_include_pad, chunk rows)
CASES = [
    (2, 19, 21, 2, 3, 1, 4, 5, 1, False, 64),       # 9 blocks per image, one block per chunk
    (2, 26, 17, 2, 3, 2, 3, 7, 1, False, 300),      # chunks of whole block rows
    (2, 19, 21, 2, 3, 2, 4, 7, 2, False, 20),       # pooled: parts of a block row per chunk
    (3, 17, 9, 2, 4, 1, 3, 3, 2, True, 40),
    (1, 30, 33, 2, 4, 1, 2, 23, 1, False, 512),     # the default 23x23 scope
    (2, 6, 7, 2, 3, 1, 4, None, 1, False, 64),      # global scope
    (2, 7, 5, 2, 3, 2, 4, None, 2, False, 16),
]
IDS = [f'B{c[0]}_{c[1]}x{c[2]}_u{c[5]}_{"global" if c[7] is None else "scope%d" % c[7]}_s{c[8]}' for c in CASES]


def _inputs(case, dtype=torch.float64, seed=0):
    b, hh, ww, h, k, u, dv, scope = case[:8]
    g = torch.Generator().manual_seed(seed)
    side = (2 * hh - 1, 2 * ww - 1) if scope is None else (scope, scope)
    q = torch.randn(b, h, k, hh * ww, generator=g, dtype=dtype)
    v = torch.randn(b, u, dv, hh * ww, generator=g, dtype=dtype)
    table = torch.randn(k, u, *side, generator=g, dtype=dtype)
    return q, v, table


@pytest.fixture
def many_chunks(monkeypatch, request):
    monkeypatch.setattr(PL, 'CPU_CHUNK_ROWS', request.param)


def _call(impl, case, q, v, table):
    _, hh, ww, _, _, _, _, scope, stride, cip, _ = case
    return PL.position_lambdas(q, v, table, hh, ww, impl, scope is None, stride, cip)


@pytest.mark.parametrize('graph', [False, True], ids=['kernel', 'graph'])
@pytest.mark.parametrize('impl', FORMS)
@pytest.mark.parametrize('case', CASES, ids=IDS)
def test_forms_equal_the_per_query_reference_with_gradients(case, impl, graph, monkeypatch):
    monkeypatch.setattr(PL, 'CPU_CHUNK_ROWS', case[-1])
    if graph:
        monkeypatch.setattr(PL, '_use_kernels', lambda: False)
    q, v, table = (t.requires_grad_() for t in _inputs(case))
    ref = position_term_reference(q, v, table, case[1], case[2], case[8], case[9])
    y = _call(impl, case, q, v, table)
    assert y.shape == ref.shape and ref.abs().max() > 0.1
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=ref.dtype)
    for got, want in zip(torch.autograd.grad(y, (q, v, table), g), torch.autograd.grad(ref, (q, v, table), g)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_the_reference_comparison_can_fail():
    """A kernel that places the band one column off is caught by the comparison above."""
    case = CASES[0]
    q, v, table = _inputs(case)
    ref = position_term_reference(q, v, table, case[1], case[2])
    shifted = torch.roll(table, 1, dims=-1)
    assert not torch.allclose(_call('tiled', case, q, v, shifted), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('impl', FORMS)
@pytest.mark.parametrize('case', [CASES[1], CASES[2], CASES[6]], ids=[IDS[1], IDS[2], IDS[6]])
def test_double_backward(case, impl, monkeypatch):
    """create_graph=True and a second backward: gradgradcheck, and second-order values equal to einsum's."""
    monkeypatch.setattr(PL, 'CPU_CHUNK_ROWS', case[-1])
    small = (case[0], min(case[1], 11), min(case[2], 10)) + case[3:]
    q, v, table = (t.requires_grad_() for t in _inputs(small))
    assert torch.autograd.gradgradcheck(lambda *a: _call(impl, small, *a), (q, v, table), fast_mode=True)

    def second_order(form):
        y = _call(form, small, q, v, table)
        grads = torch.autograd.grad(y.square().sum(), (q, v, table), create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in grads), (q, v, table))

    for got, want in zip(second_order(impl), second_order('einsum')):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def _group_norm(channels, **kw):
    return nn.GroupNorm(1, channels, **kw)


@pytest.mark.parametrize('impl', FORMS)
def test_torch_func_per_sample_gradients(impl):
    """vmap(grad(loss)) over functional_call of a layer (per-sample gradients, as differential-privacy code
    writes them) equals plain autograd one sample at a time, and the einsum form's per-sample gradients.

    GroupNorm, not BatchNorm: under vmap(grad), torch 2.14's batch-norm backward gives wrong gradients when
    a matmul follows it (any matmul; a 10-line repro without this package is in docs/execution_modes.md)."""
    torch.manual_seed(0)
    layer = LambdaLayer(8, dim_k=4, heads=2, dim_u=2, scope=5, stride=2, impl=impl, norm_layer=_group_norm).double()
    x = torch.randn(3, 8, 13, 12, dtype=torch.float64)
    params = {n: p.detach() for n, p in layer.named_parameters()}

    def loss(p, xi):
        return torch.func.functional_call(layer, p, (xi[None],)).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for i in range(x.shape[0]):
        layer.zero_grad()
        layer(x[i:i + 1]).square().sum().backward()
        for name, p in layer.named_parameters():
            torch.testing.assert_close(per_sample[name][i], p.grad, rtol=1e-10, atol=1e-10)
    layer.impl = 'einsum'
    ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for name in params:
        torch.testing.assert_close(per_sample[name], ref[name], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('impl', FORMS)
def test_jacfwd_and_jvp(impl):
    case = CASES[2]
    q, v, table = _inputs(case)
    fn = lambda tab: _call(impl, case, q, v, tab)  # noqa: E731
    ref = lambda tab: _call('einsum', case, q, v, tab)  # noqa: E731
    tangent = torch.randn_like(table)
    torch.testing.assert_close(torch.func.jvp(fn, (table,), (tangent,))[1],
                               torch.func.jvp(ref, (table,), (tangent,))[1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('impl', FORMS)
@pytest.mark.parametrize('stride', [1, 2])
def test_empty_batch(impl, stride):
    layer = LambdaLayer(8, dim_k=4, heads=2, scope=5, stride=stride, impl=impl).train()
    x = torch.randn(0, 8, 12, 13, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 8, (12 + stride - 1) // stride, (13 + stride - 1) // stride)
    y.sum().backward()
    assert x.grad.shape == x.shape
    with torch.no_grad():
        assert layer.eval()(x).shape == y.shape


@pytest.mark.parametrize('impl', FORMS)
@pytest.mark.parametrize('scope', [5, 'global'])
def test_inference_mode_then_training(impl, scope):
    """Evaluation under torch.inference_mode() first, then training steps at the same and other sizes,
    no_grad in between: nothing built under inference mode reaches autograd."""
    torch.manual_seed(0)
    kw = dict(max_size=(12, 12)) if scope == 'global' else {}
    layer = LambdaLayer(8, dim_k=4, heads=2, scope=scope, impl=impl, **kw)
    x = torch.randn(2, 8, 11, 12)
    layer.eval()
    with torch.inference_mode():
        layer(x)
    layer.train()
    for size in [(11, 12), (12, 9), (11, 12)]:
        xi = torch.randn(2, 8, *size, requires_grad=True)
        layer(xi).square().sum().backward()
        assert xi.grad is not None and torch.isfinite(xi.grad).all()
        with torch.no_grad():
            layer(xi)
        with torch.inference_mode():
            layer(xi)


@pytest.mark.parametrize('tile,step,kh,kw', [(8, 1, 23, 23), (4, 2, 23, 23), (8, 1, 7, 5), (2, 1, 1, 3)])
def test_constant_block_index_equals_the_graph_one(tile, step, kh, kw):
    """The numpy block index (a constant of traces and exports) is the TorchScript-able torch one."""
    from timm_lambda.layers import relative_embedding as RE
    expected = RE.block_index(tile, step, kh, kw, torch.device('cpu'))
    assert torch.equal(torch.as_tensor(RE._block_index_array(tile, step, kh, kw)), expected)


def test_index_cache_is_bounded():
    from timm_lambda.layers import relative_embedding as RE
    table = torch.randn(2, 1, 5, 5)
    with torch.inference_mode():
        for size in range(1, 3 * RE._INDEX_CACHE_ENTRIES):
            RE.dense_embedding_cached(table, size, 3, True)
    assert len(RE._INDEX_CACHE) <= RE._INDEX_CACHE_ENTRIES
    assert not any(t.is_inference() for t in RE._INDEX_CACHE.values())
    RE.dense_embedding_cached(table, 60, 70, True)  # 17.6M entries: not kept
    assert all(t.numel() <= RE._INDEX_CACHE_MAX_ELEMENTS for t in RE._INDEX_CACHE.values())


@pytest.mark.parametrize('impl', FORMS)
@pytest.mark.parametrize('stride', [1, 2])
def test_autocast_bfloat16(impl, stride):
    """Under CPU autocast the kernels run in bfloat16 like any matmul; results within bf16 tolerance of
    float32, gradients in the parameters' dtype."""
    torch.manual_seed(0)
    layer = LambdaLayer(16, dim_k=8, heads=2, scope=7, stride=stride, impl=impl)
    x = torch.randn(2, 16, 19, 18)
    ref = layer(x)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        y = layer(x)
    torch.testing.assert_close(y.float(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
    y.float().sum().backward()
    assert layer.pos_embedding.weight.grad.dtype == torch.float32


def _graph_ops(fn, *args):
    """The ops of the graphs Dynamo captures from ``fn(*args)`` (no inductor: a capturing backend)."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == 'call_function')
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen


@pytest.mark.parametrize('stride', [1, 2])
def test_dynamo_captures_the_kernels_in_one_graph(stride):
    layer = LambdaLayer(8, dim_k=4, heads=2, scope=5, stride=stride, impl='tiled')
    ops = _graph_ops(layer, torch.randn(2, 8, 17, 18))
    assert 'timm_lambda.banded_attention.default' in ops
    layer = LambdaLayer(8, dim_k=4, heads=2, scope=5, stride=stride, impl='dense')
    assert 'timm_lambda.dense_attention.default' in _graph_ops(layer, torch.randn(2, 8, 7, 6))


@pytest.mark.slow
@pytest.mark.parametrize('impl', FORMS)
@pytest.mark.parametrize('stride', [1, 2])
def test_torch_compile_training_step_equals_eager(impl, stride, monkeypatch):
    """Inductor (default mode): forward and gradients equal to eager, with the kernels' backward (not the
    higher-order fallback) in the compiled backward."""
    monkeypatch.setattr(PL, 'CPU_CHUNK_ROWS', 64)
    fallback = []
    graph_vjp = PL._graph_vjp
    monkeypatch.setattr(PL, '_graph_vjp', lambda *a: fallback.append(1) or graph_vjp(*a))
    torch.manual_seed(0)
    layer = LambdaLayer(16, dim_k=8, heads=2, dim_u=2, scope=7, stride=stride, impl=impl).double()
    x = torch.randn(2, 16, 19, 17, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    y.square().sum().backward()
    want = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()
    torch._dynamo.reset()
    y2 = torch.compile(layer)(x)
    y2.square().sum().backward()
    torch.testing.assert_close(y2, y, rtol=1e-9, atol=1e-9)
    for got, w in zip([x.grad] + [p.grad for p in layer.parameters()], want):
        torch.testing.assert_close(got, w, rtol=1e-9, atol=1e-9)
    assert not fallback


def test_opcheck_kernels():
    """torch.library.opcheck: schema, fake (meta) kernels, autograd registration of the custom operators, on
    non-contiguous inputs."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 2, 3, 5, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
    vp = torch.randn(1, 12, 19, 6, generator=g, dtype=torch.float64).requires_grad_()
    table = torch.randn(5, 2, 5, 5, generator=g, dtype=torch.float64).requires_grad_()
    torch.library.opcheck(PL._banded_attention, (q, vp, table, 2, 2, 3))
    qd = torch.randn(4, 6, 3, generator=g, dtype=torch.float64).requires_grad_()
    vd = torch.randn(3, 8, 4, generator=g, dtype=torch.float64).transpose(0, 1).contiguous().transpose(0, 1)
    emb = torch.randn(4, 3, 8, generator=g, dtype=torch.float64).requires_grad_()
    torch.library.opcheck(PL._dense_attention, (qd, vd.requires_grad_(), emb, 2))
