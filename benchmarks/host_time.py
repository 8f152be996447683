"""One lambda layer's eager step against the 3x3 convolution it replaces, where the arithmetic is negligible: what a
step costs beyond its kernels (on a GPU at small batches the layer is bound by this host time: docs/benchmarks.md,
"GPU"). ``LambdaLayer(16, dim_k=16, heads=4, scope=23, form='tiled')`` against ``nn.Conv2d(16, 16, 3)`` on a 4x4 map,
batch 1, stride 1 and 2: a training step (forward, ``sum``, backward, gradients set to None first, as after
``optimizer.zero_grad()``) and an eval forward (``no_grad``; also of the layer after ``reparameterize()``), side by
side in one process, interleaved rounds, one thread, CPU time of the thread (``time.thread_time``: what a loaded
machine's other processes take is not counted).

    python benchmarks/host_time.py [--backend cpu_kernel] [--json docs/results/host_time.json]
"""
import argparse
import copy
import json
import os
import shlex
import sys
import time

import torch

from harness.measure import commit, machine
from timm_lambda.layers import LambdaLayer, set_backend


def _steps(module, x, train: bool):
    params = [x] + list(module.parameters())

    def step():
        for p in params:
            p.grad = None
        module(x).sum().backward()

    def forward():
        with torch.no_grad():
            module(x)
    module.train(train)
    return step if train else forward


def _lambda_layer(*args, form: str, **kwargs):
    """``LambdaLayer(..., form=form)``; ``impl=`` for a version of the package before ``form`` (``PYTHONPATH`` of an
    older checkout: the numbers before a change)."""
    try:
        return LambdaLayer(*args, form=form, **kwargs)
    except TypeError:
        return LambdaLayer(*args, impl=form, **kwargs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--backend', default='cpu_kernel', help="the position lambdas' backend (set_backend)")
    p.add_argument('--rounds', type=int, default=15)
    p.add_argument('--steps', type=int, default=200, help='steps a round and candidate')
    p.add_argument('--json', default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    set_backend(args.backend, strict=True)
    torch.manual_seed(0)
    load = os.getloadavg()
    rows = []
    for stride in (1, 2):
        x = torch.randn(1, 16, 4, 4, requires_grad=True)
        candidates = {'conv': torch.nn.Conv2d(16, 16, 3, stride, 1, bias=False),
                      'lambda': _lambda_layer(16, dim_k=16, heads=4, scope=23, form='tiled', stride=stride)}
        folded = copy.deepcopy(candidates['lambda'])
        folded.reparameterize()  # the norms folded into the projection (timm's reparameterize_model)
        for mode in ('train', 'eval'):
            fns = {name: _steps(m, x, mode == 'train') for name, m in candidates.items()}
            if mode == 'eval':
                fns['reparameterized'] = _steps(folded, x, False)
            times = {name: [] for name in fns}
            for r in range(args.rounds + 3):  # rounds 0-2: warm-up
                for name in (list(fns) if r % 2 else list(fns)[::-1]):
                    t = time.thread_time()
                    for _ in range(args.steps):
                        fns[name]()
                    if r >= 3:
                        times[name].append((time.thread_time() - t) / args.steps * 1e6)
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            rows.append(dict(stride=stride, mode=mode, us={k: round(v, 1) for k, v in med.items()},
                             min_us={k: round(min(v), 1) for k, v in times.items()},
                             ratio=round(med['lambda'] / med['conv'], 2)))
            if 'reparameterized' in med:
                rows[-1]['ratio_reparameterized'] = round(med['reparameterized'] / med['conv'], 2)
            print(f"stride {stride} {mode}: conv {med['conv']:.0f} us, lambda layer {med['lambda']:.0f} us "
                  f"({rows[-1]['ratio']:.2f}x)" + (f", reparameterized {med['reparameterized']:.0f} us "
                                                  f"({rows[-1]['ratio_reparameterized']:.2f}x)"
                                                  if 'reparameterized' in med else ''), flush=True)
    set_backend('auto')
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(command=shlex.join(['python', 'benchmarks/host_time.py'] + list(argv or sys.argv[1:])),
                           date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), commit=commit(),
                           machine=machine('cpu'), load_before=load, load_after=os.getloadavg(),
                           setting="LambdaLayer(16, dim_k=16, heads=4, scope=23, form='tiled') vs nn.Conv2d(16, 16, 3, "
                                   'stride, 1, bias=False), input 1x16x4x4; train: forward, sum, backward (grads set '
                                   'to None first); eval: forward under no_grad, also of the layer after '
                                   'reparameterize() (its norms folded into the projection); 1 thread; medians of the '
                                   f'rounds, CPU time of the thread; backend {args.backend}',
                           rows=rows), f, indent=1)


if __name__ == '__main__':
    main()
