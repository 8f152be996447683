"""Count the operators and kernels one lambda layer launches per step, on a CPU: the host-side cost that dominates the
layer on a GPU at small batches (docs/benchmarks.md, "GPU"). Two counts of a training step (forward, ``sum``, backward,
the gradients set to None first) and of an eval forward (also after ``reparameterize()``, the norms folded into the
projection), next to a 3x3 convolution's:

* ``operators``: what the dispatcher sees, the lambda operator (``timm_lambda::lambda_layer``) and its backward as
  one each; views, allocations and the norms' batch counters (``num_batches_tracked.add_``) left out;
* ``aten + Triton``: every aten operator that runs a kernel, inside the lambda operator too (views, allocations and
  other metadata-only operators left out; the batch counters in), and every Triton launch.

The issue's setting (``LambdaLayer(16, dim_k=16, heads=4, scope=23, form='tiled')``, a 4x4 map) and LambdaResNet-101's
three lambda-layer shapes (maps shrunk: the counts do not depend on the map size).

The Triton backends run under Triton's interpreter (``TRITON_INTERPRET=1``, set here before the package loads): the
launches are those a GPU would get, the times are not. Counts, not times: the same on every machine.

    python benchmarks/count_launches.py [--backends triton_tc gemm ...] [--json docs/results/launches.json]
"""
import os

os.environ.setdefault('TRITON_INTERPRET', '1')  # before timm_lambda loads: the Triton kernels run on CPU tensors

import argparse  # noqa: E402
import collections  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch._library.custom_ops import OPDEFS  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from harness.measure import commit, machine  # noqa: E402
from timm_lambda.layers import LambdaLayer, set_backend  # noqa: E402
from timm_lambda.layers.position_lambda import tiled_triton  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# LambdaResNet-101's lambda layers at 1024 px (c4 256 ch 64x64; c5's first, 512 ch stride 2; c5 512 ch 32x32), maps
# shrunk to keep the interpreter quick
SHAPES = [('16ch 4x4', 16, 1, 4), ('16ch 4x4 stride 2', 16, 2, 4), ('c4 256ch', 256, 1, 12),
          ('c5 512ch stride 2', 512, 2, 12), ('c5 512ch', 512, 1, 8)]
_NO_KERNEL = {'empty', 'empty_like', 'empty_strided', 'new_empty', 'new_empty_strided', 'detach', 'lift_fresh',
              'alias', 'promote_types', '_unsafe_view', 'set_', 'resize_', 'sym_size', 'sym_stride', 'sym_numel',
              'is_same_size'}


class Kernels(TorchDispatchMode):
    """Counts the aten operators that run a kernel, by name; ``operators``: the dispatcher's top level (this package's
    operators as one each, without the norms' integer batch counters), else the kernels inside them too."""

    def __init__(self, operators: bool = False):
        super().__init__()
        self.ops, self.paused, self.operators = collections.Counter(), False, operators

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.paused:  # the Triton interpreter's own copies to and from its host buffers
            return func(*args, **(kwargs or {}))
        if func.namespace == 'timm_lambda' and not self.operators:  # the kernels the implementation runs
            with self:
                return OPDEFS[func._schema.name]._init_fn(*args, **(kwargs or {}))
        counter = name == 'add_' and not args[0].is_floating_point()  # BatchNorm's num_batches_tracked += 1
        if not (func.is_view or name in _NO_KERNEL or (self.operators and counter)):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


_COUNTING = []
LAUNCHES = [0]  # Triton launches seen in this process (through the kernels' own run, below)


def _count_triton_launches():
    """Wrap the ``run`` of each Triton kernel (``tiled_triton.kernels()``: what ``kernel[grid](...)`` calls) so that a
    launch is counted and the interpreter's own copies to and from its host buffers are not counted as kernels."""
    kernels = tiled_triton.kernels()
    if kernels is None:
        return
    for key in ('query_rows', 'value_grad', 'tc_rows', 'tc_value_grad'):
        kernel = kernels[key]

        def run(*args, _run=kernel.run, **kwargs):
            mode = _COUNTING[-1] if _COUNTING else None
            if mode is not None:
                mode.paused = True
            try:
                return _run(*args, **kwargs)
            finally:
                if mode is not None:
                    mode.paused = False
                if not kwargs.get('warmup'):
                    LAUNCHES[0] += 1
        kernel.run = run


