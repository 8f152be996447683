"""The lambda layer's 1x1 projection (timm_lambda/layers/projection.py): a convolution, or in bfloat16 where oneDNN
computes it natively (AMX, AVX-512 BF16) the same product as a batched matmul; both against a float64 convolution,
and which one ran."""
import copy
import types

import pytest
import torch
import torch.nn.functional as F

from _helpers import require_cpu_kernel
from timm_lambda.layers import LambdaLayer, projection
from timm_lambda.layers.position_lambda import plan
from timm_lambda.layers.projection import Projection


@pytest.fixture
def native(monkeypatch):
    """The matmul path on any CPU (as on one with AMX or AVX-512 BF16), with the convolution made to fail: a test
    passes only if the matmul ran."""
    monkeypatch.setattr(plan, 'native_bf16', lambda: True)

    def no_conv(*args, **kwargs):
        raise AssertionError('the convolution ran')
    monkeypatch.setattr(projection, 'F', types.SimpleNamespace(conv2d=no_conv))


@pytest.mark.parametrize('bias', [False, True])
@pytest.mark.parametrize('batch', [1, 3])
def test_the_matmul_equals_the_convolution(native, bias, batch):
    torch.manual_seed(0)
    module = Projection(24, 40, bias=bias)
    x = torch.randn(batch, 24, 5, 7, requires_grad=True)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert projection.as_matmul(x)
        y = module(x)
    assert y.dtype == torch.bfloat16 and y.shape == (batch, 40, 5, 7)
    gy = torch.randn_like(y, dtype=torch.float32)
    y.float().backward(gy)
    # the float64 reference from the same bfloat16-rounded operands (autocast's casts)
    x64 = x.detach().bfloat16().double().requires_grad_()
    w64 = module.weight.detach().bfloat16().double().requires_grad_()
    b64 = module.bias.detach().bfloat16().double().requires_grad_() if bias else None
    ref = F.conv2d(x64, w64, b64)
    ref.backward(gy.double())
    # bfloat16 results (each rounded once, a batch's weight gradients summed): within 1% of the largest value
    for got, want in [(y, ref), (x.grad, x64.grad), (module.weight.grad, w64.grad)] + (
            [(module.bias.grad, b64.grad)] if bias else []):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-2 * want.abs().max().item())


def test_a_float32_call_stays_a_convolution(native):
    module = Projection(8, 12)
    with pytest.raises(AssertionError, match='the convolution ran'):
        module(torch.randn(1, 8, 4, 4))
    with pytest.raises(AssertionError, match='the convolution ran'):  # (channels last: the convolution's layout)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            module(torch.randn(1, 8, 4, 4).to(memory_format=torch.channels_last))


def test_without_native_bfloat16_the_convolution(monkeypatch):
    monkeypatch.setattr(plan, 'native_bf16', lambda: False)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert not projection.as_matmul(torch.randn(1, 8, 4, 4))


@pytest.mark.parametrize('avx512_bf16, amx', [(True, False), (False, True), (False, False)])
def test_native_bfloat16_by_the_cpu_and_onednn_cap(monkeypatch, avx512_bf16, amx):
    """AVX-512 BF16 (an AMD EPYC) or AMX on the CPU, oneDNN not held below AVX-512 BF16."""
    monkeypatch.setattr(torch.cpu, '_is_avx512_bf16_supported', lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, '_is_amx_tile_supported', lambda: amx)
    caps = (('AVX512_CORE_BF16', True), ('AVX512_CORE_AMX', True), ('AVX10_1_512', True), ('AVX512_CORE', False),
            ('AVX512_CORE_VNNI', False), ('AVX2', False), (None, True))
    for cap, want in caps:
        if cap is None:
            monkeypatch.delenv('ONEDNN_MAX_CPU_ISA', raising=False)
        else:
            monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', cap)
        monkeypatch.delenv('DNNL_MAX_CPU_ISA', raising=False)
        plan._native_bf16.cache_clear()
        assert plan.native_bf16() is (want and (avx512_bf16 or amx)), cap
    plan._native_bf16.cache_clear()


