"""The backend registry of the position lambdas (timm_lambda/layers/position_lambda/backends.py) on a CPU: every
row (backend x form) in every dtype through the public override (tests/_backend_matrix.py; tests/test_cuda.py runs the
CUDA case), the override's and the registry's own promises: 'auto' picks per call, a chosen backend raises with its
reason, the served calls are counted (forward and backward) and logged once, the environment variable is read at
import."""
import logging
import os
import subprocess
import sys

import pytest
import torch

import _backend_matrix as M
import _cases as C
from timm_lambda._env import env
from timm_lambda.layers import position_lambda as PL
from timm_lambda.layers.position_lambda import backends, cpu_kernel


@pytest.mark.parametrize('dtype', M.DTYPES, ids=M.DTYPE_IDS)
@pytest.mark.parametrize('name,form', M.ROWS, ids=M.ROW_IDS)
@pytest.mark.parametrize('case', M.MATRIX_CASES, ids=M.MATRIX_IDS)
def test_every_row_serves_its_calls_or_refuses_them_with_the_tables_reason(case, name, form, dtype, backend):
    if name == 'cpu_kernel':
        assert cpu_kernel.unavailable() is None or not env('TIMM_LAMBDA_REQUIRE_CPU_KERNEL'), \
            'the CPU kernel must be built here'
    M.check_row(backend, name, form, 'cpu', dtype, case)


def test_auto_picks_the_first_backend_that_serves_a_call(backend):
    """On a CPU: the kernel for the tiled form (where built), the gemm backend's operator for the dense form, plain
    ops for the lambda forms; every call counted for the backend that served it, and logged once per combination."""
    backend('auto')
    case = C.CASES[0]
    q, v, table = C.inputs(case, torch.float32)
    PL.served_backends(reset=True)
    for form in ('tiled', 'dense', 'einsum', 'conv', 'tiled'):
        C.call(form, case, q, v, table)
    kernel = 'cpu_kernel' if cpu_kernel.unavailable() is None else 'gemm'
    assert PL.served_backends() == {('tiled', kernel, 'cpu', 'float32', 'forward'): 2,
                                    ('dense', 'gemm', 'cpu', 'float32', 'forward'): 1,
                                    ('einsum', 'plain', 'cpu', 'float32', 'forward'): 1,
                                    ('conv', 'plain', 'cpu', 'float32', 'forward'): 1}
    assert PL.served_backends(reset=True) and PL.served_backends() == {}


def test_each_new_combination_is_logged_once_at_info(backend, caplog, monkeypatch):
    monkeypatch.setattr(backends, 'SERVED', backends.SERVED.__class__())
    backend('gemm')
    case = C.CASES[0]
    q, v, table = C.inputs(case, torch.float32)
    with caplog.at_level(logging.INFO, logger=backends.__name__):
        for _ in range(3):
            C.call('tiled', case, q, v, table)
    assert [r.getMessage() for r in caplog.records] == [
        'timm_lambda: the tiled form of the position lambdas runs by the gemm backend (device cpu, float32, forward): '
        'chosen by set_backend or TIMM_LAMBDA_BACKEND']


def test_served_backends_say_why_auto_chose_each(backend, monkeypatch):
    """``served_backends(why=True)`` (and the INFO line) name why a backend served a combination: under 'auto' the
    reasons of the backends before it (issue 52: a CPU kernel that auto passes over says so)."""
    monkeypatch.setattr(cpu_kernel, 'declines', lambda dtype, step: 'auto: declined for this test')
    monkeypatch.setattr(backends, 'SERVED', backends.SERVED.__class__())
    backend('auto', strict=False)  # (a new plan: the switch makes every plan anew)
    case = C.CASES[0]
    q, v, table = C.inputs(case, torch.float32)
    C.call('tiled', case, q, v, table)
    why = PL.served_backends(why=True)[('tiled', 'gemm', 'cpu', 'float32', 'forward')]
    assert why.startswith('auto: the first backend of the registry that serves the call (')
    assert 'cpu_kernel: auto: declined for this test' in why and 'triton_tc: ' in why


