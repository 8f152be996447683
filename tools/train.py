#!/usr/bin/env python
"""Train a detector from an mmdet config with mmengine's Runner.

A thin stand-in for MMDetection's ``tools/train.py`` (which works with the
same configs, unchanged) for users who installed mmdet from a wheel without
its scripts. Distributed::

    torchrun --nproc-per-node 8 tools/train.py CONFIG --launcher pytorch
"""
import argparse

from _common import add_runner_args, check_annotation_files, ensure_repo_on_path, load_config, parse_runner_args


def parse_args(argv=None):
    p = argparse.ArgumentParser(description='Train a detector')
    p.add_argument('config', help='config file path')
    p.add_argument('--work-dir', help='where to save logs and checkpoints')
    p.add_argument('--amp', action='store_true',
                   help='mixed precision (AmpOptimWrapper, needs a GPU)')
    p.add_argument('--resume', nargs='?', type=str, const='auto',
                   help='resume from CHECKPOINT, or from the latest '
                   'checkpoint in the work dir if no path is given')
    add_runner_args(p, 'override config keys, e.g. train_cfg.max_iters=100 (mmengine DictAction syntax)')
    return parse_runner_args(p, argv)


def main(argv=None):
    ensure_repo_on_path()
    args = parse_args(argv)
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner

    cfg = load_config(args)
    if args.amp:
        cfg.optim_wrapper.type = 'AmpOptimWrapper'
        cfg.optim_wrapper.setdefault('loss_scale', 'dynamic')
    if args.resume == 'auto':
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        cfg.resume = True
        cfg.load_from = args.resume
    check_annotation_files(cfg)
    runner = (Runner.from_cfg(cfg) if 'runner_type' not in cfg else
              RUNNERS.build(cfg))
    runner.train()


if __name__ == '__main__':
    main()
