#!/usr/bin/env python
"""timm's lambda networks against themselves converted to this package's layer, side by side in one process.

For each of timm's ``lambda_resnet26t``, ``lambda_resnet50ts`` and ``lambda_resnet26rpt_256`` (random weights: speed
does not depend on them), the model as timm builds it and the same model after
``timm_lambda.models.convert_timm_lambda_layers`` (its ``_fast`` twin, equal outputs): a training step (forward, a
scalar loss, backward; batch norms in training mode) and inference (eval mode, ``torch.no_grad``), in float32 and
under CPU bfloat16 autocast, timed in interleaved rounds (tools/dev/benchmarks/measure.py); medians and the ratio
timm / converted (> 1: the converted model is faster), the load average before and after each pair, and the largest
relative difference of the two models' eval outputs (float32) as a check that the same model was timed.

Each step is timed twice over: wall seconds (``time.perf_counter``, measure.py's) and the process's CPU seconds
(``time.process_time``). On a shared, loaded machine the wall time of a step depends on what else runs; with one
thread (``--threads 1``, the default) its CPU time is the work it did, and the ratio of CPU times is the figure to
quote there:

    python benchmarks/benchmark_timm_lambda.py --json docs/results/timm_lambda_models.json
    python benchmarks/benchmark_timm_lambda.py --models lambda_resnet50ts --dtypes float32 --repeats 3

``--layers``: instead of the models, each lambda layer of each model alone, timm's against its conversion, on the
input it gets in the model at ``--size`` (a training step: forward, a scalar loss, backward to the input and the
weights): where a converted model's time goes.
"""
import argparse
import copy
import json
import shlex
import sys
import time

import timm
import torch
from timm.layers.lambda_layer import LambdaLayer as TimmLayer

from harness.measure import commit, interleaved_times, load_average, machine, spread
from timm_lambda.models import convert_timm_lambda_layers

MODELS = ('lambda_resnet26t', 'lambda_resnet50ts', 'lambda_resnet26rpt_256')
KINDS = ('training step', 'inference')


def train_step(model, x, dtype):
    def run():
        model.train()
        model.zero_grad(set_to_none=True)
        with torch.autocast('cpu', dtype=dtype, enabled=dtype != torch.float32):
            out = model(x)
        out.float().mean().backward()
    return run


def infer_step(model, x, dtype):
    def run():
        model.eval()
        with torch.no_grad(), torch.autocast('cpu', dtype=dtype, enabled=dtype != torch.float32):
            model(x)
    return run


def cpu_timed(step, sink: list):
    """``step``, appending the process's CPU seconds of each call to ``sink``."""
    def run():
        t0 = time.process_time()
        step()
        sink.append(time.process_time() - t0)
    return run


def compare(name: str, size: int, batch: int, dtypes, repeats: int) -> list:
    torch.manual_seed(0)
    kwargs = dict(img_size=size) if 'rpt' in name else {}
    theirs = timm.create_model(name, zero_init_last=False, **kwargs)  # the lambda layers reach the output
    ours = convert_timm_lambda_layers(copy.deepcopy(theirs))
    x = torch.randn(batch, 3, size, size)
    with torch.no_grad():
        a, b = theirs.eval()(x), ours.eval()(x)
    diff = ((a - b).abs().max() / a.abs().max()).item()
    rows = []
    for dtype in dtypes:
        steps, cpu = {}, {}
        for label, model in (('timm', theirs), ('converted', ours)):
            for kind, make in (('training step', train_step), ('inference', infer_step)):
                key = f'{label}/{kind}'
                cpu[key] = []
                steps[key] = cpu_timed(make(model, x, dtype), cpu[key])
        before = load_average()
        times = interleaved_times(steps, repeats=repeats, warmup=1)
        after = load_average()
        cpu = {k: v[1:] for k, v in cpu.items()}  # without the warm-up call
        median = {k: spread(v)[1] for k, v in times.items()}
        cpu_median = {k: spread(v)[1] for k, v in cpu.items()}
        ratio = {kind: median[f'timm/{kind}'] / median[f'converted/{kind}'] for kind in KINDS}
        cpu_ratio = {kind: cpu_median[f'timm/{kind}'] / cpu_median[f'converted/{kind}'] for kind in KINDS}
        precision = 'float32' if dtype == torch.float32 else f'{str(dtype).split(".")[1]} autocast'
        print(f'# {name}: {size}x{size}, batch {batch}, {precision}; load {before} -> {after}')
        for kind in KINDS:
            wall = f'timm {median[f"timm/{kind}"]:.3f} s, converted {median[f"converted/{kind}"]:.3f} s'
            cpu_s = f'timm {cpu_median[f"timm/{kind}"]:.3f} s, converted {cpu_median[f"converted/{kind}"]:.3f} s'
            print(f'| {kind} | wall: {wall}, {ratio[kind]:.2f}x | CPU: {cpu_s}, {cpu_ratio[kind]:.2f}x |', flush=True)
        rows.append(dict(model=name, fast_model=f'{name}_fast', size=size, batch=batch, dtype=str(dtype),
                         autocast=dtype != torch.float32, machine=machine(), load_before=before, load_after=after,
                         times=times, median_s=median, timm_over_converted=ratio, cpu_times=cpu,
                         cpu_median_s=cpu_median, cpu_timm_over_converted=cpu_ratio, eval_max_rel_diff_float32=diff))
    return rows


