#!/usr/bin/env python
"""Lambda layer training step (forward + backward, input needing grad) against the 3x3 convolution it replaces.

Default: the three detection shapes of a LambdaResNet backbone at 1024x1024 (c4 lambda layers at 64x64 with
256 channels, the stride-2 first c5 layer at 64x64 with 512, the other c5 layers at 32x32 with 512; ``--image-size``
for another input size), batch 1,
``form='auto'``; prints time, multiply-add rate (GMAC/s: ``torch.utils.flop_counter``'s count, custom operators
included, over the median time) and, on a CPU, its share of the threads' float32 multiply-add limit
(benchmarks/harness/peak.py: how far each form is from the limit), peak memory and the ratio to the convolution per
shape and in total, for a training step (``--mode train``, the default) or eval-mode inference (``--mode eval``).

``--sweep``: every implementation and the convolution on square inputs of growing size (width 256), a PNG
plot of time and memory against the input side, and at each size the faster of the dense and tiled forms
(what ``form='auto'`` chooses between, timm_lambda/layers/position_lambda/; tests/test_lambda_impl_rule.py
reads the committed sweeps). ``--json`` writes the command, date, load before, machine (with the load after),
settings and results: the files in docs/results/ are these commands' output.

    python benchmarks/benchmark_lambda_layer.py --repeats 7 --json docs/results/lambda_layer.json   # ~1 min, 2 cores
    python benchmarks/benchmark_lambda_layer.py --repeats 7 --mode eval --json docs/results/lambda_layer_eval.json
    python benchmarks/benchmark_lambda_layer.py --forms auto conv einsum
    python benchmarks/benchmark_lambda_layer.py --image-size 512 --json docs/results/lambda_layer_512.json  # c4: 32x32
    python benchmarks/benchmark_lambda_layer.py --sweep --json docs/results/sweep_scope23.json
    python benchmarks/benchmark_lambda_layer.py --sweep --scope 7 --dim-u 4 --sizes 5 6 7 8 9 10 12 14 16 20 \
        --json docs/results/sweep_scope7_u4.json
    python benchmarks/benchmark_lambda_layer.py --replot docs/results/sweep_scope23.json \
        --plot docs/lambda_layer_sweep.png
    python benchmarks/benchmark_lambda_layer.py --device cuda --tf32 --batch 8   # tools/gpu_check.py runs the set
    python benchmarks/benchmark_lambda_layer.py --device cuda --dtype bfloat16
    python benchmarks/benchmark_lambda_layer.py --memory-only --json docs/results/lambda_layer.json   # no timings

``--memory-only``: the peak memory of every candidate's training step and no timing (memory is deterministic, so
it can be measured on a busy machine); with ``--json`` naming an existing result of the same command, its
``peak_mib`` fields are replaced and the run recorded under ``memory``.

Method: benchmarks/harness/measure.py (interleaved repeats in one process, medians; peak memory from the
allocator's events, custom operators included).
"""
import argparse
import json
import os
import shlex
import sys
import time

import torch
from torch import nn

from harness.measure import (
    backbone_shapes,
    commit,
    graphed_step,
    interleaved_times,
    layer_step,
    load_average,
    machine,
    peak_step_bytes,
    spread,
    step_macs,
)
from harness.peak import fma_peak_gmacs
from timm_lambda.layers import LambdaLayer


def _candidates(width, stride, forms, device, scope=23, dim_u=1):
    layers = {'conv3x3': nn.Conv2d(width, width, 3, stride, 1, bias=False)}
    for form in forms:
        try:
            layers[form] = LambdaLayer(width, scope=scope, dim_u=dim_u, stride=stride, form=form)
        except TypeError:  # before ``form`` (``PYTHONPATH`` of an older checkout: the figures before a change)
            layers[form] = LambdaLayer(width, scope=scope, dim_u=dim_u, stride=stride, impl=form)
    return {k: m.to(device) for k, m in layers.items()}


