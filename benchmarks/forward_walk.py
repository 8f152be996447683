"""Count the files an input passes through in one ``LambdaLayer.forward`` (eval, CPU): the package's Python frames,
in the order they run, as "stays" (consecutive frames in one file), the files, and the returns to a file already left
(issue 38: the dispatch was spread over five files).

    python benchmarks/forward_walk.py [--impl auto|tiled|dense|einsum|conv] [--path]
"""
import argparse
import os
import sys

import torch

import timm_lambda
from timm_lambda.layers import LambdaLayer


def walk(impl: str):
    root = os.path.dirname(timm_lambda.__file__)
    layer = LambdaLayer(64, 64, dim_k=16, heads=4, dim_u=1, scope=7, impl=impl).eval()
    x = torch.randn(2, 64, 16, 16)
    with torch.no_grad():
        layer(x)  # caches and the kernel's first load outside the count
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
    with torch.no_grad():
        layer(x)
    sys.settrace(None)
    stays, left, returns = [], set(), 0
    for f in seq:
        if stays and stays[-1] == f:
            continue
        returns += f in left
        if stays:
            left.add(stays[-1])
        stays.append(f)
    return stays, returns


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--impl', default='auto', choices=['auto', 'tiled', 'dense', 'einsum', 'conv'])
    p.add_argument('--path', action='store_true', help='print the files in order')
    args = p.parse_args(argv)
    stays, returns = walk(args.impl)
    print(f'{args.impl}: {len(stays)} stays in {len(set(stays))} files, {returns} returns to a file already left')
    if args.path:
        print(' -> '.join(stays))


if __name__ == '__main__':
    main()
