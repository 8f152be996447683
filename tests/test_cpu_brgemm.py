"""The CPU kernel's bfloat16 path by oneDNN's BRGEMM (issue 62; timm_lambda/layers/position_lambda/tiled_cpu_brgemm.cpp,
``cpu_kernel.compute_path``): which micro-kernel runs it (AMX tiles where the CPU has AMX-BF16, else oneDNN's AVX-512
BF16 micro-kernel: the same code), its blocks of every geometry against the float64 per-query reference with the
bfloat16 rounding of a matmul (tests/_sixteen_bit.py), its input checks, and the rule that picks a bfloat16 call's
path per CPU. tests/test_position_lambda.py runs the BF16_CASES by this path and by the VDPBF16PS loops."""
import os

import pytest
import torch

import _sixteen_bit as SB
from timm_lambda.layers.position_lambda import cpu_kernel


def _flags() -> set:
    if not os.path.exists('/proc/cpuinfo'):
        return set()
    with open('/proc/cpuinfo') as f:
        return set(next((line for line in f if line.startswith('flags')), ':').split(':', 1)[1].split())


def _kernel():
    """The loaded kernel with its BRGEMM path, or a skip naming why this CPU has none (the rest of the suite tests
    what runs instead: float32, tests/test_position_lambda.py)."""
    kernel = cpu_kernel.load() or cpu_kernel.build()
    if not kernel.bf16:
        assert 'avx512_bf16' not in _flags(), 'the CPU has AVX-512 BF16 but the kernel was built without it'
        pytest.skip('no AVX-512 BF16 in this build (an AVX2 or AVX-512F CPU): bfloat16 runs in float32 here')
    if not cpu_kernel.brgemm_isa():
        pytest.skip("oneDNN's BRGEMM cannot run bfloat16 here (ONEDNN_MAX_CPU_ISA below AVX-512 BF16, or mkldnn off)")
    return kernel


class _Brgemm(torch.autograd.Function):
    """``tiled_forward_brgemm`` / ``tiled_backward_brgemm`` with the blocks ``block`` ([queries along a row, rows])."""
    @staticmethod
    def forward(ctx, q, v, table, content, step, block):
        ctx.step, ctx.block = step, block
        ctx.save_for_backward(q, v, table, content)
        return _kernel().tiled_forward_brgemm(q, v, table, content, step, block)

    @staticmethod
    def backward(ctx, gy):
        q, v, table, content = ctx.saved_tensors
        gq, gv, gt, gc = _kernel().tiled_backward_brgemm(gy.contiguous(), q, v, table, content, ctx.step, ctx.block)
        return gq, gv, gt, None if content is None else gc, None, None


# (B, heads, |k|, |u|, |v|, H, W, scope, step, content lambda), blocks ([] the default; [queries, rows])
GEOMETRY_CASES = [
    ((1, 3, 8, 2, 10, 9, 11, 7, 1, True), [2, 1]),   # 3 heads, |u| 2, |v| 10, many blocks of 2 queries x 1 row
    ((1, 3, 8, 2, 10, 9, 11, 7, 1, True), [16, 1]),  # one strip: the backward splits its rows into several units
    ((1, 2, 72, 1, 12, 10, 9, 9, 2, True), [6, 3]),  # a patched stride-2 call's 9 |k| channels, partial blocks
    ((2, 1, 6, 1, 7, 5, 4, 3, 2, False), []),        # |v| 7 (odd), one head, a map smaller than a block
]


@pytest.mark.parametrize('case,block', GEOMETRY_CASES, ids=[f'{c[8]}_{b}' for c, b in GEOMETRY_CASES])
def test_brgemm_blocks_of_any_geometry_round_as_a_bfloat16_matmul(case, block):
    """Blocks of any size, partial at the map's edges, odd |v|, |u| 2, stride 2 with 72 channels: the output and the
    gradients of q, v, the table and the content lambda by the BRGEMM path meet the bfloat16 contract of
    tests/_sixteen_bit.py against the float64 per-query reference (which a float32 computation fails), and on
    inputs in {-1, 0, 1} equal the reference rounded once to bfloat16, bit for bit."""
    _kernel()
    g = torch.Generator().manual_seed(0)
    inputs = SB.operator_inputs(case, lambda *s: torch.randn(s, generator=g), torch.bfloat16)
    gy = torch.randn(SB.output_shape(case), generator=g).bfloat16()

    def op(q, v, t, step, *content):
        return _Brgemm.apply(q, v, t, content[0] if content else None, step, block)

    got = SB.operator_call(op, case, inputs, gy)
    assert all(t.dtype == torch.bfloat16 for t in got)
    SB.check_rounding(got, case, inputs, gy, torch.bfloat16)
    inputs = SB.operator_inputs(case, lambda *s: torch.randint(-1, 2, s, generator=g).float(), torch.bfloat16)
    gy = torch.randint(-1, 2, SB.output_shape(case), generator=g).bfloat16()
    for name, a, want in zip(SB.NAMES, SB.operator_call(op, case, inputs, gy), SB.reference_call(case, inputs, gy)):
        assert torch.equal(a, want.bfloat16()), name


