"""Run by tests/test_tiled_triton.py in a process with ``TRITON_INTERPRET=1``: the tiled operator's Triton execution
(timm_lambda/layers/position_lambda/tiled_triton.py), interpreted on the CPU, against the float64 per-query
reference, with and without a content lambda, outputs and every gradient. Arguments: indices into
tests/test_position_lambda.py's CASES, ``c`` appended for a content lambda (default: every case with and without; the
interpreter takes about 12 minutes for them all). Every second run puts one image in a chunk. Prints one line per run
and a summary; exits non-zero on the first mismatch."""
import os
import sys
import time

import torch

assert os.environ.get('TRITON_INTERPRET') == '1', 'run with TRITON_INTERPRET=1'
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference import position_term_reference  # noqa: E402
from test_position_lambda import CASES, IDS, _content_reference, _inputs  # noqa: E402
from timm_lambda.layers import position_lambda as PL  # noqa: E402
from timm_lambda.layers.position_lambda import cpu_kernel, custom_ops, tiled_triton  # noqa: E402

cpu_kernel.ENABLED = False  # the CPU kernel would serve these CPU tensors first
tiled_triton.runs = lambda q, v, table: q.dtype in tiled_triton._SERVED and tiled_triton._kernels() is not None
tiled_triton.STRICT = True  # a kernel that fails raises (no GEMM-path answer)

runs = [(int(a.rstrip('c')), a.endswith('c')) for a in sys.argv[1:]] or \
    [(i, content) for i in range(len(CASES)) for content in (False, True)]
checked = 0
for run, (index, with_content) in enumerate(runs):
    case, name = CASES[index], IDS[index]
    _, hh, ww, _, k, _, dv, scope, stride, cip, _ = case
    custom_ops.DEVICE_CHUNK_ELEMENTS = 1 if run % 2 else 1 << 26  # one image a chunk, or all in one
    start = time.time()
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
    launches = tiled_triton.LAUNCHES
    y = PL.position_lambdas(q, v, table, hh, ww, 'tiled', scope is None, stride, cip, None, content)
    assert tiled_triton.LAUNCHES > launches, 'no Triton kernel launched'
    y = y.reshape(ref.shape)
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-10)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=ref.dtype)
    for got, want in zip(torch.autograd.grad(y, leaves, g), torch.autograd.grad(ref, leaves, g)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    checked += 1
    print(f'{name} content={with_content}: equal ({time.time() - start:.1f} s)', flush=True)
print(f'{checked} runs equal the reference')