def measure(width, size, stride, batch, forms, device, dtype, repeats, max_seconds=None, scope=23, dim_u=1,
            mode='train', rates=False):
    """Median / min / max ms and peak MiB of each candidate; ``rates``: also its multiply-adds (``gmacs``) and
    their rate at the median (``gmac_per_s``)."""
    torch.manual_seed(0)
    x = torch.randn(batch, width, size, size, device=device, requires_grad=mode == 'train')
    layers = _candidates(width, stride, forms, device, scope, dim_u)
    steps = {k: layer_step(m.train(mode == 'train'), x, dtype, mode) for k, m in layers.items()}
    if repeats == 0:  # memory only
        return {k: dict(peak_mib=peak_step_bytes(step, device=device) / 2 ** 20) for k, step in steps.items()}
    times = interleaved_times(steps, repeats=repeats, device=device, max_seconds=max_seconds)
    rows = {}
    for k, step in steps.items():
        peak = peak_step_bytes(step, device=device)
        lo, mid, hi = spread(times[k])
        rows[k] = dict(ms=1e3 * mid, min_ms=1e3 * lo, max_ms=1e3 * hi, peak_mib=peak / 2 ** 20)
        if rates:
            macs = step_macs(step)
            rows[k].update(gmacs=macs / 1e9, gmac_per_s=macs / mid / 1e9)
    return rows


def _impls_at(size, impls_max={'einsum': 32, 'conv': 64, 'dense': 48, 'tiled': 256}):
    """The sweep's candidates at one size (each run kept to seconds on a CPU)."""
    return [i for i in ('dense', 'tiled', 'conv', 'einsum') if size <= impls_max[i]]


def memory_table(args):
    """``--memory-only``: peak MiB of each candidate's training step at the table's or the sweep's shapes."""
    shapes = [(args.width, s, 1, _impls_at(s)) for s in args.sizes] if args.sweep else \
        [(w, s, stride, args.forms) for w, s, stride in backbone_shapes(args.image_size)]
    print(f'# peak memory of a training step (MiB), batch {args.batch}, {args.dtype}, {machine(args.device)}')
    results = []
    for width, size, stride, forms in shapes:
        rows = measure(width, size, stride, args.batch, forms, args.device, args.dtype, 0, scope=args.scope,
                       dim_u=args.dim_u)
        key = dict(size=size) if args.sweep else dict(width=width, size=size, stride=stride)
        results.append(dict(key, **rows))
        print(f'{width}, {size}x{size}, s{stride}: ' + ', '.join(f"{k} {r['peak_mib']:.1f}" for k, r in rows.items()),
              flush=True)
    return results


