#!/usr/bin/env python
"""LambdaResNets against their convolutional baselines, side by side in one process, in every execution mode.

One command per comparison; each prints min / median / max over interleaved repeats, the ratios (of medians)
to the first baseline, and the load average before and after:

    python benchmarks/benchmark_models.py backbone         # 1024x1024, batch 1: c2..c5 features as detectors build them
    python benchmarks/benchmark_models.py classification   # 224x224, batch 2: classifiers
    python benchmarks/benchmark_models.py c4               # 512x512, batch 1: LambdaResNet-101-C4 vs its conv twin
    python benchmarks/benchmark_models.py c4 --dtype bfloat16   # the same under CPU autocast (bfloat16)
    python benchmarks/benchmark_models.py cifar            # resnet50_lambda (global 32x32 scope, 10 classes) vs
                                                      # resnet50, batch 64
    python benchmarks/benchmark_models.py compile          # torch.compile (inductor) training step, 512x512 batch 1
                                                      # (--sizes 1024)
    python benchmarks/benchmark_models.py onnx             # legacy and dynamo ONNX exports, onnxruntime, 224 and 512 px
    python benchmarks/benchmark_models.py cuda             # a GPU: float32 and bfloat16 autocast, img/s (never in CI)

``backbone``, ``classification`` and ``cifar`` measure a training step (BN in training mode: forward, a scalar
loss, backward), inference as users run it (eval mode, BN running statistics, ``torch.no_grad``) and the peak
memory of the training step. ``backbone`` compares LambdaResNet-101 with ResNet-RS-101 with SE (the paper's
Table 13 baseline), without SE, and with the model's own convolutional twin (every lambda layer a 3x3 conv), so
that the SE placement is not mistaken for lambda speed. Method: benchmarks/harness/measure.py.

``backbone`` and ``c4`` also time the candidate with its lambda layers skipped (each returns its input, subsampled
at stride 2: what no lambda layer can beat) and print, for each goal of the lambda-layer speed issue (below), the time
that goal leaves the lambda layers and the multiply-add rate their arithmetic (``torch.utils.flop_counter``, the
custom operators' exact counts) would need in it, next to the threads' float32 limit (benchmarks/harness/peak.py).

``--memory-only`` (``backbone``, ``classification``, ``cifar``): the peak training-step memory and no timing
(memory is deterministic, so it can be measured on a busy machine); with ``--json`` naming an existing result of
the same command, its ``peak_mib`` fields are replaced and the run recorded under ``memory``:

    python benchmarks/benchmark_models.py backbone --memory-only --json docs/results/backbone_1024.json
"""
import argparse
import json
import shlex
import sys
import time

import timm
import torch
from torch import nn

from harness.measure import (
    commit,
    graphed_step,
    interleaved_times,
    load_average,
    machine,
    peak_step_bytes,
    spread,
    step_macs,
)
from harness.peak import fma_peak_gmacs
from timm_lambda import LambdaLayer

LAMBDA101, RS101 = ('LambdaResNet-101', 'lambdaresnet101', {}), ('ResNet-RS-101+SE', 'resnetrs101', {})
RS101_NOSE = ('ResNet-RS-101 without SE', 'resnetrs101_nose', {})
CONV_TWIN = ('LambdaResNet-101 conv twin', 'lambdaresnet101', dict(lambda_blocks=(None,) * 4))

