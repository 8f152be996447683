"""What the tensor-core kernels of the tiled position lambdas compile to on sm_90 (H100, H200), read on a CPU.

Triton compiles for a GPU target without a GPU. For each kernel as the wrappers launch it
(``tiled_triton.tc_launch_meta``) at LambdaResNet-101's three lambda-layer shapes at 1024 px (and a small odd one),
in bfloat16, float16, float32 on TF32 and exact float32, this reports what ``ptxas -v`` (Triton's own, with
Triton's flags) says of the kernel: registers a thread, bytes spilled to local memory, and from the PTX the
tensor-core instructions (``mma``, ``wgmma``), the asynchronous copies that software pipelining issues
(``cp.async``) and the shared memory. No timing: a GPU measures speed (tools/gpu_check.py); this says whether a
kernel runs on tensor cores, fits the SM and keeps its working set in registers. tests/test_tiled_triton.py asserts
the first three.

    python benchmarks/sm90_kernels.py [--json docs/results/sm90_kernels.json]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

SHARED_LIMIT = 227 * 1024  # bytes of shared memory a block may use on sm_90
SM_SHARED = 228 * 1024  # bytes of shared memory a multiprocessor has on sm_90
# (name, heads, |k|, |v|, map side, stride): LambdaResNet-101's lambda layers at 1024 px (c4: 256 ch 64x64; c5's
# first: 512 ch 64x64 stride 2, the table pooled to 25x25; c5: 512 ch 32x32) and a small odd one
SHAPES = [('c4', 4, 16, 64, 64, 1), ('c5_s2', 4, 16, 128, 64, 2), ('c5', 4, 16, 128, 32, 1), ('odd', 5, 9, 43, 13, 1)]
# (dtype, tl.dot input precision, tensor cores expected)
VARIANTS = [('bf16', 'ieee', True), ('fp16', 'ieee', True), ('fp32', 'tf32', True), ('fp32', 'ieee', False)]
_ROW_INTS = ['H', 'W', 'Ho', 'Wo', 'HEADS', 'U', 'V', 'C', 'KH', 'KW', 'LS']
_VALUE_INTS = ['H', 'W', 'Ho', 'Wo', 'HEADS', 'U', 'V', 'KH', 'KW', 'LS']


def _specialize(fn, sig: dict, consts: dict, ints: dict) -> dict:
    """What Triton's launcher does with a launch's arguments, done here at the shape's values (``ints``): an
    integer equal to 1 becomes a constant, one divisible by 16 and every pointer (a fresh torch allocation: aligned)
    carry ``tt.divisibility = 16`` (so the compiler sees the alignment that a GPU run's does: vector loads,
    ``cp.async``). Changes ``sig`` and ``consts``; returns the attributes for ``ASTSource``."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    attrs = {}
    for name, kind in list(sig.items()):
        if kind.startswith('*'):
            attrs[(fn.arg_names.index(name),)] = [['tt.divisibility', 16]]
        elif name in ints:
            kind, spec = native_specialize_impl(BaseBackend, ints[name], False, True, True)
            if kind == 'constexpr':
                sig[name], consts[name] = 'constexpr', ints[name]
            elif spec == 'D':
                attrs[(fn.arg_names.index(name),)] = [['tt.divisibility', 16]]
    return attrs


