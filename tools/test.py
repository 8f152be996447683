#!/usr/bin/env python
"""Evaluate a trained detector checkpoint (COCO bbox/segm metrics).

A thin stand-in for MMDetection's ``tools/test.py`` (which works with the
same configs, unchanged)::

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR]
"""
import argparse
import os
import os.path as osp

from _common import check_annotation_files, ensure_repo_on_path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description='Test (evaluate) a detector')
    p.add_argument('config', help='config file path')
    p.add_argument('checkpoint', help='checkpoint file')
    p.add_argument('--work-dir', help='where to save the evaluation logs')
    p.add_argument('--out', help='dump predictions to this pickle file')
    p.add_argument('--cfg-options', nargs='+', default=None,
                   help='override config keys (mmengine DictAction syntax)')
    p.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                   default='none', help='job launcher')
    p.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = p.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def main(argv=None):
    ensure_repo_on_path()
    args = parse_args(argv)
    from mmengine.config import Config, DictAction
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner

    from train import _parse_options

    if not osp.isfile(args.checkpoint) and '://' not in args.checkpoint:
        raise FileNotFoundError(
            f"checkpoint: file '{args.checkpoint}' does not exist")
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(_parse_options(args.cfg_options, DictAction))
    cfg.launcher = args.launcher
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir') is None:
        cfg.work_dir = osp.join('./work_dirs',
                                osp.splitext(osp.basename(args.config))[0])
    cfg.load_from = args.checkpoint
    check_annotation_files(cfg, splits=('test', ))
    runner = (Runner.from_cfg(cfg) if 'runner_type' not in cfg else
              RUNNERS.build(cfg))
    if args.out is not None:
        from mmengine.evaluator import DumpResults
        runner.test_evaluator.metrics.append(
            DumpResults(out_file_path=args.out))
    metrics = runner.test()
    return metrics


if __name__ == '__main__':
    main()
