"""The tiled operator's Triton execution (timm_lambda/layers/position_lambda/tiled_triton.py), which runs on CUDA,
tested on a CPU under Triton's interpreter (``TRITON_INTERPRET=1``, in a process of its own: the setting is read
when the kernels are defined) against the float64 per-query reference: tests/_triton_interpreted.py. On a GPU,
tests/test_cuda.py runs the compiled kernels."""
import os
import subprocess
import sys
import types

import pytest

from _helpers import load_file, require_triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_triton_required_and_missing_fails_not_skips(monkeypatch):
    """With TIMM_LAMBDA_REQUIRE_TRITON=1 (.ci/run) a missing Triton fails the kernel tests; without it they skip."""
    monkeypatch.setitem(sys.modules, 'triton', None)  # import triton raises ImportError
    monkeypatch.setenv('TIMM_LAMBDA_REQUIRE_TRITON', '1')
    with pytest.raises(pytest.fail.Exception, match='TIMM_LAMBDA_REQUIRE_TRITON=1, but Triton does not import'):
        require_triton()
    monkeypatch.setenv('TIMM_LAMBDA_REQUIRE_TRITON', '0')
    with pytest.raises(pytest.skip.Exception):
        require_triton()


def _interpreted(runs):
    require_triton()
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]))
    out = subprocess.run([sys.executable, os.path.join(ROOT, 'tests', '_triton_interpreted.py')] + runs, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f'{len(runs)} runs equal the reference' in out.stdout, out.stdout[-2000:]


@pytest.mark.slow
def test_cuda_core_kernels_interpreted_equal_the_reference_in_float64():
    """float64 (the CUDA-core kernels): stride 1 and 2 (both ways: on the queries' patches and pooled after, through
    the layer's entry point), |u| 1 and 2, a local and a global scope, 5 heads and |v| = 43 (not powers of 2), with
    and without a content lambda, one and several images a chunk, every chunk's kernels counted (five small cases:
    about 45 s; every case of tests/_cases.py takes the interpreter over 12 minutes)."""
    _interpreted(['0', '6c', '9c', '10c', '9c@patched'])


@pytest.mark.slow
def test_tensor_core_kernels_interpreted_round_as_they_claim():
    """The tensor-core kernels (tests/_triton_interpreted.py, ``tc:`` and ``f32:`` runs): float32 within 1e-5 of the
    float64 reference (exact float32 products) through the layer's entry point (stride 2 with ``count_include_pad``,
    a global scope with a content lambda, batch 1 at the 23x23 scope) and the operator; bfloat16 and float16 rounded
    as a matmul in that dtype, not as float32 (scopes 23, 25 (stride 2's pooled table), 7 and 5; |u| 2; 5 heads;
    the layer at stride 2 both ways, on the queries' patches and pooled after, every direction;
    |v| 43; batch 1 and 2; with and without the content lambda); three of them with 2 and 4 output rows a program
    (``BLOCK_Y``, the tune tool's alternatives), 4 not dividing the map's rows; one launched as on a GPU with more
    multiprocessors than any of its grids has programs (``@sm``: the small-grid rule's one output row and 32 value
    channels a program, four channel blocks at |v| 128, asserted of every launch)."""
    _interpreted(['f32:3', 'f32:5c', 'f32:4', 'tc:float32:1', 'tc:bfloat16:0', 'tc:bfloat16:2', 'tc:float16:1',
                  'tc:float16:3', 'f32:3@y4', 'tc:float32:1@y4', 'tc:bfloat16:0@y2', 'tc:bfloat16:2@sm100000',
                  'f32:9c@patched', 'f32:8@pooled'])


def _programs(meta, images, height, width, ho, wo, dv, u=1):
    """The programs of each tensor-core launch's grid, as the wrappers of tiled_triton.py launch them."""
    def cdiv(a, b):
        return -(-a // b)
    rows = {k: cdiv(wo, meta[k]['BLOCK_Q']) * cdiv(ho, meta[k]['BLOCK_Y']) * images for k in ('rows', 'logit_grad')}
    vg = meta['value_grad']
    return dict(rows, value_grad=cdiv(width, vg['BLOCK_P']) * height * images * u * cdiv(dv, vg['BLOCK_V']))


def test_small_grids_get_more_programs_down_to_one_a_multiprocessor():
    """``tc_launch_meta``'s small-grid rule: at batch 8 LambdaResNet-101's three 1024 px shapes keep the full-grid
    tiles that the H200 sweep measured (each grid has at least 132 programs already); at batch 1 the c5 layer's grids
    (32 x 32, |v| 128) had fewer programs than an H200's 132 multiprocessors, and get fewer output rows or value
    channels a program until they have at least 132 or the tiles reach their floor (1 row, 32 channels)."""
    import torch

    from timm_lambda.layers.position_lambda import tiled_triton as T
    shapes = [(256, 64, 1), (512, 64, 2), (512, 32, 1)]  # (width, side, stride), as benchmarks/tune_tc_kernels.py
    for dtype, prec in ((torch.bfloat16, 'ieee'), (torch.float32, 'tf32'), (torch.float32, 'ieee')):
        for width, side, step in shapes:
            c, kw, dv, out = (144, 25, width // 4, side // 2) if step == 2 else (16, 23, width // 4, side)
            full = T.tc_launch_meta(4, c, dv, side, out, kw, step, dtype, out, prec)
            assert T.tc_launch_meta(4, c, dv, side, out, kw, step, dtype, out, prec, images=8, sms=132) == full
            assert min(_programs(full, 8, side, side, out, out, dv).values()) >= 132
    for dtype, prec in ((torch.bfloat16, 'ieee'), (torch.float32, 'tf32')):
        full = T.tc_launch_meta(4, 16, 128, 32, 32, 23, 1, dtype, 32, prec)
        small = T.tc_launch_meta(4, 16, 128, 32, 32, 23, 1, dtype, 32, prec, images=1, sms=132)
        before, after = _programs(full, 1, 32, 32, 32, 32, 128), _programs(small, 1, 32, 32, 32, 32, 128)
        assert before['value_grad'] == 64 and after['value_grad'] == 256 and small['value_grad']['BLOCK_V'] == 32
        for k in ('rows', 'logit_grad'):
            assert after[k] >= before[k]
            assert after[k] >= 132 or small[k]['BLOCK_Y'] == 1, (k, small[k], after[k])
            assert after[k] < 2 * 132 or small[k]['BLOCK_Y'] == full[k]['BLOCK_Y'], (k, small[k], after[k])
        assert after['logit_grad'] > before['logit_grad'] or full['logit_grad']['BLOCK_Y'] == 1
        assert {k: v for k, v in small['rows'].items() if k not in ('BLOCK_Y', 'num_warps')} == \
            {k: v for k, v in full['rows'].items() if k not in ('BLOCK_Y', 'num_warps')}
    assert T.sm_count(torch.device('cpu')) is None  # off a GPU: the full-grid tiles


def test_the_table_runs_triton_on_cuda_tensor_cores_first_and_cuda_cores_for_small_float64_calls():
    """The CUDA rows of the backend table (backends.py): 'auto' runs triton_tc for every 16-bit and float32 call; for
    float64 triton_fma, on calls of at most 4096 queries and maps no larger than the scope, the gemm backend elsewhere
    (measured on an H200); neither for CPU tensors (outside Triton's interpreter); a chosen backend serves whatever it
    can compute and raises, with the table's reason, where it cannot."""
    require_triton()
    import torch

    from timm_lambda.layers.position_lambda import backends

    def call(batch, side, scope=23, device='cuda', dtype=torch.float64):
        return backends.Call('tiled', device, dtype, 1, batch * side * side, side <= scope)

    for dtype in (torch.float32, torch.bfloat16, torch.float16):  # tensor cores (TF32 or exact for float32)
        assert backends.choose(call(8, 64, dtype=dtype)) == backends.choose(call(1, 8, dtype=dtype)) == 'triton_tc'
    for small in (call(1, 64), call(4, 32), call(64, 14), call(2, 23)):  # float64: small calls; maps within the scope
        assert backends.choose(small) == 'triton_fma'
    for large in (call(8, 64), call(8, 32), call(2, 64), call(64, 14, scope=7)):
        assert backends.choose(large) == 'gemm'
        assert backends.why_not('triton_fma', large).startswith('auto: ')
        assert backends.why_not('triton_fma', large, auto=False) is None
    assert backends.why_not('triton_tc', call(1, 8)) == 'computes float16, bfloat16 and float32'
    assert backends.why_not('triton_fma', call(1, 8, dtype=torch.int32)) == \
        'computes float16, bfloat16, float32 and float64'
    if not tiled_triton_interpreted():
        assert backends.why_not('triton_tc', call(1, 8, device='cpu', dtype=torch.float32)) == \
            "needs CUDA tensors (or Triton's interpreter, TRITON_INTERPRET=1)"
        assert backends.choose(call(1, 8, device='cpu', dtype=torch.float32)) in ('cpu_kernel', 'gemm')


def tiled_triton_interpreted():
    from timm_lambda.layers.position_lambda import tiled_triton
    return tiled_triton.INTERPRETED


class _Broken:
    """Kernels whose launch fails as a Triton that cannot compile for this GPU does."""

    def __getitem__(self, grid):
        def launch(*args, **meta):
            raise RuntimeError('no compiler for this GPU')
        return launch


def _broken_triton(monkeypatch):
    """Triton's kernels as broken ones, served on CPU tensors (as under the interpreter), the CPU kernel out of the
    way: 'auto' then tries triton_tc first for float32."""
    import torch

    from timm_lambda.layers import execution
    from timm_lambda.layers.position_lambda import backends, tiled_triton

    kernels = dict(query_rows=_Broken(), value_grad=_Broken(), tc_rows=_Broken(), tc_value_grad=_Broken(), tl=torch,
                   triton=types.SimpleNamespace(cdiv=lambda a, b: -(-a // b)))
    monkeypatch.setattr(tiled_triton, 'kernels', lambda: kernels)
    monkeypatch.setattr(tiled_triton, 'INTERPRETED', True)
    monkeypatch.setattr(tiled_triton, '_LAUNCHED', False)
    monkeypatch.setattr(tiled_triton, '_FAILED', None)
    monkeypatch.setattr(backends, 'REGISTRY', {n: b for n, b in backends.REGISTRY.items() if n != 'cpu_kernel'})
    monkeypatch.setattr(backends, '_failed', {})
    monkeypatch.setattr(execution, '_WARNED', set())
    backends.invalidate()  # (plans made before read the registry as it was)


def test_a_failing_first_launch_hands_the_call_to_the_next_backend(monkeypatch, backend):
    """Outside strict mode, a Triton that cannot compile the kernels here (its first launch raises): one warning, both
    Triton backends unusable for the process (the registry says why: the failed one as failed, the other as unable to
    run), handed on once to the gemm backend, whose result equals the reference, forward and backward."""
    import torch

    from _cases import CASES
    from _cases import call as _call
    from _cases import inputs as _inputs
    from reference import position_term_reference
    from timm_lambda.layers import position_lambda as PL
    from timm_lambda.layers.position_lambda import backends

    _broken_triton(monkeypatch)
    backend('auto', strict=False)
    case = CASES[0]
    q, v, table = (t.float() for t in _inputs(case))
    PL.served_backends(reset=True)
    leaves = [x.requires_grad_() for x in (q, v, table)]
    with pytest.warns(RuntimeWarning, match='the triton_tc backend of the position lambdas failed'):
        y = _call('tiled', case, *leaves)
    y.sum().backward()
    call = backends.Call('tiled', 'cpu', torch.float32)
    assert backends.why_not('triton_tc', call).startswith("failed in this process (Triton's first launch failed: "
                                                          'RuntimeError: no compiler for this GPU)')
    assert backends.why_not('triton_fma', call).startswith("Triton's first launch failed: RuntimeError: no compiler")
    assert {k[1] for k in PL.served_backends()} == {'gemm'}
    torch.testing.assert_close(y, position_term_reference(q, v, table, case[1], case[2], case[8], case[9]),
                               rtol=1e-5, atol=1e-5)


def test_a_failing_launch_raises_in_strict_mode_and_for_a_chosen_backend(monkeypatch, backend):
    """Strict mode (every test's, tools/gpu_check.py's) or a chosen backend: a kernel that fails raises instead of
    handing the call to the gemm backend, whose correct answer would otherwise hide it; a failed launch is no first
    launch (a later one that cannot run here is still told apart from a kernel fault)."""
    from _cases import CASES
    from _cases import call as _call
    from _cases import inputs as _inputs
    from timm_lambda.layers import execution
    from timm_lambda.layers.position_lambda import tiled_triton

    _broken_triton(monkeypatch)
    case = CASES[0]
    q, v, table = (t.float() for t in _inputs(case))
    for name, strict in (('auto', True), ('triton_tc', False)):
        backend(name, strict=strict)
        with pytest.raises(execution.BackendUnusable, match='no compiler for this GPU'):
            _call('tiled', case, q, v, table)
        tiled_triton._FAILED = None  # (the next try launches again)
    assert not tiled_triton._LAUNCHED
    tiled_triton._launch({(1,): lambda *a, **m: None}, (1,))
    assert tiled_triton._LAUNCHED


_SM90 = load_file('benchmarks/sm90_kernels.py', 'sm90_kernels')


@pytest.mark.slow
@pytest.mark.parametrize('shape', _SM90.SHAPES, ids=[s[0] for s in _SM90.SHAPES])
def test_tensor_core_kernels_compile_for_sm90_with_wgmma_no_spills_two_programs_and_async_loads(shape):
    """Every tensor-core kernel as the wrappers launch it (``tiled_triton.tc_launch_meta``) at LambdaResNet-101's
    three 1024 px shapes and a small odd one, compiled ahead of time for sm_90 (H100 and H200) by Triton on this CPU
    with the launcher's specialisation at those sizes (benchmarks/sm90_kernels.py; issue 53 item 2): every 16-bit and
    TF32 kernel (the value gradient too) on Hopper's warpgroup MMA (``wgmma``), the exact float32 one on no tensor
    cores; none spills to local memory (``ptxas -v``); at least two programs resident a multiprocessor (registers,
    warps, shared memory); the 16-bit kernels' and the TF32 value gradient's main loops pipelined (``num_stages`` >
    1) with asynchronous copies (``cp.async``) at the three shapes (the odd one's 13-wide rows are not 4-byte
    aligned). Not asserted: the TF32 rows and logit gradient keep one stage (no ``cp.async``), as run 5 measured
    faster (tiled_triton.tc_launch_meta)."""
    require_triton()
    rows = _SM90.report([shape])
    assert {(r['dtype'], r['precision']) for r in rows} >= {('bf16', 'ieee'), ('fp16', 'ieee'), ('fp32', 'tf32')}
    for r in rows:
        name = f"{r['kernel']} {r['dtype']} {r['precision']} {r['constexprs']}"
        assert bool(r['mma'] + r['wgmma']) == r['tensor_cores'], f'{name}: tensor-core instructions {r}'
        if r['tensor_cores']:
            assert r['wgmma'] > 0, f'{name}: no wgmma {r}'
        assert r['shared'] <= _SM90.SHARED_LIMIT, f"{name}: {r['shared']} bytes of shared memory"
        assert r['registers'] is not None and r['spill_stores'] == 0 and r['spill_loads'] == 0, f'{name}: {r}'
        assert r['programs_per_sm'] >= 2, f'{name}: {r}'
        sixteen = r['dtype'] in ('bf16', 'fp16')
        if shape[0] != 'odd' and (sixteen or (r['precision'] == 'tf32' and r['kernel'] == 'tc_value_grad')):
            assert r['num_stages'] > 1 and r['cp_async'] > 0, f'{name}: no asynchronous loads {r}'


def test_only_cannot_run_here_errors_at_the_first_launch_hand_the_call_on(monkeypatch):
    """Only an error that says this backend cannot serve calls here makes it unusable (the call handed on outside
    strict mode): no driver, no C compiler, no assembler, a kernel that this Triton cannot compile or this GPU cannot
    hold (``OutOfResources``). A kernel fault (an illegal address, a device-side assert), running out of memory and
    any other error propagate as they are, at the first launch too."""
    require_triton()
    import subprocess

    import torch
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    from timm_lambda.layers import execution
    from timm_lambda.layers.position_lambda import tiled_triton

    faults = [torch.OutOfMemoryError('CUDA out of memory'), ValueError('a wrong argument'), KeyError('BLOCK_Q'),
              RuntimeError('CUDA error: an illegal memory access was encountered'),
              RuntimeError('Triton Error [CUDA]: misaligned address'), RuntimeError('CUDA error: device-side assert '
                                                                                     'triggered'),
              RuntimeError('CUDA driver error: unspecified launch failure'), RuntimeError('some other failure')]
    if hasattr(torch, 'AcceleratorError'):
        faults.append(torch.AcceleratorError('CUDA error: an illegal memory access was encountered'))
    cannot = [OutOfResources(300000, 232448, 'shared memory'), CompilationError('src', None, 'not supported'),
              RuntimeError('0 active drivers ([]). There should only be one.'), OSError('libcuda.so not found'),
              ImportError('libcuda'), RuntimeError('Failed to find C compiler. Please specify via CC'),
              subprocess.CalledProcessError(1, ['gcc'])]
    for errors, unusable in ((faults, False), (cannot, True)):
        for error in errors:
            monkeypatch.setattr(tiled_triton, '_LAUNCHED', False)

            def broken(*args, error=error, **meta):
                raise error
            with pytest.raises(Exception) as raised:
                tiled_triton._launch({(1,): broken}, (1,))
            assert isinstance(raised.value, execution.BackendUnusable) == unusable, (error, raised.value)
            assert unusable or raised.value is error


def test_chunks_are_the_fewest_of_about_equal_size():
    """Images go to the Triton kernels in the fewest chunks whose logits fit ``CHUNK_ELEMENTS``, of sizes that differ
    by at most one: LambdaResNet-101's c4 layer at 1024 px, batch 8 (4 heads, 536 logits a query of 64 x 64) in one
    chunk; at half the limit in 4 and 4 images, not 7 and 1 (the second launch set on a one-image grid)."""
    from timm_lambda.layers.position_lambda import tiled_triton as T
    per_image = 4 * T.logit_stride(23 * 23) * 64 * 64
    assert T.image_chunks(8, per_image, T.CHUNK_ELEMENTS) == [(0, 8)]
    assert T.image_chunks(8, per_image, T.CHUNK_ELEMENTS // 2) == [(0, 4), (4, 4)]
    assert T.image_chunks(10, 1, 4) == [(0, 4), (4, 3), (7, 3)]
    assert T.image_chunks(3, 5, 1) == [(0, 1), (1, 1), (2, 1)] and T.image_chunks(0, 5, 10) == []


def test_query_major_logits_rows_are_aligned_for_cublas():
    """The tensor-core path's compact logits ``[n h, Ho Wo, LS]`` have rows of ``LS`` = ``u K_h K_w`` rounded up to 8
    elements (16 bytes in 16-bit): the GEMMs that write them (forward) and read them (``dq``, ``dR``) then get cuBLAS's
    aligned kernels (at 529 an H200 ran SIMT and unaligned ones). The padding columns are zero, the others the
    logits ``q . R``."""
    import torch

    from timm_lambda.layers.position_lambda import tiled_triton as T
    assert [T.logit_stride(s) for s in (529, 625, 49, 50, 536)] == [536, 632, 56, 56, 536]
    torch.manual_seed(0)
    q = torch.randn(2, 3, 16, 5, 7, dtype=torch.float64)
    table = torch.randn(16, 1, 23, 23, dtype=torch.float64)
    padded = T.padded_table(table)
    logits = T.query_major_logits(q, padded)
    assert padded.shape == (16, 536) and logits.shape == (6, 35, 536) and logits.stride(1) % 8 == 0
    want = torch.einsum('nhcyx,cs->nhyxs', q, table.reshape(16, 529)).reshape(6, 35, 529)
    torch.testing.assert_close(logits[..., :529], want)
    assert (logits[..., 529:] == 0).all()
