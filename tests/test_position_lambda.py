"""The position-lambda forms (timm_lambda/layers/position_lambda/) in every execution mode PyTorch offers,
against the float64 per-query reference (tests/reference.py) and the einsum form, at shapes with many query
blocks and many chunks (the chunk size is shrunk so that a few blocks make many chunks, whole rows and
parts of rows), stride 1 and 2, local and global scopes, |u| > 1."""
import functools
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _sixteen_bit as SB
from _cases import CASES, FORMS, IDS
from _cases import call as _call
from _cases import content_reference as _content_reference
from _cases import inputs as _inputs
from _helpers import require_cpu_kernel
from _kernel_op import kernel_call
from reference import position_term_reference, tiled_operator_reference
from timm_lambda.layers import LambdaLayer
from timm_lambda.layers import position_lambda as PL
from timm_lambda.layers.position_lambda import backends, cpu_kernel, gemm, plain_ops


def chunk_rows(monkeypatch, rows: int) -> None:
    """The gemm backend's chunks of ``rows`` logit rows on a CPU (the plans made anew for it)."""
    monkeypatch.setattr(gemm, 'CPU_CHUNK_ROWS', rows)
    backends.invalidate()


# the CPU rows of the backend table (timm_lambda/layers/position_lambda/backends.py) in float64: each form by each
# backend that computes it on a CPU; the triton_* rows run under Triton's interpreter (tests/test_tiled_triton.py),
# the CUDA rows in tests/test_cuda.py, the other dtypes in tests/test_backends.py
EXECUTIONS = [(form, name) for name in PL.BACKENDS if name not in ('triton_tc', 'triton_fma')
              for form in ('dense', 'tiled') if form in backends.get(name).forms]


def _use_execution(execution, chunk_rows, monkeypatch, backend):
    """Run the position lambdas by the backend ``execution`` through the public override (``backend``: the conftest
    fixture), in chunks of ``chunk_rows`` logit rows on the gemm backend; a function that says whether ``execution``
    served a call since (what the backend table counts)."""
    monkeypatch.setattr(gemm, 'CPU_CHUNK_ROWS', chunk_rows)  # (backend() makes the plans anew)
    if execution == 'cpu_kernel':
        require_cpu_kernel()
    backend(execution)
    PL.served_backends(reset=True)
    return lambda form: any(k[:2] == (form, execution) for k in PL.served_backends())


@pytest.mark.parametrize('form,execution', EXECUTIONS, ids=['-'.join(e) for e in EXECUTIONS])
@pytest.mark.parametrize('case', CASES, ids=IDS)
def test_forms_equal_the_per_query_reference_with_gradients(case, form, execution, monkeypatch, backend):
    ran = _use_execution(execution, case[-1], monkeypatch, backend)
    q, v, table = (t.requires_grad_() for t in _inputs(case))
    ref = position_term_reference(q, v, table, case[1], case[2], case[8], case[9])
    y = _call(form, case, q, v, table)
    assert ran(form), f'{execution} did not serve the call: {PL.served_backends()}'
    assert y.shape == ref.shape and ref.abs().max() > 0.1
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=ref.dtype)
    for got, want in zip(torch.autograd.grad(y, (q, v, table), g), torch.autograd.grad(ref, (q, v, table), g)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


CONTENT_CASES = [CASES[i] for i in (0, 2, 3, 4, 7, 8)]


@pytest.mark.parametrize('form,execution', EXECUTIONS, ids=['-'.join(e) for e in EXECUTIONS])
@pytest.mark.parametrize('case', CONTENT_CASES, ids=[IDS[CASES.index(c)] for c in CONTENT_CASES])
def test_content_lambda_with_the_position_lambdas_equals_the_reference(case, form, execution, monkeypatch, backend):
    """``position_lambdas(..., content=lambda^c)`` adds the content term (eq. 2): inside the tiled operator (the CPU
    kernel's accumulators, or the GEMM path), else by a matmul; output and the gradients of q, v, the table and the
    content lambda against the float64 reference, batch 1 and 2, stride 1 and 2, |v| on the kernel's vector paths
    (43 = 32 + 8 + 3) and not."""
    ran = _use_execution(execution, case[-1], monkeypatch, backend)
    _, hh, ww, _, k, _, dv, scope, stride, cip, _ = case
    q, v, table = _inputs(case)
    content = torch.randn(case[0], k, dv, generator=torch.Generator().manual_seed(7), dtype=q.dtype)
    leaves = [t.requires_grad_() for t in (q, v, table, content)]
    ref = position_term_reference(q, v, table, hh, ww, stride, cip) + _content_reference(content, q, case)
    y = PL.position_lambdas(q, v, table, hh, ww, form, scope is None, stride, cip, None, content)
    assert ran(form), f'{execution} did not serve the call: {PL.served_backends()}'
    y = y.reshape(ref.shape)
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=ref.dtype)
    for got, want in zip(torch.autograd.grad(y, leaves, g), torch.autograd.grad(ref, leaves, g)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('execution', ['cpu_kernel', 'gemm'])
@pytest.mark.parametrize('step', [1, 2])
def test_tiled_operator_content_equals_its_term_added(step, execution, monkeypatch, backend):
    """The operator's content input at either step (the layer passes it at step 1): the same as the operator without
    it plus the term by a matmul, outputs and all four gradients, float64, batch 1 and 2, |v| = 43 (the kernel's
    vector paths and a scalar rest)."""
    ran = _use_execution(execution, gemm.CPU_CHUNK_ROWS, monkeypatch, backend)
    g = torch.Generator().manual_seed(1)
    for b in (1, 2):
        q = torch.randn(b, 3, 6, 9, 11, generator=g, dtype=torch.float64)
        v = torch.randn(b, 2 * 43, 9 * step, 11 * step, generator=g, dtype=torch.float64)
        table = torch.randn(6, 2, 7, 5, generator=g, dtype=torch.float64)
        content = torch.randn(b, 6, 43, generator=g, dtype=torch.float64)
        leaves = [t.requires_grad_() for t in (q, v, table, content)]
        y = kernel_call(q, v, table, step, content)
        want = kernel_call(q, v, table, step) + plain_ops.operator_content_term(q, content)
        assert ran('tiled')
        torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
        gy = torch.randn(y.shape, generator=g, dtype=torch.float64)
        for got, ref in zip(torch.autograd.grad(y, leaves, gy), torch.autograd.grad(want, leaves, gy)):
            torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('execution', ['cpu_kernel', 'gemm'])
@pytest.mark.parametrize('stride', [1, 2])
def test_lambda_operator_double_backward(stride, execution, monkeypatch, backend):
    """create_graph=True through the lambda operator (keys, a shared lambda, |u| = 2) at stride 1 and 2: gradgradcheck
    over all five tensor inputs (the higher-order gradient differentiates the plain-op form)."""
    ran = _use_execution(execution, gemm.CPU_CHUNK_ROWS, monkeypatch, backend)
    g = torch.Generator().manual_seed(2)
    hh, ww = 5, 6
    q = torch.randn(2, 2, 3, hh * ww, generator=g, dtype=torch.float64)  # [B, h, k, n]
    keys = torch.randn(2, 2, 3, hh * ww, generator=g, dtype=torch.float64)  # [B, u, k, n]
    v = torch.randn(2, 2, 4, hh * ww, generator=g, dtype=torch.float64)  # |u| = 2, |v| = 4
    table = torch.randn(3, 2, 5, 5, generator=g, dtype=torch.float64)
    shared = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (q, keys, v, table, shared)]

    def op(q, keys, v, table, shared):
        return PL.position_lambdas(q, v, table, hh, ww, 'tiled', False, stride, False, [5, 5], shared, keys)
    assert torch.autograd.gradgradcheck(op, leaves, fast_mode=True)
    assert ran('tiled')


