#!/usr/bin/env python
"""Backbone cost at detection resolution: LambdaResNet vs ResNet-RS.

For each backbone (built through mmdet_plugin's TimmLambdaResNet, exactly as
the Table 14 configs build it, BatchNorm in train mode) this measures one
training step of the backbone alone at 1024x1024 (batch 1 by default):
forward to c2..c5, a scalar loss over the four maps, backward.

* time: wall-clock seconds per forward+backward (median of --repeats, after
  --warmup untimed steps).
* peak memory:
  - on CUDA, ``torch.cuda.max_memory_allocated`` during the step minus the
    memory allocated before it (parameters, input);
  - on CPU, peak bytes of *live tensor storages created during the step*,
    tracked by a ``TorchDispatchMode`` that sees every aten op (forward and
    backward), counts each new output storage once and releases it when the
    last tensor using it is freed. This is what the step adds on top of the
    parameters and the input: activations saved for backward, temporaries,
    gradients. It excludes allocator overhead/fragmentation and the memory
    of parameters/optimizer (the same for both kinds of model up to their
    parameter counts, reported separately). RSS or tracemalloc would not
    see torch's allocations reliably.

    python tools/benchmark_detection.py                      # 3 backbones
    python tools/benchmark_detection.py --device cuda --repeats 5
    python tools/benchmark_detection.py --models lambdaresnet101 --size 512
"""
import argparse
import json
import statistics
import sys
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, __import__('os').path.dirname(__file__))
from _common import ensure_repo_on_path  # noqa: E402

DEFAULT_MODELS = ['lambdaresnet101', 'resnetrs101', 'resnetrs101_nose']
LABELS = {
    'lambdaresnet101': 'LambdaResNet-101',
    'resnetrs101': 'ResNet-RS-101 + SE',
    'resnetrs101_nose': 'ResNet-RS-101 (no SE)',
    'lambdaresnet152': 'LambdaResNet-152',
    'resnetrs152': 'ResNet-RS-152 + SE',
    'resnetrs152_nose': 'ResNet-RS-152 (no SE)',
}


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages created by aten ops in the mode."""

    def __init__(self, ignore_ptrs=()):
        super().__init__()
        self.ignore = set(ignore_ptrs)
        self.live = {}  # storage data_ptr -> [nbytes, number of tensors]
        self.current = 0
        self.peak = 0

    def _release(self, ptr):
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == 'meta':
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0 or ptr in self.ignore:
                continue
            entry = self.live.get(ptr)
            if entry is None:
                entry = self.live[ptr] = [storage.nbytes(), 0]
                self.current += entry[0]
                self.peak = max(self.peak, self.current)
            entry[1] += 1
            weakref.finalize(t, self._release, ptr)
        return out


def step(model, x):
    outs = model(x)
    loss = sum(o.float().mean() for o in outs)
    loss.backward()
    return loss


def measure(name, size, batch, device, repeats, warmup, with_cp):
    import mmdet_plugin  # noqa: F401
    from mmdet.registry import MODELS
    torch.manual_seed(0)
    model = MODELS.build(
        dict(type='TimmLambdaResNet', model_name=name,
             norm_cfg=dict(type='BN', requires_grad=True), with_cp=with_cp))
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randn(batch, 3, size, size, device=device)

    def sync():
        if device == 'cuda':
            torch.cuda.synchronize()

    for _ in range(warmup):
        model.zero_grad(set_to_none=True)
        step(model, x)
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        step(model, x)
        sync()
        times.append(time.perf_counter() - t0)

    model.zero_grad(set_to_none=True)
    if device == 'cuda':
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(model, x)
        sync()
        peak = torch.cuda.max_memory_allocated() - base
        method = 'torch.cuda.max_memory_allocated'
    else:
        ignore = {t.untyped_storage().data_ptr()
                  for t in list(model.parameters()) + list(model.buffers())
                  + [x]}
        with LiveTensorBytes(ignore) as tracker:
            step(model, x)
        peak = tracker.peak
        method = 'live tensor bytes (TorchDispatchMode)'
    return dict(model=name, label=LABELS.get(name, name),
                params_m=round(n_params / 1e6, 2),
                fwd_bwd_s=round(statistics.median(times), 3),
                times_s=[round(t, 3) for t in times],
                peak_mib=round(peak / 2**20, 1), memory=method,
                size=size, batch=batch, device=device, with_cp=with_cp)


def main(argv=None):
    ensure_repo_on_path()
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--models', nargs='+', default=DEFAULT_MODELS)
    p.add_argument('--size', type=int, default=1024)
    p.add_argument('--batch', type=int, default=1)
    p.add_argument('--device', default=None,
                   help='cpu or cuda (default: cuda if available)')
    p.add_argument('--repeats', type=int, default=None,
                   help='timed steps (default: 5 on cuda, 1 on cpu)')
    p.add_argument('--warmup', type=int, default=None,
                   help='untimed steps first (default: 2 on cuda, 0 on cpu)')
    p.add_argument('--with-cp', action='store_true',
                   help='gradient checkpointing (with_cp=True)')
    p.add_argument('--json', help='also write the results to this file')
    args = p.parse_args(argv)
    device = args.device or ('cuda' if torch.cuda.is_available() else 'cpu')
    if device == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('--device cuda: no CUDA device available')
    repeats = args.repeats or (5 if device == 'cuda' else 1)
    warmup = args.warmup if args.warmup is not None else (
        2 if device == 'cuda' else 0)
    if args.size % 32:
        raise SystemExit(f'--size must be a multiple of 32, got {args.size}')
    rows = []
    for name in args.models:
        r = measure(name, args.size, args.batch, device, repeats, warmup,
                    args.with_cp)
        rows.append(r)
        print(json.dumps(r), flush=True)
    dev = torch.cuda.get_device_name() if device == 'cuda' else (
        f'CPU, {torch.get_num_threads()} threads')
    print(f'\nBackbone forward+backward, {args.size}x{args.size}, batch '
          f'{args.batch}, {dev}, with_cp={args.with_cp}\n')
    print('| backbone | params (M) | fwd+bwd (s) | peak memory (MiB) |')
    print('|---|---:|---:|---:|')
    for r in rows:
        print(f"| {r['label']} | {r['params_m']} | {r['fwd_bwd_s']} | "
              f"{r['peak_mib']} |")
    print(f"\npeak memory: {rows[0]['memory']}")
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == '__main__':
    main()
