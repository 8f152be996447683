#!/usr/bin/env python
"""LambdaResNets against their convolutional baselines, side by side in one process.

One command per comparison; each prints the times, the peak step memory and the ratios:

    python tools/benchmark_models.py backbone         # LambdaResNet-101 vs ResNet-RS-101 + SE, c2..c5 at 1024x1024, batch 1
    python tools/benchmark_models.py cifar            # resnet50_lambda (global scope, 32x32, 10 classes) vs resnet50, batch 64
    python tools/benchmark_models.py classification   # LambdaResNet-101 vs ResNet-RS-101 + SE at 224x224, batch 2

``backbone`` builds the backbones as the detection configs do (timm ``features_only``, c2..c5, BN in training
mode) and measures a training step (forward, a scalar loss over the four maps, backward), inference
(forward under ``no_grad``) and the peak memory of the training step. ``--sizes 512 768 1024 --plot f.png``
also plots time and memory against the input size. Method: timm_lambda/benchmarks/measure.py.
"""
import argparse
import json

import torch

import timm
from timm_lambda.benchmarks.measure import interleaved_times, machine, median, peak_step_bytes

COMPARISONS = {
    # name: (candidate, baseline, batch, input size, what is built)
    'backbone': (('lambdaresnet101', {}), ('resnetrs101', {}), 1, 1024, 'features'),
    'cifar': (('resnet50_lambda', dict(scope='global', img_size=32, num_classes=10)),
              ('resnet50', dict(num_classes=10)), 64, 32, 'classifier'),
    'classification': (('lambdaresnet101', {}), ('resnetrs101', {}), 2, 224, 'classifier'),
}


def _build(name, kwargs, kind, device):
    torch.manual_seed(0)
    if kind == 'features':
        kwargs = dict(kwargs, features_only=True, out_indices=(1, 2, 3, 4))
    return timm.create_model(name, **kwargs).to(device).train()


def _loss(out):
    return sum(o.float().mean() for o in out) if isinstance(out, (list, tuple)) else out.float().mean()


def compare(which, size, batch, device, repeats):
    (cand, cand_kw), (base, base_kw), default_batch, default_size, kind = COMPARISONS[which]
    size, batch = size or default_size, batch or default_batch
    models = {cand: _build(cand, cand_kw, kind, device), base: _build(base, base_kw, kind, device)}
    x = torch.randn(batch, 3, size, size, device=device)

    def train(m):
        def run():
            m.zero_grad(set_to_none=True)
            _loss(m(x)).backward()
        return run

    def infer(m):
        def run():
            with torch.no_grad():
                m(x)
        return run

    steps = {f'{n}/train': train(m) for n, m in models.items()}
    steps.update({f'{n}/infer': infer(m) for n, m in models.items()})
    times = interleaved_times(steps, repeats=repeats, device=device)
    out = dict(comparison=which, size=size, batch=batch, machine=machine(device))
    for n, m in models.items():
        params = list(m.parameters())
        m.zero_grad(set_to_none=True)
        peak = peak_step_bytes(train(m), exclude=[x, *params, *m.buffers()], device=device)
        out[n] = dict(train_s=median(times[f'{n}/train']), infer_s=median(times[f'{n}/infer']),
                      peak_mib=peak / 2 ** 20, params_m=sum(p.numel() for p in params) / 1e6)
    out['ratio'] = {k: out[cand][k] / out[base][k] for k in ('train_s', 'infer_s', 'peak_mib')}
    return out


def report(r):
    names = [k for k in r if isinstance(r[k], dict) and 'params_m' in r[k]]
    print(f"# {r['comparison']}: {r['size']}x{r['size']}, batch {r['batch']}; {r['machine']}")
    print('| model | params (M) | training step (s) | inference (s) | peak step memory (MiB) |')
    print('|---|---:|---:|---:|---:|')
    for n in names:
        m = r[n]
        print(f"| {n} | {m['params_m']:.2f} | {m['train_s']:.3f} | {m['infer_s']:.3f} | {m['peak_mib']:.0f} |")
    q = r['ratio']
    print(f"| **ratio** | | **{q['train_s']:.2f}x** | **{q['infer_s']:.2f}x** | **{q['peak_mib']:.2f}x** |", flush=True)


def _plot(rows, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    names = [k for k in rows[0] if isinstance(rows[0][k], dict) and 'params_m' in rows[0][k]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for n in names:
        sizes = [r['size'] for r in rows]
        axes[0].plot(sizes, [r[n]['train_s'] for r in rows], 'o-', label=f'{n} training step')
        axes[0].plot(sizes, [r[n]['infer_s'] for r in rows], 'x--', label=f'{n} inference')
        axes[1].plot(sizes, [r[n]['peak_mib'] for r in rows], 'o-', label=n)
    axes[0].set_ylabel('seconds')
    axes[1].set_ylabel('peak training-step memory (MiB)')
    for ax in axes:
        ax.set_xlabel('input side (px)')
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{rows[0]['comparison']}, batch {rows[0]['batch']}: {rows[-1]['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f'plot: {path}')


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('comparison', choices=sorted(COMPARISONS))
    p.add_argument('--sizes', type=int, nargs='+', default=[None], help='input sides (default: the comparison\'s)')
    p.add_argument('--batch', type=int, default=None)
    p.add_argument('--repeats', type=int, default=3)
    p.add_argument('--device', default='cpu')
    p.add_argument('--plot', default=None, help='with several --sizes: PNG of time and memory vs input size')
    p.add_argument('--json', default=None)
    args = p.parse_args(argv)
    rows = []
    for size in args.sizes:
        rows.append(compare(args.comparison, size, args.batch, args.device, args.repeats))
        report(rows[-1])
    if args.plot:
        _plot(rows, args.plot)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(rows, f, indent=1)


if __name__ == '__main__':
    main()