def test_require_cpu_kernel_fails_where_ci_requires_an_unbuilt_kernel(monkeypatch, tmp_path):
    """With TIMM_LAMBDA_REQUIRE_CPU_KERNEL=1 (CI) and no build, the kernel's tests fail, never skip nor build."""
    from torch.utils import cpp_extension
    for name, value in dict(_kernel=None, _reason=None, _failed=None, _looked_up=False).items():
        monkeypatch.setattr(cpu_kernel, name, value)
    monkeypatch.setenv('TORCH_EXTENSIONS_DIR', str(tmp_path))
    monkeypatch.setenv('TIMM_LAMBDA_REQUIRE_CPU_KERNEL', '1')
    monkeypatch.setattr(cpp_extension, 'load', lambda *a, **k: pytest.fail('the tests must not build it here'))
    with pytest.raises(pytest.fail.Exception, match='TIMM_LAMBDA_REQUIRE_CPU_KERNEL=1, but the CPU kernel cannot '
                                                    "serve: the tiled form's CPU kernel is not built"):
        require_cpu_kernel()


def test_the_cpu_kernel_serves_cpu_tensors_only_and_16_bit_ones_in_float32_at_stride_1():
    """The table's cpu_kernel row: CPU tensors of the four float dtypes, computed in float32 except float64 and native
    bfloat16; 'auto' passes over 16-bit stride-2 calls without native bfloat16 (the gemm backend is faster there,
    docs/benchmarks.md), a chosen cpu_kernel still serves them."""
    require_cpu_kernel()
    native = cpu_kernel.native(torch.bfloat16)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        assert backends.why_not('cpu_kernel', backends.Call('tiled', 'cpu', dtype)) is None
        assert backends.why_not('cpu_kernel', backends.Call('tiled', 'cpu', dtype, 2), auto=False) is None
    bf16 = torch.bfloat16 if cpu_kernel.compute_path(torch.bfloat16)[0] != 'float32' else torch.float32
    assert not (bf16 == torch.bfloat16 and not native)  # (tests/test_cpu_brgemm.py: which path, where)
    assert [cpu_kernel.compute_dtype(d) for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)] == [
        torch.float32, torch.float64, bf16, torch.float32]
    assert backends.why_not('cpu_kernel', backends.Call('tiled', 'cpu', torch.int64)) == \
        'computes float16, bfloat16, float32 and float64'
    assert backends.why_not('cpu_kernel', backends.Call('tiled', 'meta', torch.float32)) == 'needs CPU tensors'
    assert backends.why_not('cpu_kernel', backends.Call('dense', 'cpu', torch.float32)) == 'computes the tiled form'
    assert backends.why_not('cpu_kernel', backends.Call('tiled', 'cpu', torch.float32, 2)) is None
    assert (backends.why_not('cpu_kernel', backends.Call('tiled', 'cpu', torch.bfloat16, 2)) is None) == native
    assert backends.why_not('cpu_kernel', backends.Call('tiled', 'cpu', torch.float16, 2)).startswith('auto: ')


