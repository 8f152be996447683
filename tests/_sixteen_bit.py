"""The 16-bit rounding contract of the tiled operator's tensor-core kernels, shared by their interpreted run
(tests/_triton_interpreted.py) and their CUDA run (tests/test_cuda.py).

A 16-bit call computes as a 16-bit matmul would: the logits ``q R`` rounded to the 16-bit dtype, products of 16-bit
operands summed in float32, each result rounded once. So the output and the value gradient (``L^T gy``) equal the
per-query float64 reference with the logits so rounded (:func:`reference.tiled_operator_reference`) within half a
unit in their last place plus a small share of their largest entry (a float32 sum that lands on the other side of a
rounding boundary than the reference's), and are farther than that from the reference without rounding: a kernel
that kept its logits in float32 fails. The query, table and content gradients are within the 16-bit rounding of the
exact ones; the query and table gradients, from the logit gradients rounded to the 16-bit dtype as a matmul's
backward has them, equal the reference with the logit gradients so rounded more often than the one without (a kernel
that kept them in float32 before its ``dq`` or ``dR`` product fails)."""
import torch

from reference import tiled_operator_reference

# (B, heads, |k|, |u|, |v|, H, W, scope, step, content lambda)
SIXTEEN_BIT_CASES = [
    (2, 4, 16, 1, 64, 12, 13, 23, 1, False),   # a c4 layer's heads and widths, the scope past the image
    (1, 5, 16, 2, 43, 9, 17, 7, 1, True),      # 5 heads, |u| 2, |v| 43
    (2, 4, 16, 1, 128, 14, 15, 23, 2, True),   # the first c5 block's stride 2 (pooled 25x25 table)
    (1, 3, 8, 1, 16, 5, 6, 5, 2, False),       # an even image width, a small scope
]
SIXTEEN_BIT_IDS = [f'u{c[3]}_v{c[4]}_scope{c[7]}_s{c[8]}' + '_content' * c[9] for c in SIXTEEN_BIT_CASES]
NAMES = ['output', 'q', 'v', 'table', 'content']
# (the largest half unit in the last place relative to the value, the share of the largest entry allowed beyond it
# against the rounded reference (a float32 sum on the other side of a rounding boundary moves an entry by a unit in
# its last place), the bound of the other gradients)
BOUNDS = {torch.bfloat16: (2 ** -8, 1e-4, 4e-3), torch.float16: (2 ** -11, 5e-4, 5e-4)}


def operator_inputs(case, draw, dtype):
    """``[q, v, table (, content)]`` of a case in the tiled operator's layouts, drawn by ``draw(*shape)`` and rounded to
    ``dtype``."""
    b, h, c, u, dv, hh, ww, scope, step, with_content = case
    shapes = [(b, h, c, -(-hh // step), -(-ww // step)), (b, u * dv, hh, ww), (c, u, scope, scope)]
    shapes += [(b, c, dv)] if with_content else []
    return [draw(*s).to(dtype) for s in shapes]


def output_shape(case):
    b, h, _, _, dv, hh, ww, _, step, _ = case
    return b, h * dv, -(-hh // step), -(-ww // step)


def operator_call(op, case, inputs, gy, after_forward=None):
    """``op``'s output and gradients for the output gradient ``gy`` (``after_forward()`` called between the two:
    tests/_launches.py's per-direction check)."""
    leaves = [t.clone().requires_grad_() for t in inputs]
    y = op(leaves[0], leaves[1], leaves[2], case[8], *leaves[3:])
    if after_forward is not None:
        after_forward()
    return [y] + list(torch.autograd.grad(y, leaves, gy.to(y.dtype)))


def reference_call(case, inputs, gy, logits_dtype=None):
    exact = [t.double().requires_grad_() for t in inputs]
    out = tiled_operator_reference(exact[0], exact[1], exact[2], case[8], *exact[3:], logits_dtype=logits_dtype)
    return [out] + list(torch.autograd.grad(out, exact, gy.double()))


def excess(a, want, half_ulp) -> float:
    """How far ``a`` is beyond half a unit in the last place of ``want``, over ``want``'s largest entry."""
    a, want = a.double().cpu(), want.double().cpu()
    return (((a - want).abs() - half_ulp * want.abs()).max() / want.abs().max()).item()


def check_rounding(got, case, inputs, gy, dtype, references=None):
    """Assert the contract above for the results ``got`` of ``inputs`` (16-bit) and ``gy``; returns the excesses.
    ``references``: ``(reference_call(..., dtype), reference_call(...))`` where the caller has them."""
    half_ulp, near, other = BOUNDS[dtype]
    assert all(t.dtype == dtype for t in got), [t.dtype for t in got]
    rounded, exact = references or (reference_call(case, inputs, gy, dtype), reference_call(case, inputs, gy))
    seen = {}
    for i, name in enumerate(NAMES[:len(got)]):
        # the share of entries equal to the reference with rounded logits (and logit gradients), and without
        same = [(got[i].cpu() == want.to(dtype)).double().mean().item() for want in (rounded[i], exact[i])]
        if name in ('output', 'v'):
            # within rounding of the rounded-logit reference, and equal to it once rounded far more often than to the
            # reference without rounding (a float32-logit computation is the other way round)
            seen[name] = (excess(got[i], rounded[i], half_ulp), *same)
            assert seen[name][0] <= near and same[0] >= 0.95 and same[0] > same[1] + 0.1, (name, seen[name])
        else:
            seen[name] = (excess(got[i], exact[i], half_ulp), *same)
            assert seen[name][0] <= other, (name, seen[name])
            if name in ('q', 'table'):  # from the rounded logit gradients: equal to that reference more often
                assert same[0] > same[1] + 0.1, (name, seen[name])
    return seen
