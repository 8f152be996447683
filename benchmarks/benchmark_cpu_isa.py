#!/usr/bin/env python
"""The CPU kernel per instruction set (issue 52): one lambda layer's step at the 1024 px LambdaResNet-101 shapes
(benchmarks/benchmark_lambda_layer.py's), batch 1, against the 3x3 convolution it replaces, with the kernel built for
this CPU (``-march=native``: AVX-512 here) and for another target (default ``x86-64-v3``: AVX2 + FMA, no AVX-512) loaded
side by side in one process, the gemm backend, and ``'auto'`` served by each build (what ``cpu_kernel.declines``
makes it choose on that class of CPU). Training step (forward + sum + backward, the input needing grad) and eval
(``torch.no_grad``), float32 and bfloat16 autocast; interleaved repeats (benchmarks/harness/measure.py), medians,
the ratios to the convolution; each figure names the instruction set it ran (``isa``: the build's compiler macros,
``cpu_kernel.isa()``) and the backends that served it.

    TIMM_LAMBDA_CPU_ARCH=x86-64-v3 python -m timm_lambda.build_cpu_kernel   # once: the AVX2 build (--build does it)
    python benchmarks/benchmark_cpu_isa.py --build --repeats 5 --json docs/results/cpu_isa.json

Each step is timed by the wall clock (``ms``) and by the CPU time of the process, all threads (``cpu_ms``): on a
machine shared with other work the wall clock of a 2-thread step waits for a descheduled thread at each barrier
(the gemm backend's many small GEMMs most), while its CPU time counts the work done; ``--passive``
(``OMP_WAIT_POLICY=PASSIVE``) keeps idle OpenMP threads from spinning, so that CPU time is work alone.

bfloat16 rows also time each bfloat16 path of the native build that this CPU can run (``cpu_kernel.compute_path``,
forced by ``TIMM_LAMBDA_CPU_BF16``; ``--bf16-paths``): ``brgemm`` (oneDNN's BRGEMM: AMX tiles where the CPU has them),
``avx512_bf16`` (the kernel's own VDPBF16PS loops, the bfloat16 path before AMX) and ``float32`` (converted, rounded
back), as ``cpu_kernel[native,<path>]``; ``cpu_kernel[native]`` is the path ``compute_path`` chooses.

    python benchmarks/benchmark_cpu_isa.py --targets native --no-gemm --repeats 7 --json docs/results/cpu_amx.json

``--cap-libraries``: the convolution and the gemm backend's GEMMs also limited to AVX2 (oneDNN's and MKL's
``ONEDNN_MAX_CPU_ISA=AVX2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``, ``ATEN_CPU_CAPABILITY=avx2``, set before torch loads),
so that every figure of the AVX2 columns is what an AVX2 CPU runs (on a Zen 4, whose AVX-512 units are 256 bits
wide, at that CPU's clock).
"""
import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time

CAPS = dict(ONEDNN_MAX_CPU_ISA='AVX2', DNNL_MAX_CPU_ISA='AVX2', MKL_ENABLE_INSTRUCTIONS='AVX2',
            ATEN_CPU_CAPABILITY='avx2', MKL_DEBUG_CPU_TYPE='5')


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--targets', nargs='+', default=['native', 'x86-64-v3'], help='-march= targets of the builds')
    p.add_argument('--modes', nargs='+', default=['train', 'eval'], choices=['train', 'eval'])
    p.add_argument('--dtypes', nargs='+', default=['float32', 'bfloat16'], choices=['float32', 'bfloat16'])
    p.add_argument('--image-size', type=int, default=1024)
    p.add_argument('--shapes', nargs='+', type=int, choices=[0, 1, 2], default=[0, 1, 2],
                   help='which of the three shapes (0: c4, 1: the stride-2 first c5 block, 2: c5)')
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--no-auto', action='store_true', help="leave out the 'auto' candidates")
    p.add_argument('--no-gemm', action='store_true', help='leave out the gemm backend')
    p.add_argument('--bf16-paths', nargs='*', default=None,
                   help='bfloat16 paths of the native build to time (default: all this CPU runs)')
    p.add_argument('--build', action='store_true', help='build the targets that are not built (about 40 s each)')
    p.add_argument('--cap-libraries', action='store_true', help='oneDNN and MKL limited to AVX2 (see above)')
    p.add_argument('--passive', action='store_true', help='OMP_WAIT_POLICY=PASSIVE (see above)')
    p.add_argument('--dtypes-together', action='store_true',
                   help="time a shape's steps of every dtype in one interleaved block (the layer's bfloat16 step "
                        "beside its float32 step), each conv of another dtype than float32 in a block of its own, "
                        "of at most 3 repeats (where it is oneDNN's reference code, seconds a call, it would stand "
                        "between the steps)")
    p.add_argument('--note', help='a note to keep in the JSON (e.g. what the tree held)')
    p.add_argument('--json', help='write the results here')
    return p.parse_args(argv)