def record_memory(path, results, meta):
    """Write ``results`` to ``path``, or where it holds a result of the same command, replace its ``peak_mib``
    fields (and record the memory run's ``meta`` under ``memory``)."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except FileNotFoundError:
        saved = dict(machine=meta['machine'], results=results)
    else:
        by_key = {tuple(v for v in r.values() if not isinstance(v, dict)): r for r in saved['results']}
        for row in results:
            old = by_key[tuple(v for v in row.values() if not isinstance(v, dict))]
            for k, cell in row.items():
                if isinstance(cell, dict):
                    old.setdefault(k, {})['peak_mib'] = cell['peak_mib']
    saved['memory'] = meta
    with open(path, 'w') as f:
        json.dump(saved, f, indent=1, default=str)


def detection_table(args):
    """The table's rows and the float32 multiply-add limit they are compared with (None: not measured)."""
    what = 'training step' if args.mode == 'train' else 'eval inference'
    print(f'# lambda layer vs 3x3 conv, {what}, batch {args.batch}, {args.dtype}, {machine(args.device)}')
    peak = fma_peak_gmacs() if args.device == 'cpu' and args.dtype == torch.float32 else None  # a float32 limit
    if peak:
        print(f'# float32 multiply-add limit of these threads (register-only FMA loop): {peak:.0f} GMAC/s; '
              'each GMAC/s below is followed by its share of it')
    print('| width, input, stride | ' + ' | '.join(f'{k} median ms [min-max] (x conv), GMAC/s, MiB'
                                                   for k in ['conv3x3'] + args.forms) + ' |')
    print('|---|' + '---|' * (1 + len(args.forms)))
    totals, results = {}, []
    for width, size, stride in backbone_shapes(args.image_size):
        rows = measure(width, size, stride, args.batch, args.forms, args.device, args.dtype, args.repeats,
                       mode=args.mode, rates=True)
        conv = rows['conv3x3']['ms']
        if peak:
            for r in rows.values():
                r['share_of_fma_peak'] = r['gmac_per_s'] / peak
        cells = [f"{r['ms']:.1f} [{r['min_ms']:.1f}-{r['max_ms']:.1f}] ({r['ms'] / conv:.2f}x), "
                 f"{r['gmac_per_s']:.0f}" + (f" ({100 * r['share_of_fma_peak']:.0f}%)" if peak else '')
                 + f", {r['peak_mib']:.0f}" for r in rows.values()]
        print(f'| {width}, {size}x{size}, s{stride} | ' + ' | '.join(cells) + ' |', flush=True)
        for k, r in rows.items():
            totals[k] = totals.get(k, 0.0) + r['ms']
        results.append(dict(width=width, size=size, stride=stride, **{k: r for k, r in rows.items()}))
    print('| **total** | '
          + ' | '.join(f"{totals[k]:.1f} ({totals[k] / totals['conv3x3']:.2f}x)" for k in totals) + ' |')
    print(f'load average after: {load_average()}')
    return results, peak


def sweep(args):
    sizes = args.sizes
    print(f'# sweep: width {args.width}, scope {args.scope}, |u|={args.dim_u}, batch {args.batch}, {args.dtype}, '
          f'{machine(args.device)}')
    results = []
    for size in sizes:
        use = _impls_at(size)
        rows = measure(args.width, size, 1, args.batch, use, args.device, args.dtype, args.repeats, max_seconds=20,
                       scope=args.scope, dim_u=args.dim_u)
        results.append(dict(size=size, **rows))
        print(f'{size}x{size}: '
              + ', '.join(f"{k} {r['ms']:.1f} ms / {r['peak_mib']:.0f} MiB" for k, r in rows.items()), flush=True)
    print(f'load average after: {load_average()}')
    layer = LambdaLayer(8, dim_k=4, heads=2, dim_u=args.dim_u, scope=args.scope)
    compared = [r for r in results if 'dense' in r and 'tiled' in r]
    faster = {r['size']: min(('dense', 'tiled'), key=lambda k: r[k]['ms']) for r in compared}
    # clearly faster: its median round beats the other form's fastest round (tests/test_lambda_impl_rule.py)
    other = {'dense': 'tiled', 'tiled': 'dense'}
    clear = {r['size'] for r in compared if r[faster[r['size']]]['ms'] < r[other[faster[r['size']]]]['min_ms']}
    misses = [f"{s} px (auto: {layer.choose_form(s, s)}, {faster[s]} faster)" for s in faster
              if layer.choose_form(s, s) != faster[s]]
    print('faster form by size (*: within the other form\'s spread): '
          + ', '.join(f"{s}: {k}{'' if s in clear else '*'}" for s, k in faster.items()))
    print(f"form='auto' picks the faster form at {len(faster) - len(misses)} of {len(faster)} sizes"
          + (f"; not at {', '.join(misses)}" if misses else ''))
    if args.plot:
        _plot(results, args)
    return results


def _plot(results, args, machine_line=None):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = sorted({k for r in results for k in r if k != 'size'}, key=lambda k: (k != 'conv3x3', k))
    for name in names:
        pts = [(r['size'], r[name]) for r in results if name in r]
        for ax, key in zip(axes, ('ms', 'peak_mib')):
            ax.plot([p[0] for p in pts], [p[1][key] for p in pts], 'o-' if name != 'conv3x3' else 'k--', label=name)
    for ax, label in zip(axes, ('training step (ms)', 'peak step memory (MiB)')):
        ax.set_xlabel('input side (px)')
        ax.set_ylabel(label)
        ax.set_yscale('log')
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f'lambda layer (width {args.width}, batch {args.batch}, scope {args.scope}, |u|={args.dim_u}) '
                 'vs 3x3 conv'
                 f'\n{machine_line or machine(args.device)}',
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f'plot: {args.plot}')