def test_a_chosen_backend_that_cannot_serve_raises_with_the_reason(backend):
    case = C.CASES[0]
    q, v, table = C.inputs(case, torch.float32)
    backend('cpu_kernel')
    with pytest.raises(ValueError, match=r"backend 'cpu_kernel' computes the tiled form, not 'dense': choose the "
                                         r"layer's form accordingly, or set_backend\('auto'\)"):
        C.call('dense', case, q, v, table)
    backend('gemm')
    with pytest.raises(ValueError, match="backend 'gemm' computes the dense and tiled forms, not 'conv'"):
        C.call('conv', case, q, v, table)
    with pytest.raises(ValueError, match=r"^backend must be 'auto' or one of 'cpu_kernel', 'triton_tc', "
                                         r"'triton_fma', 'gemm', 'plain' \(any case\), got 'triton'$"):
        PL.set_backend('triton')
    assert PL.get_backend() == 'gemm'
    PL.set_backend('GEMM')  # the spellings TIMM_LAMBDA_BACKEND accepts
    assert PL.get_backend() == 'gemm'


def test_a_chosen_kernel_backend_makes_auto_forms_tiled(backend):
    """'auto' resolves to a form the chosen backend computes: the tiled form for the kernel backends (a small map that
    'auto' would run dense), the measured rule otherwise."""
    local, global_ = (PL.Spec('auto', 4, 1, 4, 2, 7, 7, g) for g in (False, True))
    backend('auto')
    assert PL.choose_form(local, 4, 4) == 'dense'
    for name in ('cpu_kernel', 'triton_tc', 'triton_fma'):
        backend(name)
        assert PL.choose_form(local, 4, 4) == 'tiled'
        assert PL.choose_form(global_, 4, 4) == 'dense'  # a global scope has no tiled advantage


def test_graph_recorders_record_plain_ops_whatever_the_choice(backend):
    """jit.trace (and torch.export) record plain tensor ops even with a kernel backend chosen: their graphs must run
    without this package's operators, at every size."""
    from timm_lambda.layers import LambdaLayer
    backend('gemm')
    layer = LambdaLayer(8, dim_k=4, heads=2, scope=5).eval()
    x = torch.randn(1, 8, 9, 10)
    PL.served_backends(reset=True)
    with torch.no_grad():
        traced = torch.jit.trace(layer, x, check_trace=False)  # (the check would run the layer eagerly)
    assert {k[1] for k in PL.served_backends()} == {'plain'}
    assert not any('timm_lambda' in str(n.kind()) for n in traced.graph.nodes())
    torch.testing.assert_close(traced(x), layer(x), rtol=1e-5, atol=1e-5)


def test_the_environment_variable_chooses_at_import_and_refuses_a_typo():
    def run(value):
        code = ('from timm_lambda.layers import position_lambda as PL, LambdaLayer; import torch\n'
                'print(PL.get_backend()); LambdaLayer(8, dim_k=4, heads=2, scope=5)(torch.randn(1, 8, 9, 10))\n'
                'print(sorted({k[1] for k in PL.served_backends()}))')
        env = dict(os.environ, TIMM_LAMBDA_BACKEND=value, TIMM_LAMBDA_NO_AUTOLOAD='1')
        return subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=300)

    out = run(' GEMM ')
    assert out.returncode == 0 and out.stdout.split('\n')[:2] == ['gemm', "['gemm']"], out.stderr[-2000:]
    out = run('on')
    assert out.returncode != 0 and ("TIMM_LAMBDA_BACKEND='on' is not a valid value: use auto, cpu_kernel, triton_tc, "
                                    "triton_fma, gemm, plain, or leave it unset") in out.stderr, out.stderr[-2000:]
