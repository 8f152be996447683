"""Run by tests/test_tiled_triton.py in a process with ``TRITON_INTERPRET=1``: the tiled operator's Triton kernels
(timm_lambda/layers/position_lambda/tiled_triton.py), interpreted on the CPU, in strict mode (a kernel that fails
raises; a run in which a direction launched none of its kernels fails, tests/_launches.py), every tensor torch
allocates uninitialised filled with NaN (torch's deterministic mode: an element no kernel wrote fails).

Arguments, one run each:

* ``<i>`` or ``<i>c``: tests/test_position_lambda.py's ``CASES[i]`` in float64 (the ``triton_fma`` backend), ``c``
  with a content lambda: output and every gradient equal the float64 per-query reference (1e-10); every second run
  puts one image in a chunk; ``f32:<i>[c]``: the same in float32 through the layer's entry point (the ``triton_tc``
  backend, exact float32 products: stride-2 pooling with ``count_include_pad``, global scopes), within 1e-5;
* ``tc:<dtype>:<i>``: tests/_sixteen_bit.py's ``SIXTEEN_BIT_CASES[i]`` on the ``triton_tc`` backend. ``float32`` (exact
  float32 products: TF32 is off, as torch's matmuls have it by default): within 1e-5 of the float64 reference, which
  a 16-bit or TF32 computation is not; ``bfloat16`` / ``float16``: rounded as a matmul in that dtype
  (:func:`_sixteen_bit.check_rounding`).

A suffix ``@patched`` or ``@pooled`` (``f32:`` and float64 runs at stride 2) forces the layer's stride-2 way
(``fused.patched``): the kernels on the queries' 3x3 patches at step 2, or at step 1 on the full map pooled after
(asserted of every launch); every run with one image a chunk checks that each direction launched its kernels for
every chunk. A suffix ``@y<n>`` runs the tensor-core kernels with ``n`` output rows a program (``BLOCK_Y``; otherwise
the wrappers' default, ``tiled_triton.tc_launch_meta``), e.g. ``tc:float32:1@y4``: a row count that does not divide the
map's checks the last program's rows. A suffix ``@sm<n>`` launches them as on a GPU of ``n`` multiprocessors
(``tiled_triton.sm_count``; off a GPU: none, the tiles of a full grid), e.g. ``tc:bfloat16:2@sm100000``: every grid
smaller than that, so the fewest output rows and value-gradient channels a program (``tc_launch_meta``'s small-grid
rule).

Each run chooses its backend through the public override (``set_backend``) and checks that the registry counted the
call, forward and backward, for it alone. Prints one line per run and a summary; exits non-zero on
the first mismatch."""
import os
import sys
import time

import torch

assert os.environ.get('TRITON_INTERPRET') == '1', 'run with TRITON_INTERPRET=1'
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _launches  # noqa: E402
import _sixteen_bit as SB  # noqa: E402
from _cases import CASES, IDS  # noqa: E402
from _cases import content_reference as _content_reference  # noqa: E402
from _cases import inputs as _inputs  # noqa: E402
from _kernel_op import kernel_call  # noqa: E402
from _launches import Directions  # noqa: E402
from reference import position_term_reference  # noqa: E402
from timm_lambda.layers import position_lambda as PL  # noqa: E402
from timm_lambda.layers.position_lambda import fused, tiled_triton  # noqa: E402

_patched = fused.patched

PL.set_backend('triton_tc', strict=True)  # a kernel that fails raises (no other backend's answer)
# torch fills what it allocates uninitialised with NaN here (torch.utils.deterministic.fill_uninitialized_memory): an
# output element no kernel wrote stays NaN and fails the comparison
torch.use_deterministic_algorithms(True, warn_only=True)
assert torch.utils.deterministic.fill_uninitialized_memory
torch.backends.cuda.matmul.allow_tf32 = False  # float32: the exact tl.dot


