#!/usr/bin/env python
"""Evaluate a trained detector checkpoint (COCO bbox/segm metrics).

A thin stand-in for MMDetection's ``tools/test.py`` (which works with the
same configs, unchanged)::

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR]
"""
import argparse
import os.path as osp

from _common import add_runner_args, check_annotation_files, ensure_repo_on_path, load_config, parse_runner_args


def parse_args(argv=None):
    p = argparse.ArgumentParser(description='Test (evaluate) a detector')
    p.add_argument('config', help='config file path')
    p.add_argument('checkpoint', help='checkpoint file')
    p.add_argument('--work-dir', help='where to save the evaluation logs')
    p.add_argument('--out', help='dump predictions to this pickle file')
    add_runner_args(p, 'override config keys (mmengine DictAction syntax)')
    return parse_runner_args(p, argv)


def main(argv=None):
    ensure_repo_on_path()
    args = parse_args(argv)
    from mmengine.registry import RUNNERS
    from mmengine.runner import Runner

    if not osp.isfile(args.checkpoint) and '://' not in args.checkpoint:
        raise FileNotFoundError(
            f"checkpoint: file '{args.checkpoint}' does not exist")
    cfg = load_config(args)
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
