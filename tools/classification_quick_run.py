#!/usr/bin/env python
"""Classification quick run: a LambdaResNet learns a generated image-classification set on the CPU.

With no arguments this generates 8 classes of shapes and textures in random colours (32x32, 2048 training and
512 held-out images, deterministic for --seed), builds the CIFAR-10 report's LambdaResNet
(resnet50_lambda_global32: every 3x3 conv a lambda layer, global context) with one block per stage, and
trains it for 10 epochs with timm's own machinery (create_model, create_loader with timm's transforms,
create_optimizer_v2, create_scheduler_v2), printing held-out top-1 after every epoch and the final accuracy
against chance (12.5%). About 2 minutes on 2 CPU cores. The code is tools/_lib/quick_train.py.

    python tools/classification_quick_run.py [--epochs 10] [--threads 1] [--model resnet50_lambda_global32]
"""
import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time


def parse_args(argv=None):
    from _lib.quick_train import QuickRunConfig
    d = QuickRunConfig()
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', default=d.model, help='timm model name (default: %(default)s)')
    p.add_argument('--layers', type=int, nargs=4, default=list(d.model_kwargs['layers']), metavar='N',
                   help='blocks per stage c2..c5 (default: %(default)s; 3 4 6 3 is the full ResNet-50)')
    p.add_argument('--classes', type=int, default=d.num_classes, help='2..8 (default: %(default)s)')
    p.add_argument('--image-size', type=int, default=d.image_size)
    p.add_argument('--train-samples', type=int, default=d.train_samples)
    p.add_argument('--val-samples', type=int, default=d.val_samples)
    p.add_argument('--epochs', type=int, default=d.epochs)
    p.add_argument('--batch-size', type=int, default=d.batch_size)
    p.add_argument('--opt', default=d.opt)
    p.add_argument('--lr', type=float, default=d.lr)
    p.add_argument('--weight-decay', type=float, default=d.weight_decay)
    p.add_argument('--warmup-epochs', type=int, default=d.warmup_epochs)
    p.add_argument('--seed', type=int, default=d.seed)
    p.add_argument('--threads', type=int, default=None,
                   help="torch threads (default: torch's; 1 is faster when other jobs share the cores)")
    p.add_argument('--json', default=None, help='write the run (command, commit, machine, time, accuracies) here')
    return p.parse_args(argv)


def machine_load() -> str:
    try:
        return subprocess.run(['uptime'], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return 'load average: %.2f, %.2f, %.2f' % os.getloadavg()


def main(argv=None):
    args = parse_args(argv)
    import timm
    import torch

    from _lib.quick_train import QuickRunConfig, quick_train
    cfg = QuickRunConfig(
        model=args.model, model_kwargs={'layers': tuple(args.layers)}, num_classes=args.classes,
        image_size=args.image_size, train_samples=args.train_samples, val_samples=args.val_samples,
        epochs=args.epochs, batch_size=args.batch_size, opt=args.opt, lr=args.lr,
        weight_decay=args.weight_decay, warmup_epochs=args.warmup_epochs, seed=args.seed, threads=args.threads)
    print(f'[quick-run] {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, '
          f'torch {torch.__version__}, timm {timm.__version__}', flush=True)
    print(f'[quick-run] machine load before: {machine_load()}', flush=True)
    start = time.time()
    result = quick_train(cfg, log=lambda line: print('[quick-run] ' + line, flush=True))
    print(f'[quick-run] machine load after: {machine_load()}', flush=True)
    print(f'[quick-run] done in {time.time() - start:.0f}s: held-out top-1 {result["val_top1"]:.1f}% vs chance '
          f'{result["chance"]:.1f}%', flush=True)
    if args.json:
        from _lib.provenance import commit, load_average, machine
        record = dict(command=shlex.join(['python', 'tools/classification_quick_run.py']
                                         + list(sys.argv[1:] if argv is None else argv)),
                      date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), commit=commit(), machine=machine(),
                      load_after=load_average(), seconds=round(time.time() - start, 1), config=vars(args),
                      result={k: v for k, v in result.items() if isinstance(v, (int, float, list))})
        with open(args.json, 'w') as f:
            json.dump(record, f, indent=1, default=str)
            f.write('\n')
    return result


if __name__ == '__main__':
    main()
