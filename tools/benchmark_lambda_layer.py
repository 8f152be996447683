#!/usr/bin/env python
"""Benchmark the lambda layer implementations: forward+backward time and peak memory.

Compares, on the same input, ``timm_lambda.layers.LambdaLayer`` with ``impl='einsum'`` (gathered
[|k|, |u|, |n|, |m|] embeddings, Fig. 3/5) and ``impl='conv'`` (lambda convolution, section 3.4),
plus timm's own ``timm.layers.lambda_layer.LambdaLayer`` configured as close as it allows
(``r=scope`` lambda convolution, ``dim_head=|k|``, ``num_heads=|h|``, u=1). timm differs in that
its lambda conv is an ``nn.Conv3d`` *with bias* and its own (non-shared-table) weight layout, it
has no intra-depth, and it downsamples with a 2x2 avg pool (all runs here use stride 1).

Peak memory
  * cuda: ``torch.cuda.max_memory_allocated`` minus the memory allocated before the step
    (caching-allocator bytes, includes library workspaces).
  * cpu: a TorchDispatchMode live-tensor tracker: the largest sum of bytes of *storages created
    by aten ops during the step* that are simultaneously alive (freed storages detected with
    ``StorageWeakRef``). Inputs and parameters, which exist before the step, are excluded;
    scratch buffers allocated inside a kernel (e.g. the im2col buffer of CPU conv3d) are not
    visible to it. Measured on a separate, untimed run.

The ``--crossover`` sweep times einsum vs conv on square inputs of growing size and reports each
as a function of the gathered embedding size |k||u||n|^2*4 bytes: the quantity compared against
``EINSUM_MAX_EMBEDDING_BYTES`` by ``impl='auto'``.

Examples::

    python tools/benchmark_lambda_layer.py --json bench.json          # default table (~10 min, 2 CPU cores)
    python tools/benchmark_lambda_layer.py --quick                    # 1-2 minutes
    python tools/benchmark_lambda_layer.py --device cuda --batch 32
"""
import argparse
import gc
import json
import math
import os
import sys
import time

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from timm_lambda.layers import LambdaLayer  # noqa: E402
from timm_lambda.layers import lambda_layer as _ll  # noqa: E402

try:
    from timm.layers.lambda_layer import LambdaLayer as TimmLambdaLayer
except ImportError:  # timm is optional for this script
    TimmLambdaLayer = None


class LiveTensorTracker(TorchDispatchMode):
    """Peak bytes of simultaneously-alive storages produced by aten ops (CPU peak memory proxy)."""

    def __init__(self):
        super().__init__()
        self.live = {}  # storage key -> (StorageWeakRef, nbytes)
        self.current = 0
        self.peak = 0

    def _sweep(self):
        dead = [key for key, (ref, _) in self.live.items() if ref.expired()]
        for key in dead:
            self.current -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != 'meta':
                st = t.untyped_storage()
                key = st._cdata
                if key not in self.live:
                    self.live[key] = (StorageWeakRef(st), st.nbytes())
                    self.current += st.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def make_layer(kind, dim, args, device):
    if kind == 'timm':
        layer = TimmLambdaLayer(dim, dim_out=dim, num_heads=args.heads, dim_head=args.dim_k, r=args.scope)
    else:
        layer = LambdaLayer(dim, dim_k=args.dim_k, heads=args.heads, dim_u=args.dim_u, scope=args.scope, impl=kind)
    return layer.to(device).train()


def step(layer, x):
    y = layer(x)
    y.backward(torch.ones_like(y))
    return y


def sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize()


def emb_bytes(args, h, w):
    n = h * w
    return args.dim_k * args.dim_u * n * n * 4


