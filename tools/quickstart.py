#!/usr/bin/env python
"""Quick start: train a LambdaResNet Mask R-CNN on generated COCO-format data until it detects, evaluate it on
held-out images and draw its predictions (tools/_lib/quickstart.py: what is run and how it is scaled down).

    python tools/quickstart.py                      # about 2.5 minutes on 2 idle CPU cores (135 s, 2026-11-22)
    python tools/quickstart.py --iters 20 --num-train 16 --num-val 4   # a smoke test
"""
import argparse
import os.path as osp

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
    args = vars(p.parse_args(argv))
    return run(args.pop('config'), args.pop('work_dir'), **args)


if __name__ == '__main__':
    main()