SKIPPED = dict(skip_lambda_layers=True)  # build(): the model with every lambda layer skipped (see below)
COMPARISONS = {
    # name: (models (label, timm name, kwargs), the first is the candidate, the second the baseline; batch, size, kind)
    'backbone': ([LAMBDA101, RS101, RS101_NOSE, CONV_TWIN,
                  ('LambdaResNet-101, lambda layers skipped', 'lambdaresnet101', SKIPPED)], 1, 1024, 'features'),
    'classification': ([LAMBDA101, RS101], 2, 224, 'classifier'),
    # every c4 and c5 block a lambda layer (where the layer dominates) against the same network with 3x3 convs
    'c4': ([('LambdaResNet-101-C4', 'lambdaresnet101_c4', {}),
            ('LambdaResNet-101-C4 conv twin', 'lambdaresnet101_c4', dict(lambda_blocks=(None,) * 4)),
            ('LambdaResNet-101-C4, lambda layers skipped', 'lambdaresnet101_c4', SKIPPED)], 1, 512, 'features'),
    'cifar': ([('resnet50_lambda global', 'resnet50_lambda', dict(scope='global', img_size=32, num_classes=10)),
               ('ResNet-50', 'resnet50', dict(num_classes=10))], 64, 32, 'classifier'),
}
# the goals of the lambda-layer speed issue: (candidate, baseline, {mode: the most candidate / baseline time})
GOALS = {
    'backbone': [(LAMBDA101[0], RS101[0], {'training step': 0.9, 'inference': 0.92}),
                 (LAMBDA101[0], RS101_NOSE[0], {'training step': 1.0, 'inference': 1.0})],
    'c4': [('LambdaResNet-101-C4', 'LambdaResNet-101-C4 conv twin', {'training step': 0.8, 'inference': 0.8})],
}


class SkippedLambda(nn.Module):
    """A lambda layer's stand-in that costs nothing: ``[B, C, H, W] -> [B, C, ceil(H/s), ceil(W/s)]`` by
    subsampling (the layers replaced here keep their width)."""

    def __init__(self, stride: int):
        super().__init__()
        self.stride = stride

    def forward(self, x):
        return x[:, :, ::self.stride, ::self.stride]


def build(name, kwargs, kind, device='cpu'):
    torch.manual_seed(0)
    kwargs = dict(kwargs)
    skip = kwargs.pop('skip_lambda_layers', False)
    if kind == 'features':
        kwargs.update(features_only=True, out_indices=(1, 2, 3, 4))
    model = timm.create_model(name, **kwargs)
    if skip:
        for parent in list(model.modules()):
            for child_name, child in parent.named_children():
                if isinstance(child, LambdaLayer):
                    assert child.dim == child.dim_out, 'a skipped lambda layer must keep the width'
                    setattr(parent, child_name, SkippedLambda(child.stride))
    return model.to(device)


def goal_budgets(which, rows, macs, skipped):
    """For each goal of ``which``: the lambda layers' time (candidate - ``skipped``) against the time the goal
    leaves them (goal x baseline - ``skipped``), and the multiply-add rate their arithmetic would need in it."""
    limit = fma_peak_gmacs() if next(iter(macs.values())) is not None else None
    print('# what the goals leave the lambda layers (medians; the skipped model is the candidate without them)'
          + (f'; float32 multiply-add limit of these threads: {limit:.0f} GMAC/s' if limit else ''))
    print('| goal | mode | lambda layers now (s) | goal leaves them (s) | their G multiply-adds | '
          'rate the goal needs (GMAC/s) |\n|---|---|---:|---:|---:|---:|')
    out = []
    for cand, base, goals in GOALS.get(which, []):
        for mode, ratio in goals.items():
            t = {k: spread(rows[k][mode])[1] for k in (cand, base, skipped)}
            now, budget = t[cand] - t[skipped], ratio * t[base] - t[skipped]
            gmacs = (macs[(cand, mode)] - macs[(skipped, mode)]) / 1e9 if limit else None
            # a budget <= 0: the model without lambda layers already misses the goal
            need = 'out of reach' if budget <= 0 else '-' if gmacs is None else f'{gmacs / budget:.0f}'
            print(f'| {cand} <= {ratio}x {base} | {mode} | {now:.3f} | {budget:.3f} | '
                  f"{'-' if gmacs is None else f'{gmacs:.2f}'} | {need} |")
            out.append(dict(candidate=cand, baseline=base, mode=mode, goal=ratio, lambda_s=now, budget_s=budget,
                            lambda_gmacs=gmacs, limit_gmac_per_s=limit))
    return out


def loss_of(out):
    return sum(o.float().mean() for o in out) if isinstance(out, (list, tuple)) else out.float().mean()


def train_step(model, x, dtype=torch.float32):
    def run():
        model.train()
        model.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
            out = model(x)
        loss_of(out).backward()
    return run


