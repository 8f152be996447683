#!/usr/bin/env python
"""Every figure of the README's CPU table at the current commit, in one JSON: one command (issue 59 item 3).

Each part runs one of the measurement programs in its own process, with the CPU kernel's build and the libraries'
instruction set it names, and keeps that program's JSON whole under ``parts[name]['result']``, beside what ran
(``isa``: the kernel's build, ATen's capability, oneDNN's instruction set and the implementations of its float32 and
bfloat16 convolutions, asked of a process with the part's environment: harness/isa.py) and the part's command,
commit, date, loads and duration. Three classes of CPU, on this one: as it is (here AVX-512 with AVX-512 BF16 and
AMX), a CPU with AVX-512 BF16 and no AMX (oneDNN held to ``AVX512_CORE_BF16``; the kernel's native build), and an
AVX2 + FMA CPU (the kernel's ``-march=x86-64-v3`` build, oneDNN, MKL and ATen held to AVX2; float32 only: held so,
oneDNN runs bfloat16 convolutions by its reference code).

    python benchmarks/cpu_table.py --json docs/results/cpu_table.json          # every part (see PARTS)
    python benchmarks/cpu_table.py --parts c4 c4_avx2 --json docs/results/cpu_table.json   # re-run two parts
    python benchmarks/cpu_table.py --parts layer c4 c4_bf16 backbone backbone_bf16 classification \
        --json docs/results/cpu_table_amd.json   # on an AMD CPU: the README's AMD column

Builds both kernels first where they are not built (``python -m timm_lambda.build_cpu_kernel``, plain and with
``TIMM_LAMBDA_CPU_ARCH=x86-64-v3``, into ``$TORCH_EXTENSIONS_DIR``). The JSON is written after each part; with
``--json`` naming an existing file, the parts not run are kept. ``python tools/generate.py`` renders the README's
table from the file.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from harness.isa import HOLD, probe
from harness.measure import commit, cpu_model, load_average, machine

HERE = os.path.dirname(os.path.abspath(__file__))
AVX2_BUILD = {'TIMM_LAMBDA_CPU_ARCH': 'x86-64-v3'}
# name -> (what, program, its arguments, environment); the program's own --json is added
PARTS = {
    'layer': ("one lambda layer and its 3x3 conv at LambdaResNet-101's three 1024 px shapes, the kernel's native and "
              'AVX2 builds side by side, float32 and bfloat16 autocast, training step and eval; libraries as they are',
              'benchmark_cpu_isa.py', ['--passive', '--repeats', '7'], {}),
    'layer_avx512_bf16': ('the same, bfloat16, the native build; oneDNN held to AVX-512 BF16 (no AMX)',
                          'benchmark_cpu_isa.py', ['--passive', '--repeats', '7', '--targets', 'native', '--dtypes',
                                                   'bfloat16'], HOLD['avx512_bf16']),
    'layer_avx2': ('the same, float32, the AVX2 build; oneDNN, MKL and ATen held to AVX2', 'benchmark_cpu_isa.py',
                   ['--passive', '--cap-libraries', '--repeats', '7', '--targets', 'x86-64-v3', '--dtypes', 'float32'],
                   dict(HOLD['avx2'], **AVX2_BUILD)),
    'layer_train': ('one lambda layer and its 3x3 conv at the same shapes, training step, float32: times, the '
                    "layer's multiply-add rate and share of the CPU's float32 limit, peak memory",
                    'benchmark_lambda_layer.py', ['--repeats', '7'], {}),
    'layer_eval': ('the same, eval', 'benchmark_lambda_layer.py', ['--repeats', '7', '--mode', 'eval'], {}),
    'c4': ('LambdaResNet-101-C4 against its conv twin, 512 px, batch 1, float32', 'benchmark_models.py',
           ['c4', '--repeats', '7'], {}),
    'c4_bf16': ('the same under bfloat16 autocast', 'benchmark_models.py',
                ['c4', '--repeats', '7', '--dtype', 'bfloat16'], {}),
    'c4_bf16_avx512_bf16': ('the same, oneDNN held to AVX-512 BF16 (no AMX)', 'benchmark_models.py',
                            ['c4', '--repeats', '7', '--dtype', 'bfloat16'], HOLD['avx512_bf16']),
    'c4_avx2': ('LambdaResNet-101-C4 against its conv twin, float32, the AVX2 build, libraries held to AVX2',
                'benchmark_models.py', ['c4', '--repeats', '7'], dict(HOLD['avx2'], **AVX2_BUILD)),
    'backbone': ('LambdaResNet-101 against ResNet-RS-101+SE (and the bounds), c2..c5 features, 1024 px, batch 1, '
                 'float32', 'benchmark_models.py', ['backbone', '--repeats', '5'], {}),
    'backbone_bf16': ('the same under bfloat16 autocast', 'benchmark_models.py',
                      ['backbone', '--repeats', '5', '--dtype', 'bfloat16'], {}),
    'classification': ('LambdaResNet-101 against ResNet-RS-101+SE, classifiers, 224 px, batch 2, float32',
                       'benchmark_models.py', ['classification', '--repeats', '7'], {}),
}


def _build_kernels():
    for env in ({}, AVX2_BUILD):
        subprocess.run([sys.executable, '-m', 'timm_lambda.build_cpu_kernel'], env=dict(os.environ, **env), check=True)


def run_part(name: str) -> dict:
    what, program, args, env = PARTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, 'result.json')
        cmd = [sys.executable, os.path.join(HERE, program)] + args + ['--json', out]
        shown = ' '.join([f'{k}={v}' for k, v in env.items()] + ['python', f'benchmarks/{program}'] + args)
        print(f'[cpu_table] {name}: {shown}', flush=True)
        record = dict(what=what, command=shown, env=env, isa=probe(env), commit=commit(),
                      date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), load_before=load_average())
        t0 = time.perf_counter()
        subprocess.run(cmd, env=dict(os.environ, **env), check=True)
        record.update(seconds=round(time.perf_counter() - t0, 1), load_after=load_average())
        with open(out) as f:
            record['result'] = json.load(f)
    return record


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--parts', nargs='+', choices=list(PARTS), default=list(PARTS))
    p.add_argument('--json', help='write (or update) the result here, after each part')
    args = p.parse_args(argv)
    t0, load_before = time.perf_counter(), load_average()
    parts, runs = {}, []
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            kept = json.load(f)
        if kept.get('cpu') != cpu_model():  # one file, one CPU: its parts compare classes of CPU on one machine
            p.error(f"--json {args.json} holds a run on {kept.get('cpu')}, this CPU is {cpu_model()}: name "
                    'another file (docs/results/cpu_table_<vendor>.json)')
        parts, runs = kept['parts'], kept.get('runs', [])  # the parts not run now are kept, and how they ran
    this = dict(command=shlex.join(['python', 'benchmarks/cpu_table.py'] + list(argv or sys.argv[1:])),
                date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), commit=commit(), load_before=load_before)
    _build_kernels()
    for name in args.parts:
        parts[name] = run_part(name)
        this.update(parts=args.parts[:args.parts.index(name) + 1], seconds=round(time.perf_counter() - t0, 1),
                    load_after=load_average())
        # command: what reproduces every part; runs: the invocations that measured them
        record = dict(command=f'python benchmarks/cpu_table.py --json {args.json or "OUT.json"}', date=this['date'],
                      commit=this['commit'], machine=machine(), cpu=cpu_model(), cores=os.cpu_count(),
                      runs=runs + [this], parts=parts)
        if args.json:  # after each part: an interrupted run keeps what it measured
            with open(args.json, 'w') as f:
                json.dump(record, f, indent=1, default=str)
                f.write('\n')
    print(f'[cpu_table] {len(args.parts)} parts in {time.perf_counter() - t0:.0f} s')


if __name__ == '__main__':
    main()
