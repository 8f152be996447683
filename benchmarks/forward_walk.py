"""Count the files one lambda layer call passes through (CPU): the package's Python frames, in the order they run, as
"stays" (consecutive frames in one file), the files, and the returns to a file already left. An eval forward
(``no_grad``) and a training step (forward, then backward), each direction counted on its own.

    python benchmarks/forward_walk.py [--form auto|tiled|dense|einsum|conv] [--path] [--json FILE]

``PYTHONPATH=/path/to/other/checkout python benchmarks/forward_walk.py`` walks another version of the package (the
numbers before and after a change, side by side).
"""
import argparse
import json
import os
import shlex
import sys
import time

import torch

import timm_lambda
from harness.measure import commit, machine
from timm_lambda.layers import LambdaLayer


def _walk(root: str, fn) -> list:
    """The package's files, in the order their frames run during ``fn()``."""
    seq = []

    def inside(frame):
        while frame is not None and not frame.f_code.co_filename.startswith(root):
            frame = frame.f_back
        return frame

    def tracer(frame, event, arg):
        if event == 'call' and frame.f_code.co_filename.startswith(root):
            seq.append(os.path.relpath(frame.f_code.co_filename, root))
            return tracer
        if event == 'return':
            back = inside(frame.f_back)
            if back is not None:
                seq.append(os.path.relpath(back.f_code.co_filename, root))
        return tracer if event != 'call' else None

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return seq


def count(seq: list) -> dict:
    """Stays (runs of one file), files and the returns to a file already left."""
    stays, left, returns = [], set(), 0
    for f in seq:
        if stays and stays[-1] == f:
            continue
        returns += f in left
        if stays:
            left.add(stays[-1])
        stays.append(f)
    return dict(stays=len(stays), files=len(set(stays)), returns=returns, path=stays)


def walk(form: str) -> dict:
    """The counts of an eval forward and of a training step's forward and backward of ``LambdaLayer(64, dim_k=16,
    heads=4, scope=7)`` on a 2x64x16x16 input."""
    root = os.path.dirname(timm_lambda.__file__)
    try:
        layer = LambdaLayer(64, 64, dim_k=16, heads=4, dim_u=1, scope=7, form=form)
    except TypeError:  # (versions before the layer's ``form`` argument called it ``impl``)
        layer = LambdaLayer(64, 64, dim_k=16, heads=4, dim_u=1, scope=7, impl=form)
    x = torch.randn(2, 64, 16, 16, requires_grad=True)
    out = {}

    def eval_forward():
        with torch.no_grad():
            layer(x)
    layer.eval()
    eval_forward()  # caches and the kernel's first load outside the count
    out['eval forward'] = count(_walk(root, eval_forward))
    layer.train()
    layer(x).sum().backward()
    held = {}

    def forward():
        held['y'] = layer(x).sum()
    out['training forward'] = count(_walk(root, forward))
    out['training backward'] = count(_walk(root, lambda: held['y'].backward()))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--form', default='auto', choices=['auto', 'tiled', 'dense', 'einsum', 'conv'])
    p.add_argument('--path', action='store_true', help='print the files in order')
    p.add_argument('--json', default=None)
    args = p.parse_args(argv)
    result = walk(args.form)
    for what, c in result.items():
        print(f"{args.form} {what}: {c['stays']} stays in {c['files']} files, {c['returns']} returns to a file "
              'already left')
        if args.path:
            print('  ' + ' -> '.join(c['path']))
    if args.json:
        with open(args.json, 'w') as f:
            json.dump(dict(command=shlex.join(['python', 'benchmarks/forward_walk.py'] + list(argv or sys.argv[1:])),
                           date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), commit=commit(),
                           machine=machine('cpu'), package=os.path.dirname(timm_lambda.__file__), form=args.form,
                           results=result), f,
                      indent=1)


if __name__ == '__main__':
    main()