def infer_step(model, x, dtype=torch.float32):
    def run():
        model.eval()
        with torch.no_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
            model(x)
    return run


def table(title, rows, columns, baseline):
    """Print ``rows`` {label: {column: [seconds...]}}: min / median / max per cell, ratio of medians to
    ``baseline``'s row."""
    print(f'# {title}')
    print('| model | ' + ' | '.join(f'{c} (s) min / median / max | x {baseline}' for c in columns) + ' |')
    print('|---|' + '---|---|' * len(columns))
    for label, cells in rows.items():
        out = []
        for c in columns:
            lo, mid, hi = spread(cells[c])
            ref = spread(rows[baseline][c])[1]
            out += [f'{lo:.3f} / {mid:.3f} / {hi:.3f}', f'{mid / ref:.2f}x']
        print(f'| {label} | ' + ' | '.join(out) + ' |', flush=True)


def peak_memory(built, x, device, dtype=torch.float32):
    """Peak training-step memory (MiB) of each model, printed as a table."""
    print('| model | params (M) | peak training-step memory (MiB) |\n|---|---:|---:|')
    memory = {}
    for label, m in built.items():
        memory[label] = peak_step_bytes(train_step(m, x, dtype), device=device) / 2 ** 20
        print(f'| {label} | {sum(p.numel() for p in m.parameters()) / 1e6:.2f} | {memory[label]:.0f} |', flush=True)
    return memory


def compare(which, size, batch, device, repeats, memory_only=False, dtype=torch.float32, only=None):
    models, default_batch, default_size, kind = COMPARISONS[which]
    if only:  # a subset of the comparison's models (the baseline, the second, is kept for the ratios)
        unknown = set(only) - {m[0] for m in models}
        if unknown:
            raise SystemExit(f'--models: {sorted(unknown)} not in {which}: {[m[0] for m in models]}')
        models = [m for i, m in enumerate(models) if m[0] in only or i == 1]
    size, batch = size or default_size, batch or default_batch
    built = {label: build(name, kw, kind, device) for label, name, kw in models}
    x = torch.randn(batch, 3, size, size, device=device)
    if memory_only:
        print(f'# {which}: {size}x{size}, batch {batch}; {machine(device)}')
        return dict(comparison=which, size=size, batch=batch, peak_mib=peak_memory(built, x, device, dtype))
    steps = {}
    for label, m in built.items():
        steps[(label, 'training step')] = train_step(m, x, dtype)
        steps[(label, 'inference')] = infer_step(m, x, dtype)
    before = load_average()
    times = interleaved_times(steps, repeats=repeats, device=device)
    rows = {label: {kind_: times[(label, kind_)] for kind_ in ('training step', 'inference')} for label in built}
    precision = '' if dtype == torch.float32 else f', {str(dtype).split(".")[1]} autocast'
    table(f'{which}: {size}x{size}, batch {batch}{precision}; {machine(device)} (load before: {before})', rows,
          ['training step', 'inference'], models[1][0])
    after = load_average()
    skipped = [label for label, _, kw in models if kw.get('skip_lambda_layers')]
    budgets = None
    if skipped:
        counted = {label for cand, _, _ in GOALS.get(which, []) for label in (cand, skipped[0])}
        macs = {k: step_macs(step) if device == 'cpu' and dtype == torch.float32 else None  # the float32 limit
                for k, step in steps.items() if k[0] in counted}
        budgets = goal_budgets(which, rows, macs, skipped[0])
    memory = peak_memory(built, x, device, dtype)
    print(f'load average after the timing: {after}\n', flush=True)
    from timm_lambda.layers.position_lambda import cpu_kernel
    flags = set(cpu_kernel._cpu_flags().partition(':')[2].split())
    return dict(comparison=which, size=size, batch=batch, dtype=str(dtype), machine=machine(device), load_before=before,
                load_after=after, times={f'{k[0]}/{k[1]}': v for k, v in times.items()}, peak_mib=memory,
                goal_budgets=budgets, models=[m[0] for m in models],
                cpu_flags=sorted(flags & {'avx2', 'fma', 'avx512f', 'avx512_bf16', 'amx_bf16', 'amx_tile'}),
                cpu_kernel_path=list(cpu_kernel.compute_path(dtype)) if device == 'cpu' else None)


