"""Peak memory of a training step of a stack of lambda layers, with and without activation checkpointing
(``torch.utils.checkpoint(use_reentrant=False)`` around each layer), next to the same stack of 3x3 convolutions: the
layer keeps everything its backward reads in ``save_for_backward``, so checkpointing frees it as it frees a
convolution's (issue 58 item 3). Each configuration in a fresh process: the growth of the process's peak resident
memory over one training step (after a warm-up step on a small input), median of the repeats; the gradients of the
checkpointed step equal the plain step's (checked here, float32, and in float64 by tests/test_plan.py).

    python benchmarks/checkpoint_memory.py [--layers 8] [--channels 128] [--size 48] [--batch 4] [--json FILE]
"""
import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import time


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _current_kib() -> int:
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') // 1024


def child(kind: str, checkpointed: bool, layers: int, channels: int, size: int, batch: int) -> dict:
    """One configuration: the step's peak growth (KiB) and a digest of its gradients."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from timm_lambda.layers import LambdaLayer
    torch.manual_seed(0)

    def block():
        if kind == 'lambda':
            return LambdaLayer(channels, dim_k=16, heads=4, scope=23)
        return torch.nn.Sequential(torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                                   torch.nn.BatchNorm2d(channels))
    stack = torch.nn.ModuleList(block() for _ in range(layers))

    def step(x):
        for p in stack.parameters():
            p.grad = None
        for layer in stack:
            x = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
        x.square().mean().backward()

    step(torch.randn(1, channels, 8, 8))  # (kernels loaded, plans made, thread pool started)
    x = torch.randn(batch, channels, size, size)
    before, peak_before = _current_kib(), _peak_kib()
    step(x)
    grads = torch.cat([p.grad.reshape(-1) for p in stack.parameters()])
    return dict(step_peak_kib=max(_peak_kib(), peak_before) - before, grad_sum=float(grads.double().abs().sum()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--layers', type=int, default=8)
    p.add_argument('--channels', type=int, default=128)
    p.add_argument('--size', type=int, default=48)
    p.add_argument('--batch', type=int, default=4)
    p.add_argument('--repeats', type=int, default=3)
    p.add_argument('--json', default=None)
    p.add_argument('--child', nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shape = (args.layers, args.channels, args.size, args.batch)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1] == '1', *shape)))
        return
    from harness.measure import commit, machine
    rows = []
    for kind in ('lambda', 'conv'):
        for checkpointed in (False, True):
            runs = []
            for _ in range(args.repeats):
                out = subprocess.run([sys.executable, __file__, '--child', kind, str(int(checkpointed)),
                                      '--layers', str(args.layers), '--channels', str(args.channels), '--size',
                                      str(args.size), '--batch', str(args.batch)], capture_output=True, text=True,
                                     check=True)
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            peaks = sorted(r['step_peak_kib'] for r in runs)
            rows.append(dict(kind=kind, checkpointed=checkpointed,
                             step_peak_mib=round(peaks[len(peaks) // 2] / 1024, 1),
                             runs_mib=[round(x / 1024, 1) for x in peaks], grad_sum=runs[0]['grad_sum']))
            print(f"{kind:6s} checkpointed={checkpointed!s:5s}: step peak {rows[-1]['step_peak_mib']} MiB "
                  f"(runs {rows[-1]['runs_mib']})", flush=True)
    for kind in ('lambda', 'conv'):
        plain, ckpt = (r for r in rows if r['kind'] == kind)
        print(f'{kind}: checkpointed / plain peak {ckpt["step_peak_mib"] / plain["step_peak_mib"]:.2f}; gradient sums '
              f'{plain["grad_sum"]:.6e} / {ckpt["grad_sum"]:.6e}')
        if abs(plain['grad_sum'] - ckpt['grad_sum']) > 1e-4 * abs(plain['grad_sum']):
            raise SystemExit(f'{kind}: the checkpointed step gives other gradients')
    if args.json:
        with open(args.json, 'w') as f:
            command = shlex.join(['python', 'benchmarks/checkpoint_memory.py'] + list(argv or sys.argv[1:]))
            json.dump(dict(command=command,
                           date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), commit=commit(),
                           machine=machine('cpu'), load=os.getloadavg(),
                           setting=f'{args.layers} layers of {args.channels} channels, batch {args.batch}, '
                                   f'{args.size}x{args.size}, float32, one training step (loss: mean of squares); '
                                   'lambda: LambdaLayer(dim_k=16, heads=4, scope=23), auto backend; conv: 3x3 conv + '
                                   'BatchNorm2d; peak: growth of the process peak RSS over the step',
                           rows=rows), f, indent=1)


if __name__ == '__main__':
    main()