def measure(kind, dim, size, args, device):
    """Return dict(time_ms=[...], peak_mib=...) or dict(skipped=reason)."""
    h = w = size
    if kind == 'einsum' and emb_bytes(args, h, w) > args.max_einsum_bytes:
        return dict(skipped=f'embedding {emb_bytes(args, h, w) / 2**20:.0f} MiB > --max-einsum-bytes')
    if kind == 'timm' and (TimmLambdaLayer is None or args.dim_u != 1):
        return dict(skipped='timm unavailable or |u| != 1')
    torch.manual_seed(0)
    layer = make_layer(kind, dim, args, device)
    x = torch.randn(args.batch, dim, h, w, device=device, requires_grad=True)
    # first step: peak memory (tracked) and warm-up; not timed
    gc.collect()
    t0 = time.perf_counter()
    if device.type == 'cuda':
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(layer, x)
        sync(device)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with LiveTensorTracker() as tr:
            step(layer, x)
        peak = tr.peak
    first_s = time.perf_counter() - t0
    # steps slower than --long-s are timed once (2 CPU cores: einsum at 64x64 takes minutes)
    n_timed = 1 if first_s > args.long_s else args.repeats
    times, cpu_times = [], []
    for i in range(args.warmup - 1 + n_timed):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        step(layer, x)
        sync(device)
        if i >= args.warmup - 1:
            times.append((time.perf_counter() - t0) * 1e3)
            cpu_times.append((time.process_time() - c0) * 1e3)
    del layer, x
    gc.collect()
    return dict(time_ms=times, cpu_ms=cpu_times, peak_mib=peak / 2**20)


def fmt_time(r):
    return r['skipped'] if 'skipped' in r else f"{min(r['time_ms']):.0f}"


def fmt_cpu(r):
    return '-' if 'skipped' in r else f"{min(r['cpu_ms']):.0f}"


def fmt_mem(r):
    return '-' if 'skipped' in r else f"{r['peak_mib']:.0f}"


def run_table(args, device):
    kinds = ['einsum', 'conv'] + (['timm'] if not args.no_timm else [])
    rows = []
    print(f"\nforward+backward ms (best of repeats) and peak MiB ({'max_memory_allocated' if device.type == 'cuda' else 'live aten-tensor bytes'})")
    print(f"| width | input | emb MiB | " + ' | '.join(f'{k} ms' for k in kinds) + ' | '
          + ' | '.join(f'{k} CPU ms' for k in kinds) + ' | '
          + ' | '.join(f'{k} peak MiB' for k in kinds) + ' |')
    print('|' + '---|' * (3 + 3 * len(kinds)))
    for dim in args.widths:
        for size in args.sizes:
            res = {k: measure(k, dim, size, args, device) for k in kinds}
            row = dict(width=dim, size=size, batch=args.batch, emb_bytes=emb_bytes(args, size, size), results=res)
            rows.append(row)
            print(f"| {dim} | {size}x{size} | {row['emb_bytes'] / 2**20:.1f} | "
                  + ' | '.join(fmt_time(res[k]) for k in kinds) + ' | '
                  + ' | '.join(fmt_cpu(res[k]) for k in kinds) + ' | '
                  + ' | '.join(fmt_mem(res[k]) for k in kinds) + ' |', flush=True)
    return rows


def run_crossover(args, device):
    rows = []
    threads = torch.get_num_threads()
    if device.type == 'cpu' and args.crossover_threads:
        torch.set_num_threads(args.crossover_threads)
    print(f'\ncrossover sweep, width {args.crossover_width}, batch {args.batch}, |k|={args.dim_k}, '
          f'|u|={args.dim_u}, scope {args.scope}, {torch.get_num_threads()} thread(s) '
          f'(forward+backward, best-of-repeats ms)')
    print(f'ratio from {args.crossover_metric} (cpu_ms: process CPU time, robust to other processes)')
    print('| input | n | emb MiB | einsum ms | conv ms | einsum CPU ms | conv CPU ms | einsum/conv |')
    print('|---|---|---|---|---|---|---|---|')
    for size in args.crossover_sizes:
        res = {k: measure(k, args.crossover_width, size, args, device) for k in ('einsum', 'conv')}
        if 'skipped' in res['einsum']:
            ratio = float('nan')
        else:
            ratio = min(res['einsum'][args.crossover_metric]) / min(res['conv'][args.crossover_metric])
        row = dict(size=size, emb_bytes=emb_bytes(args, size, size), results=res, ratio=ratio)
        rows.append(row)
        print(f"| {size}x{size} | {size * size} | {row['emb_bytes'] / 2**20:.2f} | {fmt_time(res['einsum'])} | "
              f"{fmt_time(res['conv'])} | {fmt_cpu(res['einsum'])} | {fmt_cpu(res['conv'])} | {ratio:.2f} |", flush=True)
    torch.set_num_threads(threads)
    return rows


