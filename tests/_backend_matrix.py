"""The backend table's matrix (backend x form x dtype on one device), checked through the public override: the CPU
case in tests/test_backends.py, the CUDA case in tests/test_cuda.py.

Each row of timm_lambda/layers/position_lambda/backends.py either serves the call, and then the output and the
gradients of q, v and the table equal the float64 per-query reference (tests/reference.py) of the same rounded inputs
within the dtype's bound, in the dtype itself, and the table counted the call for that backend; or it refuses it, and
then the chosen backend raises with the table's reason."""
import re

import pytest
import torch

import _cases as C
from reference import position_term_reference
from timm_lambda.layers import position_lambda as PL
from timm_lambda.layers.position_lambda import backends

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ['f64', 'f32', 'bf16', 'f16']
# relative (norm) error bounds against the float64 reference: float64 exact to rounding, float32 (exact float32
# products: TF32 stays off, as torch's default) well below any 16-bit or TF32 result, the 16-bit ones a few units of
# their rounding (2^-8 for bfloat16, 2^-11 for float16) summed over the depth
BOUND = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
ROWS = [(name, form) for name in PL.BACKENDS for form in ('einsum', 'conv', 'dense', 'tiled')
        if form in backends.get(name).forms]
ROW_IDS = ['-'.join(r) for r in ROWS]
MATRIX_CASES = [C.CASES[2], C.CASES[7]]  # stride 2 with |u| 2; 5 heads and |v| 43 at stride 1
MATRIX_IDS = [C.IDS[2], C.IDS[7]]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def check_row(backend_fixture, name: str, form: str, device: str, dtype: torch.dtype, case) -> None:
    """Run ``case`` by backend ``name`` (chosen through ``backend_fixture``, the conftest fixture) on ``device`` in
    ``dtype``: the table's refusal, or the reference's values within :data:`BOUND` (see the module docstring)."""
    step = case[8]
    b, hh, ww = case[:3]
    queries = b * -(-hh // step) * -(-ww // step)
    call = backends.Call(form, device, dtype, step, queries, case[7] is not None and max(hh, ww) <= case[7])
    reason = backends.why_not(name, call, auto=False)
    backend_fixture(name)
    leaves = [t.to(dtype) for t in C.inputs(case)]
    low = [t.to(device).requires_grad_() for t in leaves]
    if reason is not None:
        with pytest.raises(RuntimeError, match=re.escape(reason)):
            C.call(form, case, *low)
        return
    exact = [t.double().requires_grad_() for t in leaves]  # the reference sees the rounded inputs
    ref = position_term_reference(*exact, case[1], case[2], step, case[9])
    PL.served_backends(reset=True)
    y = C.call(form, case, *low)
    served = PL.served_backends()
    assert (form, name, device, str(dtype).replace('torch.', ''), 'forward') in served, served
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = [y] + list(torch.autograd.grad(y, low, g.to(device, dtype)))
    if backends.get(name).operator:  # its backward computed the gradients too (plain ops: autograd's, uncounted)
        assert (form, name, device, str(dtype).replace('torch.', ''), 'backward') in PL.served_backends()
    want = [ref] + list(torch.autograd.grad(ref, exact, g))
    for what, a, w in zip(['output', 'q', 'v', 'table'], got, want):
        assert a.dtype == dtype and a.device.type == device, f'{what}: {a.dtype} on {a.device}'
        err = _relative(a.cpu(), w)
        assert err < BOUND[dtype], f'{what}: relative error {err:.2e} in {dtype} (bound {BOUND[dtype]:.0e})'
