#!/usr/bin/env python
"""Quick start: train a LambdaResNet Mask R-CNN on generated COCO-format data until it detects, evaluate it on
held-out images and draw its predictions (tools/_lib/quickstart.py: what is run and how it is scaled down).

    python tools/quickstart.py                      # a few minutes on 2 CPU cores
    python tools/quickstart.py --iters 20 --num-train 16 --num-val 4   # a smoke test
    python tools/quickstart.py --json docs/results/quickstart.json     # also record the run (the README's figures)
"""
import argparse
import json
import os.path as osp
import shlex
import sys
import time

from _lib.provenance import commit, load_average, machine
from _lib.quickstart import CONFIG_NAME, DEFAULTS, run

CONFIG = osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))), 'configs', 'mmdet', CONFIG_NAME)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--work-dir', default='work_dirs/quickstart')
    p.add_argument('--config', default=CONFIG)
    p.add_argument('--model', default=DEFAULTS['model'], help='timm backbone name (default: %(default)s)')
    for key in ('iters', 'image_size', 'batch_size', 'num_train', 'num_val', 'seed', 'warmup_iters', 'head_channels',
                'mask_convs'):
        p.add_argument('--' + key.replace('_', '-'), type=int, default=DEFAULTS[key])
    p.add_argument('--lr', type=float, default=DEFAULTS['lr'])
    p.add_argument('--json', default=None, help='write the run (command, commit, machine, time, COCO metrics) here')
    args = vars(p.parse_args(argv))
    path, load_before, t0 = args.pop('json'), load_average(), time.perf_counter()
    out = run(args.pop('config'), args.pop('work_dir'), **args)
    if path:
        given = list(sys.argv[1:] if argv is None else argv)
        record = dict(command=shlex.join(['python', 'tools/quickstart.py'] + given),
                      date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), commit=commit(), machine=machine(),
                      load_before=load_before, load_after=load_average(), seconds=round(time.perf_counter() - t0, 1),
                      settings=dict(DEFAULTS, **args), metrics={k: v for k, v in out['metrics'].items()
                                                                if isinstance(v, (int, float))})
        with open(path, 'w') as f:
            json.dump(record, f, indent=1, default=str)
            f.write('\n')
    return out


if __name__ == '__main__':
    main()