@pytest.mark.parametrize('key_norm', ['softmax', 'l2', 'none'])
@pytest.mark.parametrize('stride', [1, 2])
def test_the_cpu_kernel_runs_a_call_in_one_kernel_call(stride, key_norm, monkeypatch, backend):
    """A float64 call at stride 1 (and a stride-2 call pooled after) runs as one kernel call a direction
    (``layer_forward``, ``layer_backward``: the content lambda of each key norm, the table's reach and the kernels;
    issue 58's host time): Python's steps around the kernels never run, and the output and every gradient equal the
    plain ops'. A float16 call (computed in float32, its inputs widened once) runs whole too; the same steps patched
    to fail do fail it where the plan is not run whole, so the patch is in the path it guards."""
    require_cpu_kernel()
    from timm_lambda.layers.position_lambda import fused

    def layer():
        torch.manual_seed(0)
        return LambdaLayer(16, dim_k=8, heads=2, dim_u=2, scope=7, stride=stride, position_bias=True, form='tiled',
                           key_norm=key_norm).double()

    x = torch.randn(2, 16, 4, 5 if stride == 1 else 4, dtype=torch.float64)

    def step(m, dtype=torch.float64):
        xx = x.to(dtype).requires_grad_()
        y = m(xx)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y))
        return [y.detach(), xx.grad] + [p.grad for p in m.parameters()]

    backend('plain', strict=True)
    want = step(layer())
    backend('cpu_kernel', strict=True)
    plan = PL.make_plan(layer().spec, x)
    assert plan.variant == ('' if stride == 1 else 'pooled') and cpu_kernel.whole_call(plan)

    def python_step(*args, **kwargs):
        raise AssertionError("fused's steps around the kernels ran")
    for name in ('content_lambda', 'content_grads', 'reach', 'reach_grad'):
        monkeypatch.setattr(fused, name, python_step)
    PL.served_backends(reset=True)
    got = step(layer())
    assert {k[1] for k in PL.served_backends()} == {'cpu_kernel'}
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    half = step(layer().half(), torch.float16)
    assert all(g is None or g.dtype == torch.float16 for g in half)
    monkeypatch.setattr(cpu_kernel, 'whole_call', lambda plan: False)
    with pytest.raises(AssertionError, match='around the kernels'):
        step(layer().half(), torch.float16)


def _cpu_flags() -> set:
    with open('/proc/cpuinfo') as f:
        return set(next((line for line in f if line.startswith('flags')), ':').split(':', 1)[1].split())


@pytest.mark.skipif(not os.path.exists('/proc/cpuinfo'), reason='reads the CPU flags from /proc/cpuinfo')
def test_the_native_bfloat16_forward_is_built_where_the_cpu_has_avx512_bf16():
    """``-march=native`` compiles ``tiled_forward_bf16`` exactly where the CPU has AVX-512 BF16 (a build that lost it
    would quietly fall back to float32)."""
    require_cpu_kernel()
    assert cpu_kernel.native(torch.bfloat16) == ('avx512_bf16' in _cpu_flags())


# (B, heads, |k|, |u|, |v|, H, W, scope, step, content lambda)
BF16_CASES = [
    (2, 4, 16, 1, 64, 12, 13, 23, 1, False),   # a c4 layer's heads and widths (4 vectors of 16), scope past the image
    (1, 5, 16, 2, 43, 9, 17, 7, 1, True),      # 4 + 1 heads, |u| 2, |v| 16 + 16 + 11 (the scalar columns)
    (2, 4, 16, 1, 128, 14, 15, 23, 2, True),   # the first c5 block's stride 2
    (1, 3, 8, 1, 16, 5, 6, 5, 2, False),       # an even image width, a small scope
]


def _bf16_paths():
    """The kernel's bfloat16 paths (cpu_kernel.compute_path) this CPU runs: its own VDPBF16PS loops, and oneDNN's
    BRGEMM where oneDNN can run it (AMX tiles where the CPU has AMX-BF16, else oneDNN's AVX-512 BF16 micro-kernel: the
    same code; tests/test_cpu_brgemm.py says which)."""
    return ['avx512_bf16'] + (['brgemm'] if cpu_kernel.brgemm_isa() else [])