# the GPU check's tables (tools/gpu_check.py layer): every dtype, batch and mode on the backend 'auto' runs on CUDA
# (triton_tc), the training steps on the other CUDA backends of the tiled form, chosen by the public override
GPU_CHECK_SETS = [(dtype, batch, mode) for mode in ('train', 'eval') for batch in (1, 8)
                  for dtype in ('float32', 'bfloat16')]
GPU_CHECK_BACKENDS = ('triton_tc', 'gemm', 'triton_fma')


def use_backend(name: str, device: str) -> None:
    """Choose backend ``name`` (``set_backend``); on a CPU (the dry run) the Triton ones are 'auto' (the CPU kernel)."""
    from timm_lambda.layers import set_backend
    set_backend(name if device == 'cuda' or not name.startswith('triton') else 'auto')


def gpu_check(out: str, tiny: bool) -> None:
    """``--gpu-check DIR``: one process for every (execution, dtype, batch, mode) of the GPU check, a JSON per table
    and ``layer_benchmarks.json`` (all of them, rewritten after each, a failing table recorded with its error), then
    the batch-1 CUDA-graph comparison of the layers and their convs (``graphs.json``). ``tiny``: the CPU at 64 px, one
    round (the dry run: every path runs)."""
    from timm_lambda.layers import served_backends
    global fma_peak_gmacs
    if tiny:
        fma_peak_gmacs = lambda: None  # noqa: E731  (the CPU's float32 limit, a 30 s measurement, is no GPU figure)
    todo = [('triton_tc', s) for s in GPU_CHECK_SETS] + [
        (e, s) for e in GPU_CHECK_BACKENDS[1:] for s in GPU_CHECK_SETS if s[2] == 'train']
    if tiny:  # every backend, dtype and mode once
        todo = [t for t in todo if t[1][1] == 1 and (t[0] == 'triton_tc' or t[1][0] == 'float32')]
    results = []
    device = 'cpu' if tiny else 'cuda'
    for execution, (dtype, batch, mode) in todo:
        use_backend(execution, device)
        path = os.path.join(out, f'layer_{execution}_{dtype}_b{batch}_{mode}.json')
        argv = ['--dtype', dtype, '--batch', str(batch), '--mode', mode, '--json', path]
        argv += ['--image-size', '64', '--repeats', '1'] if tiny else ['--device', 'cuda', '--tf32', '--repeats', '10']
        print(f'## {execution}: benchmark_lambda_layer.py {shlex.join(argv)}', flush=True)
        served_backends(reset=True)
        try:
            main(argv)
        except Exception as e:  # one failing table (strict mode: a kernel that fails) costs only itself
            results.append(dict(execution=execution, settings=dict(dtype=dtype, batch=batch, mode=mode),
                                error=f'{type(e).__name__}: {e}'[:2000]))
            print(f'FAILED: {results[-1]["error"]}', flush=True)
        else:
            with open(path) as f:
                results.append(dict(json.load(f), execution=execution,  # what computed the calls, by direction
                                    served={'/'.join(k): n for k, n in served_backends().items()}))
        with open(os.path.join(out, 'layer_benchmarks.json'), 'w') as f:
            json.dump(results, f, indent=1)
    use_backend('auto', device)
    rows = []
    for width, side, stride in backbone_shapes(64 if tiny else 1024):
        for name, m in _candidates(width, stride, ['auto'], device).items():
            rows.append(graphed_step(f'{name} {width}ch {side}px s{stride}', m, (1, width, side, side), device, tiny))
    with open(os.path.join(out, 'graphs.json'), 'w') as f:
        json.dump(rows, f, indent=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--forms', nargs='+', default=['auto'], help='lambda implementations for the default table')
    p.add_argument('--image-size', type=int, default=1024,
                   help='the table: the lambda-layer shapes of a LambdaResNet at this input size (default 1024, the '
                        'detection setting; 512: those of the c4/c5 comparison of benchmark_models.py c4)')
    p.add_argument('--batch', type=int, default=None, help='default: 1 (table), 2 (sweep)')
    p.add_argument('--repeats', type=int, default=5)
    p.add_argument('--mode', default='train', choices=['train', 'eval'],
                   help='the table: training step (forward + backward) or eval inference (no_grad)')
    p.add_argument('--device', default='cpu')
    p.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16', 'float16'],
                   help='autocast dtype (float32: no autocast)')
    p.add_argument('--threads', type=int, default=None, help='torch.set_num_threads (CPU)')
    p.add_argument('--tf32', action='store_true',
                   help="CUDA float32: TF32 in matmuls too (torch's default allows it in cuDNN's convolutions only)")
    p.add_argument('--sweep', action='store_true')
    p.add_argument('--width', type=int, default=256, help='sweep width')
    p.add_argument('--scope', type=int, default=23, help='sweep scope')
    p.add_argument('--dim-u', type=int, default=1, help='sweep |u|')
    p.add_argument('--sizes', type=int, nargs='+', default=[8, 12, 14, 16, 18, 20, 22, 24, 28, 32, 40, 48, 64],
                   help='sweep: input sides (px)')
    p.add_argument('--plot', default=None, help='sweep: write the PNG plot here')
    p.add_argument('--json', default=None, help='also write the results here')
    p.add_argument('--memory-only', action='store_true', help='peak memory only, no timing (see above)')
    p.add_argument('--replot', default=None, help='sweep: plot the results of this --json file (no measurement)')
    p.add_argument('--gpu-check', default=None, metavar='DIR', help='the GPU check\'s tables into DIR (see gpu_check)')
    p.add_argument('--tiny', action='store_true', help='--gpu-check on the CPU at 64 px, one round (its dry run)')
    args = p.parse_args(argv)
    if args.gpu_check:
        return gpu_check(args.gpu_check, args.tiny)
    args.dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if args.batch is None:
        args.batch = 2 if args.sweep or args.replot else 1
    if args.memory_only:
        meta = dict(command=shlex.join(['python', 'benchmarks/benchmark_lambda_layer.py', *(sys.argv[1:] if argv is None
                                                                                    else argv)]),
                    date=time.strftime('%Y-%m-%d', time.gmtime()), machine=machine(args.device),
                    method='benchmarks/harness/measure.py: allocator events (torch.profiler, profile_memory)')
        results = memory_table(args)
        if args.json:
            record_memory(args.json, results, meta)
        return results
    if args.replot:
        with open(args.replot) as f:
            saved = json.load(f)
        _plot(saved['results'], args, saved['machine'])
        return saved['results']
    load_before = load_average()
    results, peak = (sweep(args), None) if args.sweep else detection_table(args)
    if args.json:
        keys = ('width', 'scope', 'dim_u', 'batch', 'repeats', 'device') if args.sweep else \
            ('forms', 'batch', 'repeats', 'device', 'mode', 'tf32')
        settings = dict({k: getattr(args, k) for k in keys}, dtype=str(args.dtype).replace('torch.', ''),
                        threads=torch.get_num_threads())
        command = shlex.join(['python', 'benchmarks/benchmark_lambda_layer.py',
                              *(sys.argv[1:] if argv is None else argv)])
        record = dict(command=command, date=time.strftime('%Y-%m-%d', time.gmtime()), commit=commit(),
                      load_before=load_before,
                      machine=machine(args.device), settings=settings)
        if not args.sweep:  # the table's yardstick (None where not measured: another device or dtype)
            record['fma_peak_gmac_per_s'] = peak
        with open(args.json, 'w') as f:
            json.dump(dict(record, results=results), f, indent=1, default=str)


if __name__ == '__main__':
    main()