def interleaved(steps, repeats, warmup=1):
    """Wall and CPU seconds per call of each step, in interleaved rounds (the order reversed every other round), as
    benchmarks/harness/measure.py's interleaved_times."""
    for _ in range(warmup):
        for fn in steps.values():
            fn()
    wall, cpu = ({name: [] for name in steps} for _ in range(2))
    names = list(steps)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            t0, c0 = time.perf_counter(), time.process_time()
            steps[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def _cpu_flags() -> list:
    """The CPU's flags (/proc/cpuinfo's first flags line; none elsewhere)."""
    if not os.path.exists('/proc/cpuinfo'):
        return []
    with open('/proc/cpuinfo') as f:
        return next((line for line in f if line.startswith(('flags', 'Features'))), ':').partition(':')[2].split()


def main(argv=None):
    args = _args(argv)
    env = dict(CAPS if args.cap_libraries else {}, **(dict(OMP_WAIT_POLICY='PASSIVE') if args.passive else {}))
    if any(os.environ.get(k) != v for k, v in env.items()):
        os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, **env))  # before torch loads
    import torch
    from torch import nn

    from harness.measure import backbone_shapes, commit, cpu_model, layer_step, load_average, machine, spread
    from timm_lambda.layers import LambdaLayer
    from timm_lambda.layers.position_lambda import backends, cpu_kernel

    torch.set_num_threads(args.threads)
    command = 'python ' + ' '.join(shlex.quote(a) for a in [os.path.relpath(__file__)] + sys.argv[1:])
    load_before = load_average()
    kernels = {}
    for target in args.targets:
        kernel = cpu_kernel.load_target(target)
        if kernel is None and args.build:
            env = dict(os.environ, **{cpu_kernel.ARCH_ENV: target})
            subprocess.run([sys.executable, '-m', 'timm_lambda.build_cpu_kernel'], env=env, check=True)
            kernel = cpu_kernel.load_target(target)
        if kernel is None:
            sys.exit(f'no build for -march={target}: run {cpu_kernel.ARCH_ENV}={target} python -m '
                     'timm_lambda.build_cpu_kernel (or --build)')
        kernels[target] = kernel

    def isa_of(kernel):
        with cpu_kernel.serving(kernel):
            return cpu_kernel.isa()

    builds = {t: dict(isa=isa_of(k), isa_macros=list(k.isa_macros()), vector_bytes=int(k.vector_bytes),
                      bf16=bool(k.bf16), module=os.path.basename(k.__file__)) for t, k in kernels.items()}
    print(f'# {machine()}; builds: ' + ', '.join(f"{t}: {b['isa']} ({b['vector_bytes']} B vectors)"
                                                 for t, b in builds.items()), flush=True)

    def served(kernel, backend, step, path=''):
        def run():
            if path:
                os.environ[cpu_kernel.PATH_ENV] = path
            else:
                os.environ.pop(cpu_kernel.PATH_ENV, None)
            backends.set_backend(backend, strict=backend != 'auto')  # (bumps the plans' version)
            with contextlib.nullcontext() if kernel is None else cpu_kernel.serving(kernel):  # (this build serves)
                step()
        return run

    native = kernels.get('native')
    first = native or next(iter(kernels.values()))  # (the paths chosen by the first build timed: native where timed)
    with cpu_kernel.serving(first):
        isa = cpu_kernel.brgemm_isa() if native is not None else ''
        chosen = {f'{d} s{s}': list(cpu_kernel.compute_path(getattr(torch, d), s))
                  for d in args.dtypes for s in (1, 2)}
    paths = [p for p in (cpu_kernel.BF16_PATHS if args.bf16_paths is None else args.bf16_paths)
             if native is not None and native.bf16 and (p != 'brgemm' or isa)]
    print(f'# bfloat16 BRGEMM micro-kernel: {isa or "none"}; paths timed: {", ".join(paths) or "none"}; chosen: '
          + '; '.join(f'{k}: {v[0]}' for k, v in chosen.items()), flush=True)

    def candidates(width, size, stride, mode, dtype_name):
        """``(steps, figures)`` of one row: the conv's and the layer's candidates' steps of one dtype."""
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(0)
        x = torch.randn(1, width, size, size, requires_grad=mode == 'train')
        conv = nn.Conv2d(width, width, 3, stride, 1, bias=False).train(mode == 'train')
        layer = LambdaLayer(width, width, dim_k=16, heads=4, scope=23, stride=stride).train(mode == 'train')
        steps = {'conv3x3': layer_step(conv, x, dtype, mode)}
        figures = {'conv3x3': dict(isa='library')}
        for target, kernel in kernels.items():
            steps[f'cpu_kernel[{target}]'] = served(kernel, 'cpu_kernel', layer_step(layer, x, dtype, mode))
            figures[f'cpu_kernel[{target}]'] = dict(isa=builds[target]['isa'])
        for path in paths if dtype == torch.bfloat16 else []:
            name = f'cpu_kernel[native,{path}]'
            steps[name] = served(native, 'cpu_kernel', layer_step(layer, x, dtype, mode), path)
            figures[name] = dict(isa=builds['native']['isa'], path=path, brgemm=isa if path == 'brgemm' else '')
        if not args.no_gemm:
            steps['gemm'] = served(None, 'gemm', layer_step(layer, x, dtype, mode))
            figures['gemm'] = dict(isa='library')
        if not args.no_auto:
            for target, kernel in kernels.items():
                steps[f'auto[{target}]'] = served(kernel, 'auto', layer_step(layer, x, dtype, mode))
                figures[f'auto[{target}]'] = dict(isa=builds[target]['isa'])
        for name, step in steps.items():  # which backends serve each candidate (once, untimed)
            backends.served_backends(reset=True)
            step()
            figures[name]['served'] = sorted({k[1] for k in backends.served_backends(reset=True)})
        return steps, figures

    results = []
    for width, size, stride in [backbone_shapes(args.image_size)[i] for i in args.shapes]:
        for mode in args.modes:
            groups = [[d] for d in args.dtypes] if not args.dtypes_together else [list(args.dtypes)]
            for group in groups:
                rows = {d: candidates(width, size, stride, mode, d) for d in group}
                block = {(d, name): step for d, (steps, _) in rows.items() for name, step in steps.items()
                         if not (args.dtypes_together and d != 'float32' and name == 'conv3x3')}
                times, cpu = interleaved(block, args.repeats)
                for d, (steps, _) in rows.items():  # (--dtypes-together: a conv of another dtype on its own)
                    if (d, 'conv3x3') not in block:
                        apart = interleaved({(d, 'conv3x3'): steps['conv3x3']}, min(args.repeats, 3))
                        times.update(apart[0]), cpu.update(apart[1])
                for dtype_name, (steps, figures) in rows.items():
                    key = (dtype_name, 'conv3x3')
                    conv_ms, conv_cpu = 1e3 * spread(times[key])[1], 1e3 * spread(cpu[key])[1]
                    for name in steps:
                        lo, mid, hi = spread(times[(dtype_name, name)])
                        cpu_ms = 1e3 * spread(cpu[(dtype_name, name)])[1]
                        figures[name].update(ms=round(1e3 * mid, 2), min_ms=round(1e3 * lo, 2),
                                             max_ms=round(1e3 * hi, 2), ratio=round(1e3 * mid / conv_ms, 3),
                                             cpu_ms=round(cpu_ms, 2), cpu_ratio=round(cpu_ms / conv_cpu, 3))
                    row = dict(width=width, size=size, stride=stride, mode=mode, dtype=dtype_name, **figures)
                    results.append(row)
                    print(f'{width} ch {size}x{size} s{stride} {mode} {dtype_name}: ' + ', '.join(
                        f"{k} {v['ms']:.1f} ms ({v['ratio']:.2f}x; CPU time {v['cpu_ratio']:.2f}x)"
                        for k, v in figures.items()), flush=True)
    sums = {}
    for mode in args.modes:
        for dtype_name in args.dtypes:
            rows = [r for r in results if r['mode'] == mode and r['dtype'] == dtype_name]
            conv = sum(r['conv3x3']['ms'] for r in rows)
            conv_cpu = sum(r['conv3x3']['cpu_ms'] for r in rows)
            names = [k for k in rows[0] if isinstance(rows[0][k], dict)]
            sums[f'{mode} {dtype_name}'] = {k: round(sum(r[k]['ms'] for r in rows) / conv, 3) for k in names}
            sums[f'{mode} {dtype_name}, CPU time'] = {k: round(sum(r[k]['cpu_ms'] for r in rows) / conv_cpu, 3)
                                                      for k in names}
            for key in (f'{mode} {dtype_name}', f'{mode} {dtype_name}, CPU time'):
                print(f'summed, {key}: ' + ', '.join(f'{k} {v:.2f}x' for k, v in sums[key].items()))
    if args.json:
        meta = dict(command=command, date=time.strftime('%Y-%m-%d %H:%M:%S %Z'), commit=commit(),
                    load_before=load_before, machine=machine(), cpu=cpu_model(), threads=args.threads, batch=1,
                    repeats=args.repeats, libraries_capped_to_avx2=args.cap_libraries, load_after=load_average(),
                    dtypes_together=args.dtypes_together,
                    environment={k: os.environ[k] for k in list(CAPS) + ['OMP_WAIT_POLICY'] if k in os.environ},
                    builds=builds, user_note=args.note, cpu_flags=sorted(
                        set(_cpu_flags()) &
                        {'avx2', 'fma', 'avx512f', 'avx512_bf16', 'amx_bf16', 'amx_tile', 'avx512_fp16'}),
                    vendor=cpu_kernel._vendor(), brgemm_isa=isa, bf16_paths_timed=paths, compute_path=chosen,
                    note='ms: median wall time of the interleaved repeats; cpu_ms: median CPU time of the process (all '
                         'threads); ratio, cpu_ratio: to the conv3x3 of the same row; summed: the three shapes\' '
                         "times over the conv's; isa: the instruction set of the kernel build that ran ('library': "
                         "oneDNN/MKL's own dispatch); served: the backends that ran the position lambdas; "
                         "cpu_kernel[native,<path>]: the native build with its bfloat16 path forced "
                         "(TIMM_LAMBDA_CPU_BF16), brgemm: the micro-kernel oneDNN ran it on; compute_path: the path "
                         "cpu_kernel.compute_path chooses per dtype and step, and why")
        with open(args.json, 'w') as f:
            json.dump(dict(meta, results=results, summed_ratio=sums), f, indent=1)
            f.write('\n')


if __name__ == '__main__':
    main()