def _bf16_call(case, draw, monkeypatch):
    """Inputs of a BF16_CASES call drawn by ``draw(*shape)``, the operator's output and gradients (for a drawn output
    gradient) by each bfloat16 path (forced: ``TIMM_LAMBDA_CPU_BF16``; each output must be that path's own, not a
    fallback's), ``{path: results}``, and a function giving the per-query float64 reference's (``logits_dtype``)."""
    kernel = cpu_kernel.load()
    if not kernel.bf16:  # a CPU with AVX-512 BF16 (CI's) must have them: fail there rather than skip
        assert not (os.path.exists('/proc/cpuinfo') and 'avx512_bf16' in _cpu_flags()), \
            'the CPU has AVX-512 BF16 but the kernel was built without its bfloat16 kernels'
        pytest.skip('no AVX-512 BF16 on this CPU: a bfloat16 call runs in float32 (tested below)')
    b, h, c, u, dv, hh, ww, scope, step, with_content = case
    inputs = [draw(b, h, c, -(-hh // step), -(-ww // step)), draw(b, u * dv, hh, ww), draw(c, u, scope, scope)]
    inputs += [draw(b, c, dv)] if with_content else []
    gy = draw(b, h * dv, -(-hh // step), -(-ww // step))
    got = {}
    for path in _bf16_paths():
        monkeypatch.setenv(cpu_kernel.PATH_ENV, path)
        leaves = [t.clone().requires_grad_() for t in inputs]
        y = kernel_call(leaves[0], leaves[1], leaves[2], step, *leaves[3:])
        own = kernel.tiled_forward_brgemm if path == 'brgemm' else kernel.tiled_forward_bf16
        assert y.dtype == torch.bfloat16 and torch.equal(y, own(*inputs[:3], *inputs[3:4] or [None], step)), path
        got[path] = [y] + list(torch.autograd.grad(y, leaves, gy))
        assert all(t.dtype == torch.bfloat16 for t in got[path]), path
    monkeypatch.delenv(cpu_kernel.PATH_ENV)

    @functools.lru_cache(maxsize=None)
    def reference(logits_dtype=None):
        exact = [t.double().requires_grad_() for t in inputs]
        out = tiled_operator_reference(exact[0], exact[1], exact[2], step, *exact[3:], logits_dtype=logits_dtype)
        return [out] + list(torch.autograd.grad(out, exact, gy.double()))

    reference.inputs, reference.gy = inputs, gy  # for tests/_sixteen_bit.py's check_rounding
    return got, reference


BF16_IDS = [f'u{c[3]}_v{c[4]}_scope{c[7]}_s{c[8]}' + '_content' * c[9] for c in BF16_CASES]


@pytest.mark.parametrize('case', BF16_CASES, ids=BF16_IDS)
def test_bfloat16_kernels_exact_on_small_integers(case, monkeypatch):
    """Where the kernel has AVX-512 BF16, by each bfloat16 path (``tiled_*_bf16``; ``tiled_*_brgemm`` where oneDNN can
    run it): with every input and output gradient in {-1, 0, 1}, every logit, product and sum is an integer that
    bfloat16 or float32 hold exactly, so the output and every gradient equal the float64 per-query reference rounded
    once to bfloat16, bit for bit: the pairs (of channels, heads, scope columns, queries) and their zero padding at odd
    counts and image borders; the BRGEMM path's bands, strips and partial blocks."""
    require_cpu_kernel()
    g = torch.Generator().manual_seed(1)
    got, reference = _bf16_call(case, lambda *shape: torch.randint(-1, 2, shape, generator=g).bfloat16(), monkeypatch)
    for path, results in got.items():
        for name, a, want in zip(['output', 'q', 'v', 'table', 'content'], results, reference()):
            assert torch.equal(a, want.bfloat16()), (path, name)


@pytest.mark.parametrize('case', BF16_CASES, ids=BF16_IDS)
def test_bfloat16_kernels_round_as_a_bfloat16_matmul(case, monkeypatch):
    """By each bfloat16 path, a bfloat16 call (CPU autocast) computes as a bfloat16 matmul would: the logits q R rounded
    to bfloat16, products of bfloat16 operands summed in float32, each result rounded once. The output and the value
    gradient (``L^T gy``) equal the per-query float64 reference with the logits so rounded within half a unit of their
    last place and 1e-4 of their largest entry (a logit whose float32 sum lands on the other side of a rounding
    boundary than the reference's moves them by about 1e-5), and are off the reference without rounding by more. The
    query, table and content gradients (from the logit gradients rounded to bfloat16, as a matmul's backward) are
    within bfloat16 rounding of the exact ones."""
    require_cpu_kernel()
    g = torch.Generator().manual_seed(0)
    got, reference = _bf16_call(case, lambda *shape: torch.randn(shape, generator=g).bfloat16(), monkeypatch)
    rounded, exact = reference(torch.bfloat16), reference()

    def excess(a, want):  # beyond half a bfloat16 unit in the last place, over the largest entry
        return (((a.double() - want).abs() - 2 ** -8 * want.abs()).max() / want.abs().max()).item()

    for path, results in got.items():
        for i, name in enumerate(['output', 'q', 'v', 'table', 'content'][:len(results)]):
            if name in ('output', 'v'):
                assert excess(results[i], rounded[i]) <= 1e-4 < 5e-4 < excess(results[i], exact[i]), (path, name)
            else:
                assert excess(results[i], exact[i]) <= 4e-3, (path, name)
        # and the contract the tensor-core kernels are held to (interpreted and on a GPU): the output and value
        # gradient equal to the rounded-logit reference far more often than to the exact one, the query and table
        # gradients (from the rounded logit gradients) equal to the reference with rounded logit gradients more often
        # than to the other
        SB.check_rounding(results, case, reference.inputs, reference.gy, torch.bfloat16,
                          (tuple(rounded), tuple(exact)))


@pytest.mark.parametrize('batch', [1, 2])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_16_bit_inputs_run_the_cpu_kernel_in_float32(dtype, batch, monkeypatch, backend):
    """A float16 call (what CPU autocast passes), or a bfloat16 one where the kernel has no bfloat16 kernels (forced
    here), equals the kernel's float32 result on the same rounded inputs, rounded once to the 16-bit dtype, outputs
    and gradients; the GEMM path, which keeps its logits in the 16-bit dtype, is farther from the float64
    reference."""
    require_cpu_kernel()
    monkeypatch.setattr(cpu_kernel, 'native', lambda dtype: False)
    backend('cpu_kernel')
    case = (batch, 24, 20, 5, 16, 1, 43, 23, 1, False, 512)
    q, v, table = (t.to(dtype) for t in _inputs(case))
    g = torch.randn(_call('tiled', case, q.double(), v.double(), table.double()).shape,
                    generator=torch.Generator().manual_seed(3)).to(dtype)

    def run(*inputs):
        inputs = [t.clone().requires_grad_() for t in inputs]
        y = _call('tiled', case, *inputs)
        return [y] + list(torch.autograd.grad(y, inputs, g.to(y.dtype)))

    low, full = run(q, v, table), run(q.float(), v.float(), table.float())
    for got, want in zip(low, full):
        assert got.dtype == dtype and torch.equal(got, want.to(dtype))
    backend('gemm')
    by_gemm = run(q, v, table)
    ref = run(q.double(), v.double(), table.double())[0]
    assert (by_gemm[0].double() - ref).abs().max() > (low[0].double() - ref).abs().max()


@pytest.mark.parametrize('stride,scope', [(1, 23), (2, 23), (1, 5), (1, 11), (2, 27), (1, 35)])
def test_cpu_kernel_in_float32_equals_the_gemm_path_in_float64(stride, scope, backend):
    """float32 has 16 lanes where float64 has 8: the kernel's float32 vector paths at a LambdaResNet-like shape
    (|k| = 16, 5 heads, |v| = 16 + 16 + 8 + 3), outputs and gradients; the scopes give logit-gradient rows of one
    and two vectors, computed in row pairs (5, 11, 23, 27 wide), and of more (35: a GEMM per row)."""
    require_cpu_kernel()
    case = (2, 24, 20, 5, 16, 1, 43, scope, stride, False, 512)
    q, v, table = _inputs(case)
    g = torch.randn(_call('tiled', case, q, v, table).shape, generator=torch.Generator().manual_seed(3),
                    dtype=torch.float64)
    results = []
    for name, dtype in (('cpu_kernel', torch.float32), ('gemm', torch.float64)):
        backend(name)
        inputs = [t.to(dtype).requires_grad_() for t in (q, v, table)]
        y = _call('tiled', case, *inputs)
        results.append([y] + list(torch.autograd.grad(y, inputs, g.to(dtype))))
    for got, want in zip(*results):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_the_reference_comparison_can_fail():
    """A table one column off (as a misplaced band would be) is caught by the comparison above."""
    case = CASES[0]
    q, v, table = _inputs(case)
    ref = position_term_reference(q, v, table, case[1], case[2])
    shifted = torch.roll(table, 1, dims=-1)
    assert not torch.allclose(_call('tiled', case, q, v, shifted), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('case', [CASES[1], CASES[2], CASES[6]], ids=[IDS[1], IDS[2], IDS[6]])
def test_double_backward(case, form, monkeypatch):
    """create_graph=True and a second backward: gradgradcheck, and second-order values equal to einsum's."""
    chunk_rows(monkeypatch, case[-1])
    small = (case[0], min(case[1], 11), min(case[2], 10)) + case[3:]
    q, v, table = (t.requires_grad_() for t in _inputs(small))
    assert torch.autograd.gradgradcheck(lambda *a: _call(form, small, *a), (q, v, table), fast_mode=True)

    def second_order(form):
        y = _call(form, small, q, v, table)
        grads = torch.autograd.grad(y.square().sum(), (q, v, table), create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in grads), (q, v, table))

    for got, want in zip(second_order(form), second_order('einsum')):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def _group_norm(channels, **kw):
    return nn.GroupNorm(1, channels, **kw)


@pytest.mark.parametrize('form', FORMS)
def test_torch_func_per_sample_gradients(form):
    """vmap(grad(loss)) over functional_call of a layer (per-sample gradients, as differential-privacy code
    writes them) equals plain autograd one sample at a time, and the einsum form's per-sample gradients.

    GroupNorm, not BatchNorm: under vmap(grad), torch 2.14's batch-norm backward gives wrong gradients when
    a matmul follows it (any matmul; a 10-line repro without this package is in docs/execution_modes.md)."""
    torch.manual_seed(0)
    layer = LambdaLayer(8, dim_k=4, heads=2, dim_u=2, scope=5, stride=2, form=form, norm_layer=_group_norm).double()
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
    layer.form = 'einsum'
    ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for name in params:
        torch.testing.assert_close(per_sample[name], ref[name], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('form', FORMS)
def test_jacfwd_and_jvp(form):
    """Forward-mode torch.func transforms of the plain-op forms: jacfwd and jvp with respect to the table equal the
    Jacobian of the float64 per-query reference (by reverse mode), stride 2 (small: the reference is slow)."""
    case = (2, 7, 6, 2, 2, 1, 3, 3, 2, False, 64)
    q, v, table = _inputs(case)
    reference = torch.func.jacrev(lambda tab: position_term_reference(q, v, tab, case[1], case[2], case[8], case[9]))
    jacobian = reference(table)
    torch.testing.assert_close(torch.func.jacfwd(lambda tab: _call(form, case, q, v, tab))(table), jacobian,
                               rtol=1e-10, atol=1e-10)
    tangent = torch.randn_like(table)
    _, jvp = torch.func.jvp(lambda tab: _call(form, case, q, v, tab), (table,), (tangent,))
    torch.testing.assert_close(jvp, (jacobian * tangent).flatten(-4).sum(-1), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('stride', [1, 2])
@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('scope', [5, 'global'])
def test_inference_mode_then_training(form, scope, stride):
    """Evaluation under torch.inference_mode() first, then training steps at the same and other sizes,
    no_grad in between: nothing built under inference mode reaches autograd (the dense index cache; at stride 2
    the cached in-image counts of the average, which the training step's division saves)."""
    torch.manual_seed(0)
    kw = dict(max_size=(12, 12)) if scope == 'global' else {}
    layer = LambdaLayer(8, dim_k=4, heads=2, scope=scope, form=form, stride=stride, **kw)
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


def _operator_inputs(form, dtype=torch.float64):
    """The lambda operator and its inputs (the layer's maps, non-contiguous where it matters) for ``form``: |h| = 3,
    |k| = 5, |u| = 2, |v| = 3, a 5x5 table, stride 2 (tiled) or 1 (dense), a 7 x 4 map, keys and a shared lambda."""
    g = torch.Generator().manual_seed(0)
    hh, ww = 7, 4
    q = torch.randn(2, 15, ww, hh, generator=g, dtype=dtype).transpose(2, 3)  # the layer's maps [B, h k, H, W]
    keys = torch.randn(2, 10, hh, ww, generator=g, dtype=dtype)  # [B, u k, H, W]
    v = torch.randn(2, 6, ww, hh, generator=g, dtype=dtype).transpose(2, 3)  # [B, u V, H, W]
    table = torch.randn(5, 2, 5, 5, generator=g, dtype=dtype)
    shared = torch.randn(2, 3, 5, generator=g, dtype=dtype).transpose(1, 2)
    return (torch.ops.timm_lambda.lambda_layer, q, keys, v, table, shared) + _plan_args(form, q)


def _plan_args(form, q):
    """The operator's arguments after its tensors for ``_operator_inputs``'s call on queries like ``q``: the plan the
    layer would make."""
    stride = 2 if form == 'tiled' else 1
    plan = PL.make_plan(PL.Spec(form, 5, 2, 3, 3, 5, 5, False, stride), q)
    return (stride, False, 'softmax', False, form, plan.backend, plan.variant, plan.compute_dtype, list(plan.tiling))


@pytest.mark.parametrize('form', FORMS)
@pytest.mark.parametrize('case', [CASES[1], CASES[2]], ids=[IDS[1], IDS[2]])
def test_autocast_runs_the_operators_in_bfloat16(case, form, monkeypatch):
    """Under CPU autocast the custom operators compute in bfloat16, like a matmul: a bfloat16 result that is farther
    from the float32 one than float32 rounding and within bfloat16 rounding of the float64 reference; float32
    gradients that are those of the bfloat16 computation bit for bit (the operator's own inputs: the glue around it
    may sum them in float32), not float32's. Fails if the operators' autocast rule is missing."""
    chunk_rows(monkeypatch, case[-1])
    q, v, table = (t.float() for t in _inputs(case))
    ref = position_term_reference(q.double(), v.double(), table.double(), case[1], case[2], case[8], case[9])
    with torch.autocast('cpu', dtype=torch.bfloat16):
        y = _call(form, case, q, v, table)
    assert y.dtype == torch.bfloat16
    scale = ref.abs().max().item()
    assert (y.double() - _call(form, case, q, v, table).double()).abs().max() > 1e-3 * scale  # float32: ~1e-6
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=0.03 * scale)
    op, *inputs = _operator_inputs(form if form in ('dense', 'tiled') else 'tiled', torch.float32)
    leaves = [x.requires_grad_() for x in inputs[:5]]
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = op(*leaves, *inputs[5:])[0]
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    low = [x.detach().bfloat16().requires_grad_() for x in leaves]
    want = torch.autograd.grad(op(*low, *_plan_args(form if form in ('dense', 'tiled') else 'tiled', low[0]))[0],
                               low, g)
    f32 = torch.autograd.grad(op(*leaves, *inputs[5:])[0], leaves, g.float())
    for got, bf16, full in zip(torch.autograd.grad(out, leaves, g), want, f32):
        assert got.dtype == torch.float32 and torch.equal(got, bf16.float())
        assert (got - full).abs().max() > 1e-3 * full.abs().max()


def _graph_ops(fn, *args):
    """The ops of the graphs Dynamo captures from ``fn(*args)`` (no inductor: a capturing backend)."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == 'call_function')
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen


def test_is_exporting_reads_the_flag_not_the_call(monkeypatch):
    """Dynamo up to torch 2.11 folds the call ``torch.compiler.is_exporting()`` to True inside every torch.compile
    trace (pytorch/pytorch#176347): on a GPU with torch 2.11 the layer then took its export branches under
    torch.compile (plain ops instead of the operators, a graph break at ``torch.sym_max``, dynamo recompiling each
    timm block until its limit). The layer reads the flag the call returns instead."""
    from timm_lambda.layers import execution
    if not hasattr(torch.compiler, '_is_exporting_flag'):
        pytest.skip('this torch has no torch.compiler._is_exporting_flag')
    x = torch.zeros(1)
    monkeypatch.setattr(torch.compiler, 'is_exporting', lambda: True)  # what torch 2.11's dynamo makes of the call
    assert execution.is_exporting() is False and execution.mode(x) == 'eager'
    monkeypatch.setattr(torch.compiler, '_is_exporting_flag', True)  # what torch.export sets
    assert execution.is_exporting() is True and execution.mode(x) == 'export'


@pytest.mark.parametrize('stride', [1, 2])
def test_dynamo_captures_the_operators_in_one_graph(stride):
    layer = LambdaLayer(8, dim_k=4, heads=2, scope=5, stride=stride, form='tiled')
    ops = _graph_ops(layer, torch.randn(2, 8, 17, 18))
    assert ops.count('timm_lambda.lambda_layer.default') == 1
    layer = LambdaLayer(8, dim_k=4, heads=2, scope=5, stride=stride, form='dense')
    assert _graph_ops(layer, torch.randn(2, 8, 7, 6)).count('timm_lambda.lambda_layer.default') == 1


def test_opcheck_operators(backend):
    """torch.library.opcheck: schema, fake (meta) kernels, autograd registration of the lambda operator, on
    non-contiguous inputs with keys and a shared lambda, in both forms; the tiled one at stride 2 by the CPU kernel
    and by the GEMM path; the outputs kept for the backward (the content lambda, the normalised keys) with every key
    normalisation and without keys."""
    for name in ('cpu_kernel', 'gemm'):
        backend(name)
        for form in (('tiled', 'dense') if name == 'gemm' else ('tiled',)):
            op, *inputs = _operator_inputs(form)
            torch.library.opcheck(op, [x.requires_grad_() if i < 5 else x for i, x in enumerate(inputs)])
    for key_norm, keys in (('none', True), ('l2', True), ('softmax', False)):
        op, *inputs = _operator_inputs('tiled')
        inputs[7] = key_norm
        if not keys:
            inputs[1] = None
        torch.library.opcheck(op, [x.requires_grad_() if i < 5 and x is not None else x for i, x in enumerate(inputs)])
        y, lam, kn = op(*inputs)
        assert lam.numel() == (2 * 5 * 3 if keys else 0) and kn.numel() == (10 * 28 * 2 if key_norm == 'l2' else 0)


# Double backward where a second-order gradient is disconnected:
# Double backward (``create_graph=True``, then a gradient of the gradients) through the position lambdas' custom
# operators against the plain-op forms they hand over to (``custom_ops._higher_order``), where the zeros-or-None choice
# shows: a first gradient that does not depend on some input (the output is linear in the queries and in the content
# lambda), so the second-order gradient of that input is disconnected. Autograd's contract, as the plain-op forms
# give it: None with ``allow_unused=True``, an error without it; not a tensor of zeros. (At stride 2 the pooling's
# backward keeps the queries in the graph with a zero derivative, autograd's formula for ``avg_pool2d_backward``: there
# the plain-op forms give the queries zeros, and so must the operators.)
_DB = dict(B=2, H=7, W=6, HEADS=2, K=3, U=1, V=4, SCOPE=5)  # a small layer


def _db_leaves(stride):
    g = torch.Generator().manual_seed(stride)
    b, hh, ww, heads, k, u, dv, scope = _DB.values()
    q = torch.randn(b, heads, k, hh * ww, generator=g, dtype=torch.float64)
    v = torch.randn(b, u, dv, hh * ww, generator=g, dtype=torch.float64)
    table = torch.randn(k, u, scope, scope, generator=g, dtype=torch.float64)
    content = torch.randn(b, k, dv, generator=g, dtype=torch.float64)
    weight = torch.randn(b, heads * dv, -(-hh // stride), -(-ww // stride), generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, v, table, content)], weight


_DB_NAMES = ['q', 'v', 'table', 'content']
# the first gradient penalised -> the inputs its gradient does not depend on (their second-order gradient is None)
_PENALISED = {'q': {'q'}, 'content': {'v', 'table', 'content'}}


def _second_order(form, stride, penalised):
    """A loss linear in the output (a fixed weight per entry), the first gradients with create_graph=True, then the
    gradient of the squared norm of one of them with allow_unused=True."""
    leaves, weight = _db_leaves(stride)
    q, v, table, content = leaves
    y = PL.position_lambdas(q, v, table, _DB['H'], _DB['W'], form, False, stride, False, None, content)
    first = torch.autograd.grad((y * weight).sum(), leaves, create_graph=True)
    penalty = first[_DB_NAMES.index(penalised)].square().sum()
    second = torch.autograd.grad(penalty, leaves, retain_graph=True, allow_unused=True)
    if any(g is None for g in second):
        with pytest.raises(RuntimeError, match='not have been used in the graph'):
            torch.autograd.grad(penalty, leaves)
    return second


@pytest.mark.parametrize('penalised', sorted(_PENALISED))
@pytest.mark.parametrize('stride', [1, 2])
@pytest.mark.parametrize('form', ['dense', 'tiled'])
def test_a_disconnected_second_order_gradient_is_none_as_in_the_plain_op_forms(form, stride, penalised, backend):
    """The custom operators (tiled at stride 1: the content lambda inside the operator) against the same form in plain
    ops and the einsum form: None for the same inputs, equal values for the others."""
    ops = _second_order(form, stride, penalised)
    einsum = _second_order('einsum', stride, penalised)
    backend('plain')
    plain = _second_order(form, stride, penalised)
    for name, got, same_form, other_form in zip(_DB_NAMES, ops, plain, einsum):
        assert (got is None) == (same_form is None) == (other_form is None), name
        if got is not None:
            assert name in _PENALISED[penalised] or got.abs().max() > 1e-3, name
            torch.testing.assert_close(got, same_form, rtol=1e-10, atol=1e-10, msg=name)
            torch.testing.assert_close(got, other_form, rtol=1e-10, atol=1e-10, msg=name)
    none = {name for name, got in zip(_DB_NAMES, ops) if got is None}
    assert none == (_PENALISED[penalised] if stride == 1 or penalised == 'content' else set())


@pytest.mark.parametrize('execution', ['cpu_kernel', 'gemm'])
@pytest.mark.parametrize('patched', [True, False])
@pytest.mark.parametrize('cip,scope', [(False, 5), (True, 7), (False, None)], ids=['local', 'include_pad', 'global'])
def test_stride_two_on_patches_and_on_the_full_map_equal_the_plain_ops(patched, cip, scope, execution, monkeypatch,
                                                                       backend):
    """The lambda operator at stride 2 both ways (:func:`fused.patched` forced: the queries' 3x3 patches against the
    pooled table with the content lambda repeated nine times, divided by the in-image counts; or the full map pooled
    after): output and the gradients of q, keys, v, the table and a shared lambda equal the plain ops' (float64,
    |u| = 2, an odd map, keys and a shared lambda), and the chosen way ran."""
    from timm_lambda.layers.position_lambda import fused
    ran = _use_execution(execution, 64, monkeypatch, backend)
    calls = []
    monkeypatch.setattr(fused, 'patched', lambda *a: calls.append(a) or patched)
    unfold = []
    monkeypatch.setattr(fused, '_patches', lambda *a, f=fused._patches: unfold.append(1) or f(*a))
    PL.backends.invalidate()  # (the plans read fused.patched)
    g = torch.Generator().manual_seed(7)
    hh, ww, k, u, dv = 7, 9, 3, 2, 5
    table = torch.randn(k, u, *((scope, scope) if scope else (2 * hh - 1, 2 * ww - 1)), generator=g,
                        dtype=torch.float64)
    leaves = [torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_() for s in
              [(2, 2, k, hh * ww), (2, u, k, hh * ww), (2, u, dv, hh * ww), tuple(table.shape), (2, k, dv)]]

    def run():
        q, keys, v, t, shared = leaves
        y = PL.position_lambdas(q, v, t, hh, ww, 'tiled', scope is None, 2, cip, None, shared, keys)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
        return [y] + list(torch.autograd.grad(y, leaves, gy))

    got = run()
    assert ran('tiled') and calls and bool(unfold) == patched
    backend('plain')
    for a, b in zip(got, run()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('shape', [(1, 4, 16, 64, 64), (2, 2, 3, 5, 7), (3, 1, 2, 1, 1), (1, 4, 16, 6, 9)])
@pytest.mark.parametrize('dtype', [torch.float64, torch.bfloat16])
def test_the_query_patches_are_unfolds(shape, dtype):
    """The stride-2 'patched' variant's 3x3 query patches (a strided view's copy) equal F.unfold's, bit for bit."""
    from timm_lambda.layers.position_lambda.fused import _patches
    b, h, k, H, W = shape
    q = torch.randn(b, h * k, H, W, dtype=torch.float64).to(dtype)
    want = F.unfold(q, 3, padding=1, stride=2).view(b, h, 9 * k, (H + 1) // 2, (W + 1) // 2)
    assert torch.equal(_patches(q, h, H, W), want)
