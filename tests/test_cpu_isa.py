"""The CPU kernel per instruction set (issue 52; timm_lambda/layers/position_lambda/tiled_cpu.h, cpu_kernel.py): the
kernel's vectors follow the compiler's target (64 bytes with AVX-512, 32 with AVX2, 16 elsewhere), a build for
another target (``TIMM_LAMBDA_CPU_ARCH``) is a separate module that says which ISA macros it was compiled with, and
``'auto'`` passes over the kernel where its instruction set makes it the slow choice (``cpu_kernel.declines``).

The AVX2 build is checked on any x86-64 CPU that runs it (an AVX-512 one too: the build then must not be an AVX-512
build in disguise) against the float64 per-query reference, float32 and bfloat16 (through float32), forward and
backward, stride 1 and 2. Its build takes about 40 s of one core, once per source (torch's extension cache)."""
import itertools
import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from timm_lambda.layers.position_lambda import cpu_kernel

REPO = Path(__file__).resolve().parents[1]

# in a process whose kernel is the x86-64-v3 build (built there if missing): the build's ISA, then per case and
# dtype the largest error of the output and each gradient against the float64 reference, over that tensor's largest
# entry, and whether the bfloat16 results equal the float32 kernel's on the same inputs rounded to bfloat16
CHECK = textwrap.dedent('''
    import json, sys
    import torch
    sys.path.insert(0, 'tests')
    from reference import tiled_operator_reference
    from timm_lambda.layers.position_lambda import cpu_kernel
    class Op(torch.autograd.Function):  # the kernel's forward and backward (cpu_kernel.forward, .backward)
        @staticmethod
        def forward(ctx, q, v, table, content, step):
            ctx.step = step
            ctx.save_for_backward(q, v, table, content)
            return cpu_kernel.forward(q, v, table, step, content)
        @staticmethod
        def backward(ctx, gy):
            q, v, table, content = ctx.saved_tensors
            gq, gv, gt, gc = cpu_kernel.backward(gy, q, v, table, ctx.step, content)
            return gq, gv, gt, None if content is None else gc, None
    def op(q, v, table, step, content=None):
        return Op.apply(q, v, table, content, step)
    kernel = cpu_kernel.build()
    out = dict(arch=cpu_kernel.arch(), isa=cpu_kernel.isa(), macros=sorted(kernel.isa_macros()),
               vector_bytes=kernel.vector_bytes, bf16=kernel.bf16, file=kernel.__file__,
               declines={f'{d} s{s}': cpu_kernel.declines(getattr(torch, d), s)
                         for d in ('float32', 'bfloat16', 'float16') for s in (1, 2)}, cases=[])
    torch.set_num_threads(2)
    # (B, heads, |k|, |u|, |v|, H, W, scope, step, content): |v| 43 = 5 vectors of 8 and 3 channels past them
    for case in [(2, 5, 16, 1, 43, 11, 13, 23, 1, True), (1, 4, 16, 2, 24, 14, 15, 7, 2, False),
                 (1, 3, 8, 1, 64, 9, 10, 23, 2, True)]:
        b, h, c, u, dv, hh, ww, scope, step, with_content = case
        g = torch.Generator().manual_seed(0)
        draw = lambda *shape: torch.randn(shape, generator=g, dtype=torch.float64)
        inputs = [draw(b, h, c, -(-hh // step), -(-ww // step)), draw(b, u * dv, hh, ww), draw(c, u, scope, scope)]
        inputs += [draw(b, c, dv)] if with_content else []
        gy = draw(b, h * dv, -(-hh // step), -(-ww // step))
        got = {}
        for dtype in (torch.float32, torch.bfloat16):
            leaves = [t.to(dtype).requires_grad_() for t in inputs]
            y = op(leaves[0], leaves[1], leaves[2], step, *leaves[3:])
            got[dtype] = [y] + list(torch.autograd.grad(y, leaves, gy.to(dtype)))
        errors = {}
        for dtype in (torch.float32, torch.bfloat16):
            exact = [t.to(dtype).double().requires_grad_() for t in inputs]  # the reference of the rounded inputs
            ref = tiled_operator_reference(exact[0], exact[1], exact[2], step, *exact[3:])
            want = [ref] + list(torch.autograd.grad(ref, exact, gy.to(dtype).double()))
            errors[str(dtype)] = [((a.double() - w).abs().max() / w.abs().max()).item()
                                  for a, w in zip(got[dtype], want)]
        rounded = [t.to(torch.bfloat16).float().requires_grad_() for t in inputs]
        y = op(rounded[0], rounded[1], rounded[2], step, *rounded[3:])
        full = [y] + list(torch.autograd.grad(y, rounded, gy.to(torch.bfloat16).float()))
        same = all(torch.equal(a, w.bfloat16()) for a, w in zip(got[torch.bfloat16], full))
        out['cases'].append(dict(case=case, errors=errors, bf16_is_float32_rounded=same,
                                 dtypes=[str(t.dtype) for t in got[torch.bfloat16]]))
    print(json.dumps(out))
''')


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ('x86_64', 'AMD64'), reason='builds an x86-64-v3 (AVX2 + FMA) target')
def test_the_avx2_build_is_avx2_and_equals_the_float64_reference():
    """``TIMM_LAMBDA_CPU_ARCH=x86-64-v3``: a separate build (its own module name) compiled with ``__AVX2__`` and
    ``__FMA__`` and without ``__AVX512F__`` (32-byte vectors, no bfloat16 kernels), whatever this CPU has. Where the
    CPU runs AVX2 it computes float32 within 1e-5 of the float64 reference's largest entry (output and the gradients
    of q, v, the table and the content lambda; |v| 43 leaves 3 channels past the vectors, the 23x23 scope passes the
    image), at strides 1 and 2; bfloat16 runs in float32 (the float32 kernel's results on the rounded inputs, rounded
    once). ``declines`` takes it for every float32 and bfloat16 stride-1 call, and for bfloat16 stride-2 calls where
    the gemm backend's GEMMs have no AVX-512 BF16 (an AVX2 CPU)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), **{cpu_kernel.ARCH_ENV: 'x86-64-v3'})
    env.pop('TIMM_LAMBDA_BACKEND', None)
    done = subprocess.run([sys.executable, '-c', CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out['arch'] == 'x86-64-v3'
    assert os.path.basename(out['file']).split('.')[0] != cpu_kernel._name('native')
    assert '__AVX2__' in out['macros'] and '__FMA__' in out['macros'], out['macros']
    assert '__AVX512F__' not in out['macros'] and '__AVX512BF16__' not in out['macros'], out['macros']
    assert (out['isa'], out['vector_bytes'], out['bf16']) == ('avx2', 32, False)
    assert out['declines']['float32 s1'] is None and out['declines']['float32 s2'] is None
    assert out['declines']['bfloat16 s1'] is None
    if cpu_kernel._bf16_gemms():  # this CPU's GEMMs have AVX-512 BF16, the AVX2 build's bfloat16 runs in float32
        assert out['declines']['bfloat16 s2'].startswith('auto: ') and 'AVX2' in out['declines']['bfloat16 s2']
    else:
        assert out['declines']['bfloat16 s2'] is None
    for row in out['cases']:
        assert max(row['errors']['torch.float32']) <= 1e-5, row
        assert max(row['errors']['torch.bfloat16']) <= 2e-2, row  # bfloat16 outputs: within their rounding
        assert row['bf16_is_float32_rounded'] and set(row['dtypes']) == {'torch.bfloat16'}, row
    assert {row['case'][8] for row in out['cases']} == {1, 2}


def test_isa_reads_the_build_macros_and_declines_names_it(monkeypatch):
    """``isa()`` from the loaded build's compiler macros (the CPU's flags where none is loaded); ``declines`` keeps
    the kernel on AVX2 and AVX-512, passes it over where it has neither (SSE, NEON: the gemm backend's GEMMs are
    faster), and for 16-bit stride-2 calls it runs in float32 where the GEMMs have AVX-512 BF16, each reason starting
    'auto: ' and naming the ISA."""
    def build(*macros, bf16=False):
        return type('Kernel', (), dict(isa_macros=staticmethod(lambda: list(macros)), bf16=bf16))
    monkeypatch.setattr(cpu_kernel, '_looked_up', True)
    bf16_gemms_of = cpu_kernel._bf16_gemms
    cases = [(build('__AVX512BF16__', '__AVX512F__', '__AVX2__', '__FMA__', bf16=True), 'avx512_bf16'),
             (build('__AVX512F__', '__AVX2__', '__FMA__'), 'avx512'), (build('__AVX2__', '__FMA__'), 'avx2'),
             (build('__AVX2__'), 'none'), (build(), 'none'), (build('__ARM_NEON'), 'neon')]
    for (kernel, isa), bf16_gemms in itertools.product(cases, (True, False)):
        monkeypatch.setattr(cpu_kernel, '_kernel', kernel)
        monkeypatch.setattr(cpu_kernel, '_bf16_gemms', lambda: bf16_gemms)
        assert cpu_kernel.isa() == isa
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            for step in (1, 2):
                reason = cpu_kernel.declines(dtype, step)
                slow_16_bit = bf16_gemms and step == 2 and dtype in (torch.float16, torch.bfloat16) and not (
                    isa == 'avx512_bf16' and dtype == torch.bfloat16)
                if isa in ('avx512_bf16', 'avx512', 'avx2') and not slow_16_bit:
                    assert reason is None, (isa, dtype, step)
                else:
                    assert reason.startswith('auto: the CPU kernel was built for ' + cpu_kernel.ISA_NAMES[isa]), reason
    monkeypatch.setattr(cpu_kernel, '_kernel', None)
    monkeypatch.setattr(cpu_kernel, '_cpu_flags', lambda: 'flags\t\t: fpu sse2 avx avx2 fma')
    assert cpu_kernel.isa() == 'avx2'
    monkeypatch.setattr(cpu_kernel, '_cpu_flags', lambda: 'flags\t\t: fpu sse2 avx512f avx2 fma avx512_bf16')
    assert cpu_kernel.isa() == 'avx512_bf16'
    monkeypatch.setattr(cpu_kernel, '_cpu_flags', lambda: 'flags\t\t: fpu avx512f avx2 fma avx512_bf16')
    monkeypatch.delenv('DNNL_MAX_CPU_ISA', raising=False)
    for cap, fast in ((None, True), ('AVX512_CORE_BF16', True), ('AVX2', False)):
        if cap is None:
            monkeypatch.delenv('ONEDNN_MAX_CPU_ISA', raising=False)
        else:
            monkeypatch.setenv('ONEDNN_MAX_CPU_ISA', cap)
        assert bf16_gemms_of() is fast, cap


def test_the_target_is_in_the_build_name_and_flags(monkeypatch):
    """``TIMM_LAMBDA_CPU_ARCH`` goes into ``-march=`` and the build's CPU tag: another target is another build,
    which neither supersedes nor prunes this CPU's native build; anything but a -march value is refused."""
    monkeypatch.delenv(cpu_kernel.ARCH_ENV, raising=False)
    native = cpu_kernel._name()
    assert cpu_kernel.arch() == 'native' and '-march=native' in cpu_kernel._cflags()
    monkeypatch.setenv(cpu_kernel.ARCH_ENV, 'x86-64-v3')
    assert '-march=x86-64-v3' in cpu_kernel._cflags() and '-march=native' not in cpu_kernel._cflags()
    other = cpu_kernel._name()
    assert other != native and other.split('_')[-2:] == native.split('_')[-2:]  # the CPU tag differs
    monkeypatch.setenv(cpu_kernel.ARCH_ENV, 'native -mno-avx; rm')
    with pytest.raises(ValueError, match='TIMM_LAMBDA_CPU_ARCH'):
        cpu_kernel.arch()