_count_triton_launches()


def count(module, x, train: bool, autocast: bool, operators: bool = False):
    """(aten kernels by name, Triton launches) of one step of ``module`` on ``x``; ``operators``: the dispatcher's
    top-level operators instead (:class:`Kernels`)."""
    def step():
        with torch.autocast('cpu', torch.float16, enabled=autocast):
            y = module(x)
        if train:
            y.float().sum().backward()
    def step_from_zero():  # as a training loop steps after optimizer.zero_grad(): no gradient accumulation
        for t in [x] + list(module.parameters()):
            t.grad = None
        step()
    module.train(train)
    with torch.set_grad_enabled(train):
        step_from_zero()  # first calls (caches, compiles) outside the count
        launches, mode = LAUNCHES[0], Kernels(operators)
        _COUNTING.append(mode)
        try:
            with mode:
                step_from_zero()
        finally:
            _COUNTING.pop()
    return mode.ops, LAUNCHES[0] - launches


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--backends', nargs='+', default=['triton_tc', 'cpu_kernel', 'gemm'])
    p.add_argument('--batch', type=int, default=1)
    p.add_argument('--json', default=None)
    p.add_argument('--ops', action='store_true', help='also list the aten operators of each count')
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    print('| shape | step | 3x3 conv: operators / aten | ' + ' | '.join(
        f'{b}: operators / aten + Triton' for b in args.backends) + ' |')
    print('|---|---|---:|' + '---:|' * len(args.backends))
    for label, ch, stride, side in SHAPES:
        x = torch.randn(args.batch, ch, side, side, requires_grad=True)
        layer = LambdaLayer(ch, ch, dim_k=16, heads=4, scope=23, stride=stride, form='tiled')
        if ch == 16:  # the setting: the layer's defaults
            layer = LambdaLayer(ch, dim_k=16, heads=4, scope=23, stride=stride, form='tiled')
        conv = torch.nn.Sequential(torch.nn.Conv2d(ch, ch, 3, stride, 1, bias=False))
        folded = copy.deepcopy(layer).eval()
        folded.reparameterize()  # its norms folded into the projection (timm's reparameterize_model)
        for mode, train, autocast in (('train f32', True, False), ('train 16-bit', True, True),
                                      ('eval f32', False, False), ('eval f32 reparameterized', False, False)):
            module = folded if 'reparameterized' in mode else layer
            conv_ops, _ = count(conv, x, train, autocast)
            conv_top, _ = count(conv, x, train, autocast, operators=True)
            row = dict(shape=label, channels=ch, stride=stride, mode=mode, conv=sum(conv_ops.values()),
                       conv_operators=sum(conv_top.values()), backends={})
            for backend in args.backends:
                set_backend(backend, strict=True)
                try:
                    top, _ = count(module, x, train, autocast, operators=True)
                    ops, launches = count(module, x, train, autocast)
                finally:
                    set_backend('auto')
                row['backends'][backend] = dict(operators=sum(top.values()), aten=sum(ops.values()), triton=launches,
                                                ops=dict(ops))
            rows.append(row)
            print(f"| {label} | {mode} | {row['conv_operators']} / {row['conv']} | " + ' | '.join(
                f"{r['operators']} / {r['aten']} + {r['triton']}" for r in row['backends'].values()) + ' |', flush=True)
            if args.ops:
                for backend, r in row['backends'].items():
                    print(f'    {backend}: ' + ', '.join(f'{k} {v}' for k, v in sorted(r['ops'].items())))
    if args.json:
        record = dict(command=shlex.join(['python', 'benchmarks/count_launches.py'] + list(argv or sys.argv[1:])),
                      date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), commit=commit(), machine=machine('cpu'),
                      batch=args.batch, note='kernel counts (machine-independent; Triton interpreted on a CPU)',
                      rows=rows)
        with open(args.json, 'w') as f:
            json.dump(record, f, indent=1)


if __name__ == '__main__':
    main()