def compile_comparison(size, batch, device, repeats):
    """Inductor (default mode) training steps of the classifiers: compiled LambdaResNet-101, compiled
    ResNet-RS-101+SE, eager LambdaResNet-101; and each compiled model's first step (compilation included)."""
    batch = batch or 1
    x = torch.randn(batch, 3, size, size, device=device)
    before = load_average()
    steps, first = {}, {}
    for label, name, kw in (LAMBDA101, RS101):
        model = build(name, kw, 'classifier', device)
        compiled = torch.compile(model)
        t0 = time.perf_counter()
        train_step(compiled, x)()
        first[label] = time.perf_counter() - t0
        print(f'{label}: first compiled training step {first[label]:.1f} s', flush=True)
        steps[f'{label} compiled'] = train_step(compiled, x)
    steps['LambdaResNet-101 eager'] = train_step(build(LAMBDA101[1], {}, 'classifier', device), x)
    times = interleaved_times(steps, repeats=repeats, device=device)
    rows = {label: {'training step': t} for label, t in times.items()}
    table(f'torch.compile (inductor): training step {size}x{size}, batch {batch}; {machine(device)} '
          f'(load before: {before})', rows, ['training step'], 'ResNet-RS-101+SE compiled')
    ratio = first[LAMBDA101[0]] / first[RS101[0]]
    print(f'first compiled step: {first[LAMBDA101[0]]:.1f} s vs {first[RS101[0]]:.1f} s = {ratio:.2f}x; '
          f'load average after: {load_average()}\n', flush=True)
    return dict(comparison='compile', size=size, batch=batch, machine=machine(device), load_before=before,
                load_after=load_average(), times=times, first_step_s=first)


def onnx_comparison(sizes, repeats, export_size=224, workdir='/tmp'):
    """Both exporters (legacy TorchScript-based and dynamo), dynamic H/W, run by onnxruntime with as many
    threads as torch uses; checks every exported model against eager at every size (relative error)."""
    import onnxruntime as ort
    threads = torch.get_num_threads()
    example = torch.randn(1, 3, export_size, export_size)
    sessions, eager = {}, {}
    for label, name, kw in (LAMBDA101, RS101):
        model = build(name, kw, 'classifier').eval()
        eager[label] = model
        for exporter in ('legacy', 'dynamo'):
            path = f'{workdir}/{name}_{exporter}.onnx'
            if exporter == 'legacy':
                torch.onnx.export(model, (example,), path, dynamo=False, opset_version=17, input_names=['x'],
                                  output_names=['y'], dynamic_axes={'x': {0: 'b', 2: 'h', 3: 'w'}})
            else:
                dim = torch.export.Dim.DYNAMIC
                torch.onnx.export(model, (example,), path, dynamo=True, input_names=['x'], output_names=['y'],
                                  dynamic_shapes={'x': {0: dim, 2: dim, 3: dim}})
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
            # four sessions take turns in one process: an idle session's threads must not spin on the cores
            options.add_session_config_entry('session.intra_op.allow_spinning', '0')
            sessions[f'{label} {exporter}'] = ort.InferenceSession(path, options, providers=['CPUExecutionProvider'])
    results = []
    for size in sizes:
        x = torch.randn(1, 3, size, size)
        feed = {'x': x.numpy()}
        errors = {}
        for key, session in sessions.items():
            with torch.no_grad():
                ref = eager[key.rsplit(' ', 1)[0]](x)
            got = torch.from_numpy(session.run(None, feed)[0])
            errors[key] = float((got - ref).abs().max() / ref.abs().max())
        before = load_average()
        steps = {key: (lambda s=session: s.run(None, feed)) for key, session in sessions.items()}
        times = interleaved_times(steps, repeats=repeats)
        for exporter in ('legacy', 'dynamo'):
            rows = {label: {'inference': times[f'{label} {exporter}']} for label, _, _ in (LAMBDA101, RS101)}
            table(f'onnxruntime, {exporter} export (dynamic H/W, made at {export_size} px), {size}x{size}, batch 1, '
                  f'{threads} threads; {machine()} (load before: {before})', rows, ['inference'], RS101[0])
        print('max relative error vs eager: ' + ', '.join(f'{k} {v:.1e}' for k, v in errors.items()))
        print(f'load average after: {load_average()}\n', flush=True)
        results.append(dict(size=size, machine=machine(), load_before=before, load_after=load_average(),
                            times=times, max_rel_error=errors))
    return results


