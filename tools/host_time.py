"""Host time of one lambda layer's eager training step: the tiled operator's eager path (an ``autograd.Function``)
against the custom operator's Python dispatch, side by side in one process, in interleaved rounds.

A layer step on a GPU at batch 1 is bound by its host time (docs/benchmarks.md, "GPU"). Here the layer runs on a
2x2 map so that the kernels themselves cost little: with the ``triton_tc`` backend the Triton launches are stubbed
out (Triton's interpreter set, nothing launched: what remains is the host's work around them), with ``cpu_kernel``
the CPU kernel runs (both the tiled form), with ``gemm`` the dense form (what ``'auto'`` picks for a map this small,
as in a 224 px classifier's c5). One thread. Times are of this machine's CPU; the ratio is what the eager path saves.

    python tools/host_time.py [--json docs/results/host_time.json]
"""
import os

os.environ.setdefault('TRITON_INTERPRET', '1')  # before timm_lambda loads: the triton_tc backend serves CPU tensors

import argparse  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from dev.benchmarks.measure import commit, machine  # noqa: E402
from timm_lambda.layers import LambdaLayer, set_backend  # noqa: E402
from timm_lambda.layers.position_lambda import custom_ops, tiled_triton  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--rounds', type=int, default=15)
    p.add_argument('--steps', type=int, default=200, help='training steps a round')
    p.add_argument('--json', default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tiled_triton._launch = lambda *a, **k: None  # the Triton kernels stubbed: the host's work only
    # (their outputs are then uninitialised memory: the GEMMs after them would time denormal arithmetic, 0.1 ms a
    # GEMM here, where a fresh block holds such garbage)
    torch.set_flush_denormal(True)
    eager = custom_ops._eager
    torch.manual_seed(0)
    layer = LambdaLayer(16, 16, dim_k=4, heads=4, scope=23)
    x = torch.randn(1, 16, 2, 2)
    load = os.getloadavg()
    rows = []
    for backend in ('triton_tc', 'cpu_kernel', 'gemm'):
        set_backend(backend, strict=True)
        form = layer.choose_impl(2, 2)
        times = {'autograd.Function': [], 'custom operator': []}
        for r in range(args.rounds + 3):  # rounds 0-2: warm-up
            order = list(times) if r % 2 else list(times)[::-1]
            for path in order:
                custom_ops._eager = eager if path == 'autograd.Function' else (lambda device: False)
                t = time.perf_counter()
                for _ in range(args.steps):
                    layer(x).sum().backward()
                if r >= 3:
                    times[path].append((time.perf_counter() - t) / args.steps * 1e6)
        custom_ops._eager = eager
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        rows.append(dict(backend=backend, form=form, us_per_step={k: round(v, 1) for k, v in med.items()},
                         min_us={k: round(min(v), 1) for k, v in times.items()},
                         ratio=round(med['autograd.Function'] / med['custom operator'], 3)))
        print(f"{backend} ({form} form): custom operator {med['custom operator']:.0f} us, autograd.Function "
              f"{med['autograd.Function']:.0f} us a step ({rows[-1]['ratio']:.2f}x)", flush=True)
    set_backend('auto')
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(command=shlex.join(['python', 'tools/host_time.py'] + list(argv or sys.argv[1:])),
                           date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), commit=commit(),
                           machine=machine('cpu'), load_before=load, load_after=os.getloadavg(),
                           setting='LambdaLayer(16, dim_k=4, heads=4, scope=23), input 1x16x2x2, training step '
                                   '(forward, sum, backward), 1 thread; triton_tc with its launches stubbed',
                           rows=rows), f, indent=1)


if __name__ == '__main__':
    main()
