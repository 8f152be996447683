"""The tiled operator's Triton execution (timm_lambda/layers/position_lambda/tiled_triton.py), which runs on CUDA,
tested on a CPU under Triton's interpreter (``TRITON_INTERPRET=1``, in a process of its own: the setting is read
when the kernels are defined) against the float64 per-query reference: tests/_triton_interpreted.py. On a GPU,
tests/test_cuda.py runs the compiled kernels."""
import os
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_triton_execution_interpreted_equals_the_reference():
    pytest.importorskip('triton', reason='Triton is not installed (it comes with torch on Linux x86-64)')
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]))
    # stride 1 and 2, |u| 1 and 2, a local and a global scope, 5 heads and |v| = 43 (not powers of 2), with and without
    # a content lambda, one and several images a chunk (the whole list takes the interpreter about 12 minutes)
    runs = ['0', '2c', '6c', '7c']
    out = subprocess.run([sys.executable, os.path.join(ROOT, 'tests', '_triton_interpreted.py')] + runs, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f'{len(runs)} runs equal the reference' in out.stdout, out.stdout[-2000:]


def test_triton_runs_on_cuda_for_small_calls_and_maps_within_the_scope(monkeypatch):
    """The CUDA executions' rule (tiled_triton.runs, measured on an H200): Triton for calls of at most 4096 queries
    and for maps no larger than the scope, the GEMM path elsewhere; never for CPU tensors; ``TIMM_LAMBDA_TRITON``
    ``1`` / ``0`` force it on or off."""
    pytest.importorskip('triton', reason='Triton is not installed (it comes with torch on Linux x86-64)')
    import torch

    from timm_lambda.layers.position_lambda import tiled_triton

    def call(batch, side, scope=23, cuda=True, dtype=torch.float32):
        q = types.SimpleNamespace(is_cuda=cuda, dtype=dtype, shape=(batch, 4, 16, side, side))
        return tiled_triton.runs(q, types.SimpleNamespace(shape=(batch, 64, side, side)),
                                 types.SimpleNamespace(shape=(16, 1, scope, scope)))

    assert call(1, 64) and call(4, 32) and call(64, 14) and call(2, 23)  # small calls; maps within the scope
    assert not call(8, 64) and not call(8, 32) and not call(2, 64) and not call(64, 14, scope=7)
    assert not call(1, 8, cuda=False) and not call(1, 8, dtype=torch.int32)
    monkeypatch.setattr(tiled_triton, 'MODE', '1')
    assert call(8, 64) and not call(1, 8, cuda=False)
    monkeypatch.setattr(tiled_triton, 'MODE', '0')
    assert not call(1, 8)
    monkeypatch.setattr(tiled_triton, 'MODE', 'yes')  # $TIMM_LAMBDA_TRITON is read as '1' (tests/test_env.py)
    with pytest.raises(ValueError, match="tiled_triton.MODE must be 'auto', '1' or '0', got 'yes'"):
        call(1, 8)


def test_a_failing_first_launch_turns_triton_off_and_the_gemm_path_answers(monkeypatch):
    """A Triton that cannot compile the kernels here (its first launch raises): one warning, this execution off for
    the process, and the operator's result from the GEMM path, equal to the reference."""
    import torch

    from reference import position_term_reference
    from test_position_lambda import CASES, _call, _inputs
    from timm_lambda.layers.position_lambda import cpu_kernel, execution, tiled_triton

    class Broken:
        def __getitem__(self, grid):
            def launch(*args):
                raise RuntimeError('no compiler for this GPU')
            return launch

    monkeypatch.setattr(tiled_triton, 'MODE', '1')
    monkeypatch.setattr(tiled_triton, '_LAUNCHED', False)
    monkeypatch.setattr(tiled_triton, 'runs', lambda q, v, table: tiled_triton.MODE != '0')  # as if on a GPU
    kernels = dict(query_rows=Broken(), value_grad=Broken(), tl=torch,
                   triton=types.SimpleNamespace(cdiv=lambda a, b: -(-a // b)))
    monkeypatch.setattr(tiled_triton, '_kernels', lambda: kernels)
    monkeypatch.setattr(cpu_kernel, 'ENABLED', False)
    monkeypatch.setattr(execution, '_WARNED', set())
    case = CASES[0]
    q, v, table = _inputs(case)
    with pytest.warns(RuntimeWarning, match='Triton kernels failed at their first launch'):
        y = _call('tiled', case, q, v, table)
    assert tiled_triton.MODE == '0'
    torch.testing.assert_close(y, position_term_reference(q, v, table, case[1], case[2], case[8], case[9]),
                               rtol=1e-10, atol=1e-10)
