"""The position-lambda test cases shared by the CPU tests (tests/test_position_lambda.py, tests/test_backends.py),
the interpreted Triton runs (tests/_triton_interpreted.py) and the GPU tests (tests/test_cuda.py): shapes with many
query blocks and chunks, stride 1 and 2, local and global scopes, |u| > 1, odd head counts and widths."""
import torch

from timm_lambda.layers import position_lambda as PL

FORMS = ['dense', 'tiled']

# (B, H, W, heads, |k|, |u|, |v|, scope (None: global), stride, count_include_pad, chunk rows)
CASES = [
    (2, 19, 21, 2, 3, 1, 4, 5, 1, False, 64),       # 9 blocks per image, one block per chunk
    (2, 26, 17, 2, 3, 2, 3, 7, 1, False, 300),      # chunks of whole block rows
    (2, 19, 21, 2, 3, 2, 4, 7, 2, False, 20),       # pooled: parts of a block row per chunk
    (3, 17, 9, 2, 4, 1, 3, 3, 2, True, 40),
    (1, 30, 33, 2, 4, 1, 2, 23, 1, False, 512),     # the default 23x23 scope
    (2, 6, 7, 2, 3, 1, 4, None, 1, False, 64),      # global scope
    (2, 7, 5, 2, 3, 2, 4, None, 2, False, 16),
    (1, 20, 19, 5, 9, 1, 43, 7, 1, False, 512),     # the CPU kernel's vector paths: 4 + 1 heads, |v| 32 + 8 + 3
    (2, 13, 14, 4, 3, 2, 24, 5, 2, False, 512),
    (1, 11, 13, 2, 3, 2, 4, 5, 2, False, 64),       # pooled, a scope smaller than the map: small for the interpreter
    (1, 10, 9, 5, 9, 1, 43, 7, 1, False, 512),      # 5 heads and |v| 43 on a small map (the interpreter)
]
IDS = [f'B{c[0]}_{c[1]}x{c[2]}_u{c[5]}_{"global" if c[7] is None else "scope%d" % c[7]}_s{c[8]}' for c in CASES]


def inputs(case, dtype=torch.float64, seed=0):
    b, hh, ww, h, k, u, dv, scope = case[:8]
    g = torch.Generator().manual_seed(seed)
    side = (2 * hh - 1, 2 * ww - 1) if scope is None else (scope, scope)
    q = torch.randn(b, h, k, hh * ww, generator=g, dtype=dtype)
    v = torch.randn(b, u, dv, hh * ww, generator=g, dtype=dtype)
    table = torch.randn(k, u, *side, generator=g, dtype=dtype)
    return q, v, table


def call(form, case, q, v, table):
    _, hh, ww, _, _, _, _, scope, stride, cip, _ = case
    y = PL.position_lambdas(q, v, table, hh, ww, form, scope is None, stride, cip)  # [B, h V, H_out, W_out]
    return y.reshape(q.shape[0], q.shape[1], v.shape[2], -1)


def content_reference(content, q, case):
    """``(lambda^c)^T q_n`` at every input position, pooled as the position term is (pooling is linear: the
    implementation pools the queries instead)."""
    b, hh, ww, h, _, _, dv, _, stride, cip, _ = case
    y = torch.einsum('bkv,bhkn->bhvn', content, q)
    if stride == 2:
        y = torch.nn.functional.avg_pool2d(y.reshape(b, h * dv, hh, ww), 3, 2, 1, count_include_pad=cip)
    return y.reshape(b, h, dv, -1)
