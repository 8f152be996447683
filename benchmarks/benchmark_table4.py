#!/usr/bin/env python
"""LambdaNetworks Table 4 on this machine: lambda layers against global, axial and local self-attention in one
ResNet-50 frame at 224 px, beside the paper's figures.

Prints the markdown table (complexity class; memory: the paper's, the analytic figure its complexity gives
in its convention at batch 128, and the measured peak memory of one training step at ``--batch``; time per
training step and per inference forward as ratios to the lambda layer, beside the paper's throughput ratio),
writes the run with ``--json`` (docs/table4.md and docs/attention_baselines.md render it: python tools/generate.py)
and plots it to ``docs/table4.png``:

    python benchmarks/benchmark_table4.py --json docs/results/table4.json   # batch 2, about 10 minutes on 2 cores
    python benchmarks/benchmark_table4.py --batch 8 --max-gib 12 # global attention is then too large: not run
    python benchmarks/benchmark_table4.py --rows "Lambda layer" "Axial self-attention" --png ''
    python benchmarks/benchmark_table4.py --memory-only --json docs/results/table4_memory.json   # no timing

``--memory-only`` measures the peak training-step memory column alone (deterministic, so valid on a busy
machine) and writes neither the markdown nor the plot (they need the times).

A row whose training step is estimated above ``--max-gib`` is not run (the paper's "OOM"); the table shows
the analytic memory for it, marked. Method and conventions: benchmarks/harness/table4.py and
benchmarks/harness/measure.py.
"""
import argparse
import json
import os
import shlex
import sys
import time

import torch

import timm_lambda  # noqa: F401  (registers the models)
from harness.measure import commit
from harness.table4 import TABLE4_ROWS, markdown, markdown_document, plot, run_table4


def _result_args(argv):
    """The arguments that change the results (not the output paths), for the command line in the markdown."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a.split('=')[0] in ('--md', '--png', '--json'):
            skip = '=' not in a
            continue
        out.append(a)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--batch', type=int, default=2)
    p.add_argument('--img-size', type=int, default=224)
    p.add_argument('--repeats', type=int, default=3, help='interleaved timing rounds (medians)')
    p.add_argument('--max-gib', type=float, default=8.0, help='skip rows whose training step is estimated above this')
    p.add_argument('--rows', nargs='+', choices=list(TABLE4_ROWS), help='Table 4 layers to run (default: all)')
    p.add_argument('--no-infer', action='store_true', help='time training steps only')
    p.add_argument('--threads', type=int, default=None, help='torch.set_num_threads (default: torch default)')
    p.add_argument('--md', default='', help="a markdown page of the run (docs/table4.md renders the table from the "
                   "committed --json by python tools/generate.py)")
    p.add_argument('--png', default='docs/table4.png', help="plot output ('' to skip)")
    p.add_argument('--json', default='', help='raw results as JSON')
    p.add_argument('--memory-only', action='store_true', help='peak memory only, no timing, no --md / --png')
    args = p.parse_args(argv)
    if args.batch < 1 or args.img_size < 32 or args.repeats < 1:
        p.error('--batch and --repeats must be >= 1, --img-size >= 32')
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_table4(batch=args.batch, img_size=args.img_size, repeats=args.repeats, max_gib=args.max_gib,
                        infer=not args.no_infer, rows=args.rows, timing=not args.memory_only)
    given = argv if argv is not None else sys.argv[1:]
    result['command'] = shlex.join(['python', 'benchmarks/benchmark_table4.py', *given])
    result['date'] = time.strftime('%Y-%m-%d', time.gmtime())
    result['commit'] = commit()  # +dirty where tracked files differ from it
    print(markdown(result))
    if args.md and not args.memory_only:
        os.makedirs(os.path.dirname(args.md) or '.', exist_ok=True)
        command = shlex.join(['python', 'benchmarks/benchmark_table4.py', *_result_args(given)])
        with open(args.md, 'w') as f:
            f.write(markdown_document(result, command))
    if args.png and not args.memory_only:
        plot(result, args.png)
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(result, f, indent=1)


if __name__ == '__main__':
    main()