def launches(heads: int, dim_k: int, dim_v: int, side: int, step: int, dtype: str, prec: str):
    """``(name, jit function, signature, constexprs, options, attrs)`` of each tensor-core launch at a shape (scope
    23, |u| 1), as tiled_triton's wrappers make them (``options``: ``num_warps`` and where set ``num_stages``;
    ``attrs``: the launcher's specialisation at the shape's sizes, :func:`_specialize`)."""
    from timm_lambda.layers.position_lambda import tiled_triton as T

    k = T.kernels()
    kw = 23 + 2 * (step == 2)
    c, out_side = 9 * dim_k if step == 2 else dim_k, -(-side // step)
    torch_dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp32': torch.float32}[dtype]
    meta = T.tc_launch_meta(heads, c, dim_v, side, out_side, kw, step, torch_dtype, precision=prec)
    ls = T.logit_stride(kw * kw)
    ints = dict(H=side, W=side, Ho=out_side, Wo=out_side, HEADS=heads, U=1, V=dim_v, C=c, KH=kw, KW=kw)
    out = []
    for kernel in ('rows', 'logit_grad'):
        rows = dict(meta[kernel])
        options = {o: rows.pop(o) for o in ('num_warps', 'num_stages') if o in rows}
        consts = dict(rows, STEP=step, PREC=prec, WIDEN=False)
        consts.setdefault('CONTENT', step == 1)
        consts.setdefault('ADD', kernel == 'logit_grad' and step == 1)  # (the fused dq added to the content term's)
        sig = dict({p: f'*{dtype}' for p in ('l_ptr', 'v_ptr', 'y_ptr', 'q_ptr', 'c_ptr')},
                   **{n: 'i32' for n in _ROW_INTS}, **{n: 'constexpr' for n in consts})
        # LS: the fused forward reads the table [C, u K_h K_w] as it is, the others the logits' aligned stride
        fused_forward = kernel == 'rows' and rows.get('FUSED')
        attrs = _specialize(k['tc_rows'], sig, consts, dict(ints, LS=kw * kw if fused_forward else ls))
        out.append(('tc_rows (logit grad)' if kernel == 'logit_grad' else 'tc_rows', k['tc_rows'], sig, consts,
                    options, attrs))
    vg = dict(meta['value_grad'])
    options = {o: vg.pop(o) for o in ('num_warps', 'num_stages') if o in vg}
    consts = dict(STEP=step, PREC=prec, WIDEN=False, **vg)
    sig = dict({p: f'*{dtype}' for p in ('l_ptr', 'gy_ptr', 'gv_ptr')}, **{n: 'i32' for n in _VALUE_INTS},
               **{n: 'constexpr' for n in consts})
    attrs = _specialize(k['tc_value_grad'], sig, consts, dict(ints, LS=ls))
    out.append(('tc_value_grad', k['tc_value_grad'], sig, consts, options, attrs))
    return out


def compile_sm90(fn, sig: dict, consts: dict, options: dict, attrs: dict = None) -> dict:
    """Compile for sm_90 and read the result: registers, spill bytes (``ptxas -v``), shared memory, instruction
    counts in the PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget('cuda', 90, 32),
                              options=options)
    ptx = compiled.asm['ptx']
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, 'k.ptx')
        with open(src, 'w') as f:
            f.write(ptx)
        log = subprocess.run([get_ptxas(90).path, '-v', '--regAllocOptLevel=2', '--gpu-name=sm_90a', src, '-o',
                              os.path.join(tmp, 'k.cubin')], capture_output=True, text=True, check=True).stderr

    def number(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else None

    registers = number(r'Used (\d+) registers')
    warps = compiled.metadata.num_warps
    return dict(options, num_stages=compiled.metadata.num_stages, registers=registers,
                spill_stores=number(r'(\d+) bytes spill stores'), spill_loads=number(r'(\d+) bytes spill loads'),
                shared=compiled.metadata.shared, mma=len(re.findall(r'\bmma\.sync\.', ptx)),
                wgmma=len(re.findall(r'\bwgmma\.mma_async\.', ptx)),
                cp_async=len(re.findall(r'\bcp\.async\.c[ag]\b', ptx)),
                tma=len(re.findall(r'\bcp\.async\.bulk\.tensor\b', ptx)),
                programs_per_sm=programs_per_sm(registers, warps, compiled.metadata.shared))


def programs_per_sm(registers: int, warps: int, shared: int) -> int:
    """Programs (thread blocks) of a kernel resident on one sm_90 multiprocessor at once: the least of what its
    registers (65536 a multiprocessor, allocated 8 a thread at a time), its warps (64), its shared memory (228 KiB,
    1 KiB of it reserved a block) and the block limit (32) allow."""
    by_registers = 65536 // (-(-registers // 8) * 8 * 32 * warps)
    by_shared = SM_SHARED // (shared + 1024) if shared else 32
    return min(by_registers, 64 // warps, by_shared, 32)


def report(shapes=SHAPES, variants=VARIANTS):
    rows = []
    for name, *shape in shapes:
        for dtype, prec, tensor_cores in variants:
            if not tensor_cores and name != 'c4':  # the exact float32 variant: once
                continue
            for kernel, fn, sig, consts, options, attrs in launches(*shape, dtype, prec):
                rows.append(dict(shape=name, dtype=dtype, precision=prec, kernel=kernel, tensor_cores=tensor_cores,
                                 constexprs={k: v for k, v in consts.items() if k.startswith('BLOCK')},
                                 **compile_sm90(fn, sig, consts, options, attrs)))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--json', help='write the rows, with command, date, commit and Triton version, here')
    args = p.parse_args(argv)
    import triton

    from harness.measure import commit
    rows = report()
    print(f"{'shape':6} {'dtype':5} {'prec':5} {'kernel':22} {'warps':>5} {'stages':>6} {'regs':>4} {'spill':>5} "
          f"{'shared':>7} {'progs/SM':>8} {'mma':>4} {'wgmma':>5} {'cp.async':>8}")
    for r in rows:
        print(f"{r['shape']:6} {r['dtype']:5} {r['precision']:5} {r['kernel']:22} {r['num_warps']:>5} "
              f"{r['num_stages']:>6} {r['registers']:>4} {r['spill_stores']:>5} {r['shared']:>7} "
              f"{r['programs_per_sm']:>8} {r['mma']:>4} {r['wgmma']:>5} {r['cp_async']:>8}")
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(command='python ' + ' '.join(['benchmarks/sm90_kernels.py'] + (argv or sys.argv[1:])),
                           date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), commit=commit(),
                           triton=triton.__version__, target='cuda sm_90 (sm_90a ptxas)', rows=rows), f, indent=1)


if __name__ == '__main__':
    main()