def test_brgemm_runs_on_amx_where_the_cpu_has_it():
    """``brgemm_isa`` names the micro-kernel from a checked product: on a CPU with AMX-BF16 (oneDNN not capped below
    it) ``'amx'``, and the process then holds the AMX tile-data permission that oneDNN requests before its first AMX
    kernel (Linux's ARCH_GET_XCOMP_PERM); elsewhere ``'avx512'`` (oneDNN's AVX-512 BF16 micro-kernel runs the same
    code). With mkldnn disabled BRGEMM cannot run and no bfloat16 call takes that path."""
    kernel = _kernel()
    isa = cpu_kernel.brgemm_isa()
    capped = (os.environ.get('ONEDNN_MAX_CPU_ISA') or os.environ.get('DNNL_MAX_CPU_ISA') or 'ALL').upper()
    if 'amx_bf16' in _flags() and (capped == 'ALL' or 'AMX' in capped):
        assert isa == 'amx'
    else:
        assert isa == 'avx512', isa
    q, v, table = (torch.randn(s).bfloat16() for s in ((1, 2, 4, 6, 6), (1, 8, 6, 6), (4, 1, 5, 5)))
    kernel.tiled_forward_brgemm(q, v, table, None, 1)
    if isa == 'amx' and os.path.exists('/proc/cpuinfo'):
        assert kernel.amx_tile_data_permitted()
    assert cpu_kernel.compute_path(torch.bfloat16)[0] == ('brgemm' if isa == 'amx' else
                                                          cpu_kernel.compute_path(torch.bfloat16)[0])
    with torch.backends.mkldnn.flags(enabled=False):
        assert kernel.brgemm_bf16_isa() == '' and cpu_kernel.brgemm_isa() == ''
        assert cpu_kernel.compute_path(torch.bfloat16)[0] != 'brgemm'


def test_brgemm_checks_its_inputs():
    """Each entry point refuses (a TypeError or ValueError naming the argument, no crash) what it cannot compute:
    other dtypes, shapes that do not match, a step other than 1 or 2, a content lambda of the wrong shape, a block it
    does not know (the same check as every entry point's, tiled_cpu.h's check_arguments)."""
    kernel = _kernel()
    q, v, table = (torch.randn(s).bfloat16() for s in ((1, 2, 4, 6, 6), (1, 8, 6, 6), (4, 1, 5, 5)))
    gy = torch.randn(1, 16, 6, 6).bfloat16()
    bad = [((q.float(), v, table, None, 1), TypeError, 'q must be BFloat16'),
           ((q, v, table[:3], None, 1), ValueError, 'table must be'),
           ((q, v[:, :7], table.expand(4, 2, 5, 5), None, 1), ValueError, 'v must be'),
           ((q, v, table, None, 3), ValueError, 'step must be 1 or 2'),
           ((q[..., :5], v, table, None, 1), ValueError, "q's map must be v's"),
           ((q, v, table, torch.randn(1, 4, 5).bfloat16(), 1), ValueError, 'content must be')]
    for args, error, match in bad:
        with pytest.raises(error, match=match):
            kernel.tiled_forward_brgemm(*args)
        with pytest.raises(error, match=match):
            kernel.tiled_backward_brgemm(gy, *args)
    with pytest.raises(ValueError, match='block'):
        kernel.tiled_forward_brgemm(q, v, table, None, 1, [1, 2, 3])
    with pytest.raises(ValueError, match='gy must be'):
        kernel.tiled_backward_brgemm(gy[:, :8], q, v, table, None, 1)


def test_the_bfloat16_path_per_cpu(monkeypatch):
    """``compute_path``: float32 and float64 in themselves, float16 in float32; bfloat16 on AMX by BRGEMM, on AMD's
    AVX-512 BF16 by the VDPBF16PS loops, on Intel's AVX-512 BF16 without AMX in float32 (measured faster there), in
    float32 without a bfloat16 build; ``TIMM_LAMBDA_CPU_BF16`` forces a path this build can run, and nothing else."""
    monkeypatch.delenv(cpu_kernel.PATH_ENV, raising=False)
    for dtype, path in ((torch.float32, 'float32'), (torch.float64, 'float64'), (torch.float16, 'float32')):
        assert cpu_kernel.compute_path(dtype)[0] == path
    cases = [(True, 'amx', 'GenuineIntel', 'brgemm'), (True, 'amx', 'AuthenticAMD', 'brgemm'),
             (True, 'avx512', 'AuthenticAMD', 'avx512_bf16'), (True, 'avx512', 'GenuineIntel', 'float32'),
             (True, '', 'GenuineIntel', 'float32'), (False, '', 'AuthenticAMD', 'float32'),
             (False, '', '', 'float32')]
    for bf16, isa, vendor, path in cases:
        monkeypatch.setattr(cpu_kernel, 'native', lambda dtype, bf16=bf16: bf16 and dtype == torch.bfloat16)
        monkeypatch.setattr(cpu_kernel, 'brgemm_isa', lambda isa=isa: isa)
        monkeypatch.setattr(cpu_kernel, '_vendor', lambda vendor=vendor: vendor)
        got, why = cpu_kernel.compute_path(torch.bfloat16, 2)
        assert got == path and why, (bf16, isa, vendor, got)
        assert cpu_kernel.compute_dtype(torch.bfloat16, 2) == (torch.float32 if path == 'float32' else torch.bfloat16)
        for forced in cpu_kernel.BF16_PATHS:
            monkeypatch.setenv(cpu_kernel.PATH_ENV, forced)
            if not bf16:
                assert cpu_kernel.compute_path(torch.bfloat16)[0] == 'float32'
            elif forced == 'brgemm' and not isa:
                with pytest.raises(ValueError, match='BRGEMM'):
                    cpu_kernel.compute_path(torch.bfloat16)
            else:
                assert cpu_kernel.compute_path(torch.bfloat16) == (forced, f'bfloat16 by the {forced} path '
                                                                   f'({isa or "no BRGEMM"}), forced by '
                                                                   f'{cpu_kernel.PATH_ENV}')
        monkeypatch.setenv(cpu_kernel.PATH_ENV, 'amx_please')
        if bf16:
            with pytest.raises(ValueError, match=cpu_kernel.PATH_ENV):
                cpu_kernel.compute_path(torch.bfloat16)
        monkeypatch.delenv(cpu_kernel.PATH_ENV)