def int_list(s):
    return [int(v) for v in s.split(',') if v]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--device', default='cpu', choices=['cpu', 'cuda'])
    p.add_argument('--batch', type=int, default=8)
    p.add_argument('--sizes', type=int_list, default=[14, 28, 56, 64], help='square input sizes, e.g. 14,28,56,64')
    p.add_argument('--widths', type=int_list, default=[256, 512], help='channels |d| (c4 = 256, c5 = 512)')
    p.add_argument('--dim-k', type=int, default=16)
    p.add_argument('--heads', type=int, default=4)
    p.add_argument('--dim-u', type=int, default=1)
    p.add_argument('--scope', type=int, default=23)
    p.add_argument('--repeats', type=int, default=3,
                   help='timed forward+backward steps; the minimum is reported (load from other '
                        'processes only ever adds time)')
    p.add_argument('--warmup', type=int, default=1, help='untimed steps, >= 1 (the first is the memory-tracked one)')
    p.add_argument('--long-s', type=float, default=5.0,
                   help='time a configuration only once if its first step took longer than this')
    p.add_argument('--max-einsum-bytes', type=float, default=2 ** 30,
                   help='skip einsum when the gathered embedding exceeds this (host RAM guard)')
    p.add_argument('--no-timm', action='store_true')
    p.add_argument('--no-table', action='store_true', help='only run the crossover sweep')
    p.add_argument('--crossover', action=argparse.BooleanOptionalAction, default=True)
    p.add_argument('--crossover-sizes', type=int_list, default=[8, 16, 24, 32, 40])
    p.add_argument('--crossover-width', type=int, default=256)
    p.add_argument('--crossover-threads', type=int, default=1,
                   help='CPU threads for the crossover sweep (default 1: with several threads the CPU time '
                        'includes OpenMP spin-waiting, which swamps small configurations); 0 keeps --threads')
    p.add_argument('--crossover-metric', default='cpu_ms', choices=['cpu_ms', 'time_ms'],
                   help='einsum/conv ratio from process CPU time (default; use with --threads 1 on a '
                        'shared machine) or wall time')
    p.add_argument('--threads', type=int, default=None, help='torch.set_num_threads (cpu)')
    p.add_argument('--quick', action='store_true',
                   help='batch 2, sizes 14,28, width 256, 1 repeat, short sweep (1-2 minutes)')
    p.add_argument('--json', default=None, help='write all measurements to this file')
    args = p.parse_args(argv)
    args.warmup = max(args.warmup, 1)
    if args.quick:
        args.batch, args.sizes, args.widths, args.repeats = 2, [14, 28], [256], 2
        args.crossover_sizes = [8, 16, 24, 32]
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f'torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, batch {args.batch}, '
          f'|k|={args.dim_k} |h|={args.heads} |u|={args.dim_u} scope {args.scope}, '
          f'EINSUM_MAX_EMBEDDING_BYTES={_ll.EINSUM_MAX_EMBEDDING_BYTES / 2**20:.0f} MiB')
    t0 = time.time()
    out = dict(args={k: v for k, v in vars(args).items()}, torch=torch.__version__,
               threads=torch.get_num_threads(), cpu_count=os.cpu_count())
    if not args.no_table:
        out['table'] = run_table(args, device)
    if args.crossover:
        out['crossover'] = run_crossover(args, device)
        slower = [r for r in out['crossover'] if not math.isnan(r['ratio']) and r['ratio'] > 1]
        if slower:
            print(f"einsum first slower than conv at {slower[0]['size']}x{slower[0]['size']} "
                  f"(embedding {slower[0]['emb_bytes'] / 2**20:.2f} MiB)")
    out['wall_s'] = time.time() - t0
    print(f"total {out['wall_s']:.0f} s")
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(out, f, indent=1)


if __name__ == '__main__':
    main()