def float64_run(run, index, with_content, dtype=torch.float64, variant=''):
    case = CASES[index]
    b, hh, ww, _, k, _, dv, scope, stride, cip, _ = case
    one_image = bool(run % 2)
    tiled_triton.CHUNK_ELEMENTS = 1 if one_image else 1 << 27  # one image a chunk, or all in one
    fused.patched = _patched if not variant else (lambda *a: variant == 'patched')  # the stride-2 way, forced
    PL.set_backend('triton_fma' if dtype == torch.float64 else 'triton_tc')  # (the plans made anew: they read them)
    q, v, table = _inputs(case)
    leaves = [q, v, table]
    content = None
    if with_content:
        content = torch.randn(case[0], k, dv, generator=torch.Generator().manual_seed(7), dtype=q.dtype)
        leaves.append(content)
    for t in leaves:
        t.requires_grad_()
    ref = position_term_reference(q, v, table, hh, ww, stride, cip)
    if with_content:
        ref = ref + _content_reference(content, q, case)
    low = [t.detach().to(dtype).requires_grad_() for t in leaves]
    directions = Directions()
    y = PL.position_lambdas(*low[:3], hh, ww, 'tiled', scope is None, stride, cip, None, *low[3:])
    directions.forward_done()
    y = y.reshape(ref.shape)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=ref.dtype)
    got = [y] + list(torch.autograd.grad(y, low, g.to(dtype)))
    forward_fused = any(m.get('FUSED') and not m.get('LOGIT_GRAD') for _, m in _launches.METAS)
    chunks = dict(forward=1 if forward_fused or not one_image else b, backward=b if one_image else 1)
    directions.check(PL.get_backend(), stride, IDS[index], chunks=chunks)  # each direction (and chunk) its kernels
    if variant:  # the stride-2 way taken: the kernels at step 2 on the queries' patches, or at step 1 pooled after
        steps = {m['STEP'] for _, m in _launches.METAS}
        assert steps == {2 if variant == 'patched' else 1}, (variant, steps)
    want = [ref] + list(torch.autograd.grad(ref, leaves, g))
    if dtype == torch.float64:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        return f'{IDS[index]} content={with_content}{" " + variant if variant else ""}: equal'
    errs = [((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, want)]
    assert all(a.dtype == dtype for a in got) and max(errs) < 1e-5, errs
    return (f'{IDS[index]} content={with_content}{" " + variant if variant else ""} {dtype}: '
            + ', '.join(f'{e:.1e}' for e in errs))


def tensor_core_run(dtype, index):
    PL.set_backend('triton_tc')
    case = SB.SIXTEEN_BIT_CASES[index]
    g = torch.Generator().manual_seed(0)
    inputs = SB.operator_inputs(case, lambda *shape: torch.randn(shape, generator=g), dtype)
    gy = torch.randn(SB.output_shape(case), generator=g).to(dtype)
    directions = Directions()
    got = SB.operator_call(kernel_call, case, inputs, gy, directions.forward_done)
    directions.check('triton_tc', case[8], SB.SIXTEEN_BIT_IDS[index])  # each direction ran its own kernels
    if dtype == torch.float32:
        want = SB.reference_call(case, inputs, gy)
        errs = {n: ((a.double() - b).norm() / b.norm()).item() for n, a, b in zip(SB.NAMES, got, want)}
        assert all(e < 1e-5 for e in errs.values()), errs
        return f'tc {SB.SIXTEEN_BIT_IDS[index]} float32: ' + ', '.join(f'{n} {e:.1e}' for n, e in errs.items())
    seen = SB.check_rounding(got, case, inputs, gy, dtype)
    return f'tc {SB.SIXTEEN_BIT_IDS[index]} {dtype}: {seen}'


runs = sys.argv[1:] or [str(i) + c for i in range(len(CASES)) for c in ('', 'c')]
launch_meta = tiled_triton.tc_launch_meta
sm_count = tiled_triton.sm_count
_launches.hook_kernels()


def rows_a_program(n):
    def meta(*args, **kwargs):
        out = launch_meta(*args, **kwargs)
        return dict(out, rows=dict(out['rows'], BLOCK_Y=n), logit_grad=dict(out['logit_grad'], BLOCK_Y=n))
    return meta


for run, arg in enumerate(runs):
    start = time.time()
    _launches.METAS.clear()
    PL.served_backends(reset=True)
    arg, _, sms = arg.partition('@sm')
    arg, _, rows = arg.partition('@y')
    arg, _, variant = arg.partition('@')  # '@patched' / '@pooled': the stride-2 way forced (f32 and float64 runs)
    tiled_triton.tc_launch_meta = rows_a_program(int(rows)) if rows else launch_meta
    tiled_triton.sm_count = (lambda device, n=int(sms): n) if sms else sm_count
    if arg.startswith('tc:'):
        _, dtype, index = arg.split(':')
        line = tensor_core_run(getattr(torch, dtype), int(index))
    elif arg.startswith('f32:'):
        index = arg[4:]
        line = float64_run(run, int(index.rstrip('c')), index.endswith('c'), torch.float32, variant)
    else:
        line = float64_run(run, int(arg.rstrip('c')), arg.endswith('c'), variant=variant)
    launched = [meta for _, meta in _launches.METAS if 'WIDEN' in meta]  # the tensor-core launches' constants
    stride = (SB.SIXTEEN_BIT_CASES if arg.startswith('tc:') else CASES)[int(arg.split(':')[-1].rstrip('c'))][8]
    if arg.startswith(('tc:', 'f32:')) and stride == 1:  # forward and logit gradient (with dq) fused
        assert {('BLOCK_P' in m, m.get('LOGIT_GRAD')) for m in launched if m.get('FUSED')} == {
            (False, False), (False, True)}, launched  # (no dq GEMM; the value gradient reads the logits GEMM's)
    if sms:  # the wrappers applied the small-grid rule: one output row and at most 32 value channels a program
        assert launched and all(m.get('BLOCK_Y', 1) == 1 for m in launched), launched
        assert all(m['BLOCK_V'] <= 32 for m in launched if 'BLOCK_P' in m), launched
    served = PL.served_backends()
    assert {k[1] for k in served if k[0] == 'tiled'} == {PL.get_backend()}, served
    assert {k[4] for k in served if k[0] == 'tiled'} == {'forward', 'backward'}, served
    print(f'{line}{" BLOCK_Y=" + rows if rows else ""}{" SMs=" + sms if sms else ""} ({time.time() - start:.1f} s)',
          flush=True)
print(f'{len(runs)} runs equal the reference')