def cuda_comparison(device, repeats, backbone_batch, classifier_batch, sizes=(1024, 224)):
    """Throughput on an accelerator, float32 and bfloat16 autocast: LambdaResNet-101 vs ResNet-RS-101+SE at
    1024 px (backbone training step and inference), our LambdaResNet-50 vs timm's lambda_resnet50ts at 224 px
    (classifier training step and inference)."""
    results = []
    groups = [('backbone', [LAMBDA101, RS101], 'features', backbone_batch, sizes[0]),
              ('classification', [('LambdaResNet-50', 'lambdaresnet50', {}),
                                  ("timm's lambda_resnet50ts", 'lambda_resnet50ts', {})],
               'classifier', classifier_batch, sizes[1])]
    for which, models, kind, batch, size in groups:
        built = {label: build(name, kw, kind, device) for label, name, kw in models}
        x = torch.randn(batch, 3, size, size, device=device)
        for dtype in (torch.float32, torch.bfloat16):
            steps = {}
            for label, m in built.items():
                steps[(label, 'training step')] = train_step(m, x, dtype)
                steps[(label, 'inference')] = infer_step(m, x, dtype)
            before = load_average()
            times = interleaved_times(steps, repeats=repeats, warmup=min(3, repeats), device=device)
            rows = {label: {k: times[(label, k)] for k in ('training step', 'inference')} for label in built}
            table(f'{which}, {str(dtype).split(".")[-1]}: {size}x{size}, batch {batch}; {machine(device)} '
                  f'(load before: {before})', rows, ['training step', 'inference'], models[1][0])
            print('| model | training img/s | inference img/s |\n|---|---:|---:|')
            for label in built:
                print(f"| {label} | {batch / spread(rows[label]['training step'])[1]:.1f} | "
                      f"{batch / spread(rows[label]['inference'])[1]:.1f} |")
            print(flush=True)
            results.append(dict(comparison=which, dtype=str(dtype), size=size, batch=batch, machine=machine(device),
                                times={f'{k[0]}/{k[1]}': v for k, v in times.items()}))
    return results