def test_the_layer_keeps_the_convolution_module_and_its_state_dict(native):
    layer = LambdaLayer(32, 32, dim_k=8, heads=4, scope=5)
    assert isinstance(layer.qkv, torch.nn.Conv2d) and layer.qkv.kernel_size == (1, 1)
    assert set(layer.state_dict()) >= {'qkv.weight'}
    seen = []
    layer.qkv.register_forward_hook(lambda m, i, o: seen.append(o.dtype))  # (hooks still run: the module is called)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        layer(torch.randn(2, 32, 6, 6))
    assert seen == [torch.bfloat16]
    layer.eval().reparameterize()  # (a bias: the projection again, the matmul path with it)
    assert isinstance(layer.qkv, Projection) and layer.qkv.bias is not None
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        layer(torch.randn(2, 32, 6, 6))


def test_every_lambda_layer_projects_by_the_projection():
    """Each lambda layer's qkv is a Projection: the paper's layer, its multi-query variant, timm's layer on ours with a
    bias (qkv_bias), and a converted timm model's layers."""
    import timm

    from timm_lambda.layers import MultiHeadLambdaLayer
    from timm_lambda.models.timm_byoanet import TimmLambdaLayer
    layers = [LambdaLayer(32, 32, dim_k=8, heads=4, scope=5), MultiHeadLambdaLayer(32, 32, heads=4),
              TimmLambdaLayer(32, 32, r=5, qkv_bias=True)]
    model = timm.create_model('lambda_resnet26t_fast', pretrained=False)
    layers += [m for m in model.modules() if isinstance(m, LambdaLayer)]
    assert len(layers) > 3
    for layer in layers:
        assert type(layer.qkv) is Projection, type(layer)
    assert layers[2].qkv.bias is not None


def test_without_native_bfloat16_a_bfloat16_call_convolves_in_float32(monkeypatch):
    """Where oneDNN has no bfloat16 instructions (its bfloat16 convolution is its reference code): the convolution in
    float32, returned in float32 (the layer rounds its output once: the next test). It equals the float64 convolution
    of the same operands to float32's precision, which a bfloat16 convolution (operands rounded first) misses by far."""
    monkeypatch.setattr(plan, 'native_bf16', lambda: False)
    seen = []
    conv2d = F.conv2d
    monkeypatch.setattr(projection.F, 'conv2d',
                        lambda x, w, b=None, *rest: seen.append((x.dtype, w.dtype)) or conv2d(x, w, b, *rest))
    torch.manual_seed(0)
    module = Projection(24, 40, bias=True)
    x = torch.randn(2, 24, 5, 7, requires_grad=True)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert projection.in_float32(x) and not projection.as_matmul(x)
        y = module(x)
        assert seen == [(torch.float32, torch.float32)]
        y16 = module._conv_forward(x, module.weight, module.bias)  # oneDNN's bfloat16 convolution
    assert y.dtype == torch.float32 and y16.dtype == torch.bfloat16
    y.sum().backward()
    assert x.grad is not None and module.weight.grad is not None
    ref = conv2d(x.detach().double(), module.weight.detach().double(), module.bias.detach().double())

    def within(got, tol):
        return bool(((got.double() - ref).abs() <= tol * ref.abs().max()).all())
    assert within(y, 1e-6)
    assert not within(y16, 1e-3)


