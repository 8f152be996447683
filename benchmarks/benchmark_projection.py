#!/usr/bin/env python
"""The lambda layer's 1x1 projection on CPU (timm_lambda/layers/projection.py): one step of ``Projection`` computed
as oneDNN's 1x1 convolution and as the batched matmul it takes where :func:`~timm_lambda.layers.projection.as_matmul`
says so, side by side in one process, interleaved; training step (forward, ``.float().sum()``, backward, the input
needing grad) and eval (``torch.no_grad``), float32 and bfloat16 autocast, at the LambdaResNet-101 1024 px layers'
projections (d -> h k + k + v: 256 -> 144 at 64x64, 512 -> 208 at 64x64 and 32x32) at batch 1 and a batch-8 one. A
bfloat16 call also as the convolution in float32, its result rounded (``float32``: what the layer takes where oneDNN
has no bfloat16 instructions, :func:`~timm_lambda.layers.projection.in_float32`).

    python benchmarks/benchmark_projection.py --threads 1 --repeats 9 --json docs/results/projection.json
    ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \
        python benchmarks/benchmark_projection.py --threads 1 --repeats 3 --json docs/results/projection_avx2.json

``matmul / conv`` below 1 is what the layer gains; ``taken`` records what the layer does on this machine (the held
libraries' variables are recorded under ``environment``).
"""
import argparse
import json
import os
import shlex
import sys
import time

SHAPES = [(1, 256, 144, 64), (1, 512, 208, 64), (1, 512, 208, 32), (8, 256, 144, 32)]


# the environment variables that hold oneDNN (and MKL, ATen) to a smaller instruction set: recorded with a run
HELD = ('ONEDNN_MAX_CPU_ISA', 'DNNL_MAX_CPU_ISA', 'MKL_ENABLE_INSTRUCTIONS', 'ATEN_CPU_CAPABILITY')


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--threads', type=int, default=1)
    p.add_argument('--repeats', type=int, default=9)
    p.add_argument('--dtypes', nargs='+', default=['float32', 'bfloat16'], choices=['float32', 'bfloat16'])
    p.add_argument('--json', help='write the results here')
    args = p.parse_args(argv)

    import torch

    from harness.measure import commit, cpu_model, interleaved_times, load_average, machine, spread
    from timm_lambda.layers import projection
    from timm_lambda.layers.position_lambda import plan

    torch.set_num_threads(args.threads)
    command = 'python ' + ' '.join(shlex.quote(a) for a in [os.path.relpath(__file__)] + sys.argv[1:])
    load_before = load_average()
    print(f'# {machine()}; oneDNN computes bfloat16 natively: {plan.native_bf16()}', flush=True)
    results = []
    for batch, d, out, size in SHAPES:
        for mode in ('train', 'eval'):
            for dtype_name in args.dtypes:
                dtype = getattr(torch, dtype_name)
                torch.manual_seed(0)
                module = projection.Projection(d, out)
                x = torch.randn(batch, d, size, size, requires_grad=mode == 'train')
                with torch.autocast('cpu', dtype=dtype, enabled=dtype != torch.float32):
                    chosen = projection.as_matmul(x)
                    taken = 'matmul' if chosen else 'float32' if projection.in_float32(x) else 'conv'

                def step(how, module=module, x=x, dtype=dtype, mode=mode):
                    def run():
                        x.grad = None
                        module.zero_grad(set_to_none=True)
                        with torch.autocast('cpu', dtype=dtype, enabled=dtype != torch.float32), \
                                torch.set_grad_enabled(mode == 'train'):
                            y = module._matmul(x) if how == 'matmul' else module._float32(x) if how == 'float32' \
                                else module._conv_forward(x, module.weight, None)
                        if mode == 'train':
                            y.float().sum().backward()
                    return run
                # a bfloat16 call also in float32 (the convolution's, rounded: where oneDNN has no bfloat16)
                hows = ('conv', 'matmul') + (('float32',) if dtype == torch.bfloat16 else ())
                times = interleaved_times({h: step(h) for h in hows}, args.repeats)
                ms = {k: round(1e3 * spread(v)[1], 3) for k, v in times.items()}
                row = dict(batch=batch, d=d, out=out, size=size, mode=mode, dtype=dtype_name, conv_ms=ms['conv'],
                           matmul_ms=ms['matmul'], ratio=round(ms['matmul'] / ms['conv'], 3), as_matmul=chosen,
                           taken=taken)
                if 'float32' in ms:
                    row.update(float32_ms=ms['float32'], float32_ratio=round(ms['float32'] / ms['conv'], 3))
                results.append(row)
                f32 = f", float32 {ms['float32']:.2f} ms ({row['float32_ratio']:.2f}x)" if 'float32' in ms else ''
                print(f"B{batch} {d}->{out} {size}x{size} {mode} {dtype_name}: conv {ms['conv']:.2f} ms, matmul "
                      f"{ms['matmul']:.2f} ms ({row['ratio']:.2f}x){f32}; the layer takes the {taken}", flush=True)
    if args.json:
        meta = dict(command=command, date=time.strftime('%Y-%m-%d %H:%M:%S %Z'), commit=commit(),
                    load_before=load_before, load_after=load_average(), machine=machine(), cpu=cpu_model(),
                    threads=args.threads, repeats=args.repeats, native_bf16=plan.native_bf16(),
                    environment={k: os.environ[k] for k in HELD if k in os.environ},
                    note='conv_ms, matmul_ms: median wall time of interleaved repeats of one step; ratio: matmul / '
                         'conv; as_matmul: what the layer computes on this machine')
        with open(args.json, 'w') as f:
            json.dump(dict(meta, results=results), f, indent=1)
            f.write('\n')


if __name__ == '__main__':
    main()