def compare_layers(name: str, size: int, batch: int, dtypes, repeats: int) -> list:
    torch.manual_seed(0)
    kwargs = dict(img_size=size) if 'rpt' in name else {}
    model = timm.create_model(name, **kwargs).eval()
    inputs = {}
    hooks = [m.register_forward_pre_hook(lambda m, args, n=n: inputs.setdefault(n, args[0].detach()))
             for n, m in model.named_modules() if isinstance(m, TimmLayer)]
    with torch.no_grad():
        model(torch.randn(batch, 3, size, size))
    for h in hooks:
        h.remove()
    rows = []
    for dtype in dtypes:
        for n, x in inputs.items():
            theirs = model.get_submodule(n).train()
            ours = convert_timm_lambda_layers(copy.deepcopy(theirs))
            x = x.clone().requires_grad_()
            steps, cpu = {}, {}
            for label, layer in (('timm', theirs), ('converted', ours)):
                cpu[label] = []
                steps[label] = cpu_timed(train_step(layer, x, dtype), cpu[label])
            before = load_average()
            times = interleaved_times(steps, repeats=repeats, warmup=1)
            cpu = {k: v[1:] for k, v in cpu.items()}
            median = {k: spread(v)[1] for k, v in times.items()}
            cpu_median = {k: spread(v)[1] for k, v in cpu.items()}
            ratio = cpu_median['timm'] / cpu_median['converted']
            print(f'| {name} {n} {list(x.shape)} stride {ours.stride} {str(dtype)[6:]} | CPU: timm '
                  f'{cpu_median["timm"]:.3f} s, converted {cpu_median["converted"]:.3f} s, {ratio:.2f}x |', flush=True)
            rows.append(dict(model=name, layer=n, input_shape=list(x.shape), stride=ours.stride, scope=str(ours.scope),
                             size=size, dtype=str(dtype), kind='training step', machine=machine(), load_before=before,
                             load_after=load_average(), times=times, median_s=median, cpu_times=cpu,
                             cpu_median_s=cpu_median, cpu_timm_over_converted=ratio))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--models', nargs='+', default=list(MODELS), choices=MODELS)
    p.add_argument('--size', type=int, default=256, help="input side (timm's cfgs: 256)")
    p.add_argument('--batch', type=int, default=2)
    p.add_argument('--dtypes', nargs='+', default=['float32', 'bfloat16'], choices=['float32', 'bfloat16'])
    p.add_argument('--repeats', type=int, default=3, help='interleaved rounds (after one warm-up round)')
    p.add_argument('--threads', type=int, default=1, help='torch.set_num_threads (default 1: see above)')
    p.add_argument('--layers', action='store_true', help='each lambda layer alone (see above)')
    p.add_argument('--json', default=None, help='also write the results here')
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d) for d in args.dtypes]
    run = compare_layers if args.layers else compare
    results = [row for name in args.models for row in run(name, args.size, args.batch, dtypes, args.repeats)]
    if args.json:  # each row names the command, date and commit that produced it (the machine and loads too)
        command = shlex.join(['python', 'benchmarks/benchmark_timm_lambda.py',
                              *(sys.argv[1:] if argv is None else argv)])
        stamp = dict(command=command, date=time.strftime('%Y-%m-%d', time.gmtime()), commit=commit())
        with open(args.json, 'w') as f:
            json.dump([dict(r, **stamp) for r in results], f, indent=1, default=str)


if __name__ == '__main__':
    main()