def test_without_native_bfloat16_the_layer_computes_in_float32_and_rounds_once(monkeypatch):
    """A bfloat16 autocast call of the layer where neither oneDNN nor the kernel has bfloat16 products (an AVX2-only
    CPU): the projection, the norms and the operator compute in float32 (no rounding to bfloat16 and back between
    them) and the output is rounded to bfloat16 once, forward and backward, eager and by the registered operator. Each
    output within bfloat16's rounding of the layer in float64; the same layer computed in bfloat16 misses that."""
    from timm_lambda.layers.position_lambda import backends, cpu_kernel
    require_cpu_kernel()
    monkeypatch.setattr(plan, 'native_bf16', lambda: False)
    monkeypatch.setenv(cpu_kernel.PATH_ENV, 'float32')
    backends.invalidate()
    torch.manual_seed(0)
    layer = LambdaLayer(32, dim_out=32, scope=7, form='tiled')
    with torch.no_grad():  # norms that are not the identity
        for norm in (layer.norm_q, layer.norm_v):
            norm.weight.uniform_(0.5, 1.5), norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(2, 32, 9, 11)
    exact = LambdaLayer(32, dim_out=32, scope=7, form='tiled').double()
    exact.load_state_dict(layer.state_dict())
    xd = x.double().requires_grad_()
    ref = exact(xd)
    gy = torch.randn(ref.shape).bfloat16()
    gref, = torch.autograd.grad(ref, xd, gy.double())

    def within_rounding(got, want):  # one rounding to bfloat16 moves a value by at most 2^-8 of it
        return bool(((got.double() - want).abs() <= 2 ** -8 * want.abs() + 1e-5 * want.abs().max()).all())

    def close(got, want):  # float32's sums
        return bool(((got.double() - want).abs() <= 1e-5 * want.abs().max()).all())
    seen = []
    operator = type(backends.get('cpu_kernel')).forward
    monkeypatch.setattr(type(backends.get('cpu_kernel')), 'forward',
                        lambda self, p, q, *rest: seen.append(q.dtype) or operator(self, p, q, *rest))
    try:
        for compiled in (False, True):
            seen.clear()
            xx = x.clone().requires_grad_()
            run = torch.compile(layer, backend='aot_eager', fullgraph=True) if compiled else layer
            with torch.autocast('cpu', dtype=torch.bfloat16):
                y = run(xx)
            assert y.dtype == torch.bfloat16 and seen == [torch.float32], (compiled, seen)
            gx, = torch.autograd.grad(y, xx, gy)
            assert gx.dtype == torch.float32
            assert within_rounding(y, ref) and close(gx, gref), compiled
        # the layer in bfloat16 (its input and weights rounded) misses the float64 layer by far
        x16 = x.bfloat16().requires_grad_()
        y16 = copy.deepcopy(layer).bfloat16()(x16)
        g16, = torch.autograd.grad(y16, x16, gy)
        assert not within_rounding(y16, ref) and not close(g16, gref)
    finally:
        backends.invalidate()


def test_a_float32_call_or_native_bfloat16_never_converts(monkeypatch):
    monkeypatch.setattr(plan, 'native_bf16', lambda: False)
    assert not projection.in_float32(torch.randn(1, 8, 4, 4))
    monkeypatch.setattr(plan, 'native_bf16', lambda: True)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert not projection.in_float32(torch.randn(1, 8, 4, 4))


def test_without_native_bfloat16_the_content_lambda_multiplies_in_float32(monkeypatch):
    """The content lambda's products of a bfloat16 call (forward and gradients) in float32 where oneDNN has no
    bfloat16 instructions (its bfloat16 matmul is its reference code there), each result rounded to bfloat16; with
    them, in bfloat16."""
    from timm_lambda.layers.position_lambda import fused
    seen = []
    for name in ('bmm', 'baddbmm'):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, real=real, **kw: seen.append(a[-1].dtype) or real(*a, **kw))
    torch.manual_seed(0)
    keys, v = torch.randn(2, 16, 5, 6).bfloat16(), torch.randn(2, 8, 5, 6).bfloat16()
    gcontent, gv = torch.randn(2, 16, 8).bfloat16(), torch.randn(2, 8, 5, 6).bfloat16()
    for native, want in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(plan, 'native_bf16', lambda native=native: native)
        seen.clear()
        content, kn = fused.content_lambda(keys, v, None, 'softmax', 16)
        grads = fused.content_grads(torch.zeros(2, 16, 5, 6).bfloat16(), gv, None, gcontent, torch.zeros(2, 16, 5, 6),
                                    keys, v, None, kn, 'softmax')
        assert content.dtype == torch.bfloat16 and grads[1].dtype == torch.bfloat16
        assert seen == [want] * 3, (native, seen)
