"""The registered operators as a safe boundary (issue 61): called directly (``torch.ops.timm_lambda...``) with a few
hundred inconsistent arguments on every backend this machine serves, each call in a forked child
(tests/_boundary_fuzz.py): no crash, no nondeterministic or wrong result, either a ValueError/TypeError naming the
argument or the plain ops' result; the same bad call gets the same error eager, under fake tensors and compiled; a
reparameterized layer put back into training warns. ``--heavy``: the same calls against a CPU kernel built with
AddressSanitizer."""
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from _helpers import require_triton
from timm_lambda.layers import LambdaLayer
from timm_lambda.layers import position_lambda as PL
from timm_lambda.layers.position_lambda import cpu_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, 'tests', '_boundary_fuzz.py')


def _fuzz(backends, cases, extra_env=None, args=()):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]), **(extra_env or {}))
    out = subprocess.run([sys.executable, DRIVER, *backends, '--cases', str(cases), *args], env=env,
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0 and f'done {len(backends) * cases}' in out.stdout, \
        out.stdout[-2000:] + out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{')], out.stderr


def _verdicts(rows):
    """Every row's verdict against its expectation: a clean error naming the argument, or the plain ops' result."""
    bad = []
    for r in rows:
        expect = r.get('expect')
        names = [expect] if isinstance(expect, str) else expect
        ok = (r['verdict'] == 'result' and expect is None) or (
            r['verdict'] == 'error' and names is not None and any(n in r['message'] for n in names))
        if not ok:
            bad.append(r)
    return bad


def test_inconsistent_calls_on_the_cpu_backends_get_errors_naming_the_argument_or_plain_results():
    """cpu_kernel and gemm, 150 calls each (forward and backward operator; wrong ranks, sizes, channels, dtypes,
    strides, choices and plans; gy, content and kn against the forward's; valid calls with non-contiguous maps,
    an empty batch, NaN and Inf): about 30 s on 2 shared cores."""
    if cpu_kernel.unavailable() is not None:
        pytest.skip(f'the CPU kernel is not built here: {cpu_kernel.unavailable()}')
    rows, _ = _fuzz(['cpu_kernel', 'gemm'], 150)
    bad = _verdicts(rows)
    assert not bad, bad[:5]
    assert sum(r['verdict'] == 'result' for r in rows) >= 40 and sum(r['verdict'] == 'error' for r in rows) >= 200


@pytest.mark.slow
def test_inconsistent_calls_on_the_triton_backends_interpreted():
    """triton_tc (float32) and triton_fma (float64) under Triton's interpreter, 46 calls each (the operators and the
    wrappers' own entry points): the same contract (the errors before any launch; the valid calls' kernels
    interpreted)."""
    require_triton()
    rows, _ = _fuzz(['triton_tc', 'triton_fma'], 46, dict(TRITON_INTERPRET='1'))
    bad = _verdicts(rows)
    assert not bad, bad[:5]


def _bad_calls():
    """A few inconsistent calls of the forward operator: (what is wrong, its arguments)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 4, generator=g)
    keys = torch.randn(2, 3, 5, 4, generator=g)
    v = torch.randn(2, 8, 5, 4, generator=g)
    table = torch.randn(3, 1, 5, 5, generator=g)
    plan = PL.make_plan(PL.Spec('tiled', 3, 1, 8, 2, 5, 5, False), q)
    rest = [1, False, 'softmax', False, 'tiled', plan.backend, plan.variant, plan.compute_dtype, list(plan.tiling)]

    def call(i=None, value=None, **tensors):
        args = [tensors.get('q', q), tensors.get('keys', keys), tensors.get('v', v), tensors.get('table', table),
                None] + list(rest)
        if i is not None:
            args[i] = value
        return args
    return [('v of another height', call(v=torch.randn(2, 8, 6, 4))),
            ('q channels not a multiple of k', call(q=torch.randn(2, 7, 5, 4))),
            ('an even table side', call(table=torch.randn(3, 1, 4, 5))),
            ('a float64 table', call(table=table.double())),
            ('stride 3', call(5, 3)),
            ("key_norm 'bogus'", call(7, 'bogus')),
            ("form 'bogus'", call(9, 'bogus')),
            ("backend 'plain'", call(10, 'plain'))]


def _error(fn):
    try:
        fn()
    except Exception as e:  # (compiled: dynamo wraps the fake kernel's error; its cause is the boundary's)
        while not isinstance(e, (ValueError, TypeError)) and (e.__cause__ or e.__context__) is not None:
            e = e.__cause__ or e.__context__
        return type(e).__name__, str(e).split('\n')[0]
    return None


@pytest.mark.parametrize('what,args', _bad_calls(), ids=[c[0] for c in _bad_calls()])
def test_the_same_bad_call_gets_the_same_error_eager_fake_and_compiled(what, args):
    """The real operator, its fake kernel (FakeTensorMode, what torch.compile traces with) and a compiled function
    calling it: the same ValueError or TypeError, word for word."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    op = torch.ops.timm_lambda.lambda_layer
    eager = _error(lambda: op(*args))
    assert eager is not None and eager[0] in ('ValueError', 'TypeError'), eager
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = _error(lambda: op(*fake_args))
    torch._dynamo.reset()
    compiled = _error(lambda: torch.compile(lambda *a: op(*a)[0], backend='aot_eager', fullgraph=True)(*args))
    assert fake == eager and compiled == eager, (eager, fake, compiled)


@pytest.mark.parametrize('name, bad', [('stride', float), ('count_include_pad', int), ('global_scope', int)])
def test_a_call_checked_once_lets_no_equal_looking_bad_call_through(name, bad):
    """check_call remembers the calls it found consistent (its host time): a later call equal to one of them as a
    dict key (``2.0 == 2``, ``0 == False``) but not in type still gets the error naming the argument. (Through the
    operator torch's schema converts such values first; check_call is public.)"""
    import random

    import _boundary_fuzz as F
    a = F.base(random.Random(0), 'gemm')  # (stride 2, no global scope)
    try:
        PL.check_call(*[a[n] for n in F.NAMES])  # consistent: remembered
        a[name] = bad(a[name])
        with pytest.raises((ValueError, TypeError), match=name):
            PL.check_call(*[a[n] for n in F.NAMES])
    finally:
        PL.set_backend('auto')


def test_a_reparameterized_layer_put_back_into_training_warns_once():
    """``reparameterize()`` is one-way (the norms folded into the projection): ``train()`` afterwards warns, naming
    it, once; ``eval()`` does not; a layer never folded does not."""
    layer = LambdaLayer(8, dim_k=4, heads=2, scope=5).eval()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        layer.train().eval()
    layer.reparameterize()
    with pytest.warns(RuntimeWarning, match=r'reparameterize\(\) folded the query and value batch norms'):
        torch.nn.Sequential(layer).train()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        layer.eval().train()


@pytest.mark.heavy
def test_the_inconsistent_calls_against_a_cpu_kernel_built_with_address_sanitizer(tmp_path):
    """The CPU kernel built with ``-fsanitize=address`` (about 2 minutes, in the driver's process, which preloads the
    compiler's libasan) serves the calls above, its entry points called directly with inconsistent tensors too: no
    error report, no crash. Not in CI (the build); run with ``--heavy``."""
    compiler = shutil.which('g++') or shutil.which('c++')
    if compiler is None:
        pytest.skip('no C++ compiler')
    libs = [subprocess.run([compiler, f'-print-file-name={name}'], capture_output=True, text=True).stdout.strip()
            for name in ('libasan.so', 'libstdc++.so.6')]  # (libstdc++ too: ASan intercepts its __cxa_throw)
    if not all(os.path.isfile(lib) for lib in libs):
        pytest.skip('no libasan')
    rows, stderr = _fuzz(['cpu_kernel'], 150, dict(LD_PRELOAD=' '.join(libs), ASAN_OPTIONS='detect_leaks=0'),
                         ['--asan-build', str(tmp_path)])
    assert 'AddressSanitizer' not in stderr, stderr[-5000:]
    bad = _verdicts(rows)
    assert not bad, bad[:5]
