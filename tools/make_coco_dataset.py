#!/usr/bin/env python
"""Write the synthetic COCO-format dataset of the quick start (tools/_lib/synthetic_coco.py).

    python tools/make_coco_dataset.py --out data/synthetic_coco --seed 0
"""
import argparse

from _lib.synthetic_coco import make_coco_dataset


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--out', default='data/synthetic_coco', help='output directory (default: %(default)s)')
    p.add_argument('--num-train', type=int, default=24)
    p.add_argument('--num-val', type=int, default=8)
    p.add_argument('--image-size', type=int, default=160, help='largest image side in pixels (default: %(default)s)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--square', action='store_true',
                   help='all images image-size x image-size (default: random sizes, mostly not divisible by 32)')
    args = p.parse_args(argv)
    res = make_coco_dataset(args.out, args.num_train, args.num_val, args.image_size, args.seed,
                            odd_sizes=not args.square)
    print(f"wrote {res['train']} and {res['val']}")


if __name__ == '__main__':
    main()