def graphs_comparison(device, repeats, sizes=(1024,), reduce_overhead=False):
    """Batch 1, the launch overhead: each model's training step eager against the same step replayed from a CUDA
    graph (:func:`harness.measure.graphed_step`; float32, TF32 in matmuls and convolutions): LambdaResNet-101 and
    ResNet-RS-101+SE feature extractors at ``sizes[0]`` px, LambdaResNet-101-C4 and its conv twin at half that.
    ``reduce_overhead``: LambdaResNet-101's features alone (the detection backbone), also under
    ``torch.compile(mode='reduce-overhead')``: which of the two to use for detection training at 1-2 images a GPU."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    size = sizes[0]
    dry_run = device == 'cpu'  # no graphs on a CPU: eager twice (the GPU check's dry run)
    cases = [(label, name, kw, size) for label, name, kw in (LAMBDA101, RS101)]
    cases += [(label, name, kw, size // 2 if size > 64 else size) for label, name, kw in COMPARISONS['c4'][0][:2]]
    if reduce_overhead:
        cases = cases[:1]
    rows = [graphed_step(f'{label} features {s}px', build(name, kw, 'features', device), (1, 3, s, s), device,
                         dry_run, repeats, reduce_overhead) for label, name, kw, s in cases]
    print(f'# CUDA graphs, batch 1, training step: {machine(device)}')
    return [dict(comparison='graphs', machine=machine(device), rows=rows)]


def record_memory(path, results, meta):
    """Write ``results`` to ``path``, or where it holds results of the same command, replace their ``peak_mib``
    (and record the memory run's ``meta`` under ``memory`` in each)."""
    try:
        with open(path) as f:
            saved = json.load(f)
    except FileNotFoundError:
        saved = [dict(r, machine=meta['machine']) for r in results]
    else:
        by_key = {(r['comparison'], r['size'], r['batch']): r for r in saved}
        for r in results:
            by_key[(r['comparison'], r['size'], r['batch'])]['peak_mib'] = r['peak_mib']
    for r in saved:
        r['memory'] = meta
    with open(path, 'w') as f:
        json.dump(saved, f, indent=1, default=str)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('comparison', choices=sorted(COMPARISONS) + ['compile', 'onnx', 'cuda', 'graphs'])
    p.add_argument('--sizes', type=int, nargs='+', default=None, help="input sides (default: the comparison's)")
    p.add_argument('--batch', type=int, default=None)
    p.add_argument('--repeats', type=int, default=5, help='interleaved rounds (>= 5 for reported figures)')
    p.add_argument('--device', default=None, help="default: cpu ('cuda' for the cuda comparison)")
    p.add_argument('--threads', type=int, default=None, help='torch.set_num_threads (CPU)')
    p.add_argument('--classifier-batch', type=int, default=64, help='cuda: batch of the 224 px classifiers')
    p.add_argument('--json', default=None, help='also write the results here')
    p.add_argument('--reduce-overhead', action='store_true',
                   help="graphs: LambdaResNet-101's features also under torch.compile(mode='reduce-overhead')")
    p.add_argument('--memory-only', action='store_true', help='peak memory only, no timing (see above)')
    p.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16'],
                   help=f'{", ".join(sorted(COMPARISONS))}: bfloat16 runs both models under autocast')
    p.add_argument('--models', nargs='+', default=None,
                   help=f'{", ".join(sorted(COMPARISONS))}: time only these of its models (labels, e.g. '
                        f'"{LAMBDA101[0]}"), and its baseline')
    args = p.parse_args(argv)
    if args.memory_only and args.comparison not in COMPARISONS:
        p.error(f'--memory-only applies to {sorted(COMPARISONS)}')
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ('cuda' if args.comparison in ('cuda', 'graphs') else 'cpu')
    if args.comparison == 'compile':
        results = [compile_comparison(s, args.batch, device, args.repeats) for s in args.sizes or [512]]
    elif args.comparison == 'onnx':
        results = onnx_comparison(args.sizes or [224, 512], args.repeats)
    elif args.comparison == 'graphs':
        results = graphs_comparison(device, args.repeats, args.sizes or (1024,), args.reduce_overhead)
    elif args.comparison == 'cuda':
        results = cuda_comparison(device, args.repeats, args.batch or 4, args.classifier_batch,
                                  tuple(args.sizes) if args.sizes else (1024, 224))
    else:
        results = [compare(args.comparison, s, args.batch, device, args.repeats, args.memory_only,
                           getattr(torch, args.dtype), args.models) for s in args.sizes or [None]]
    if args.json and args.memory_only:
        command = shlex.join(['python', 'benchmarks/benchmark_models.py', *(sys.argv[1:] if argv is None else argv)])
        record_memory(args.json, results, dict(
            command=command, date=time.strftime('%Y-%m-%d', time.gmtime()), machine=machine(device),
            method='benchmarks/harness/measure.py: allocator events (torch.profiler, profile_memory)'))
    elif args.json:  # each row names the command, date and commit that produced it (the machine and loads too)
        command = shlex.join(['python', 'benchmarks/benchmark_models.py', *(sys.argv[1:] if argv is None else argv)])
        stamp = dict(command=command, date=time.strftime('%Y-%m-%d', time.gmtime()), commit=commit())
        with open(args.json, 'w') as f:
            json.dump([dict(r, **stamp) for r in results], f, indent=1, default=str)


if __name__ == '__main__':
    main()
