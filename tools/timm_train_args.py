#!/usr/bin/env python
"""List the argument names (``dest``) of timm's ``train.py`` (static ``ast`` parse) and check our recipes against them.

train.py is not in timm's PyPI packages; read it from a timm checkout. The committed list
configs/timm/train_py_args.txt is what tests/test_timm_configs.py checks the YAML keys against.

    python tools/timm_train_args.py /path/to/timm/train.py
    python tools/timm_train_args.py /path/to/timm/train.py --write \\
        --source "timm repo commit aa4b5850, version 1.0.29.dev0"
    python tools/timm_train_args.py /path/to/timm/train.py --check
"""
import argparse
import sys
from pathlib import Path

from _lib.recipes import check_configs, parse_train_py, write_args_file

CONFIG_DIR = Path(__file__).resolve().parents[1] / 'configs' / 'timm'
ARGS_FILE = CONFIG_DIR / 'train_py_args.txt'


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('train_py', type=Path, help="path to timm's train.py")
    p.add_argument('--write', action='store_true', help=f'write the names to {ARGS_FILE}')
    p.add_argument('--source', default=None, help='where train.py came from, for the header of the written file')
    p.add_argument('--check', action='store_true', help='check configs/timm/*.yaml keys against train.py')
    p.add_argument('--config-dir', type=Path, default=CONFIG_DIR)
    args = p.parse_args(argv)
    dests = parse_train_py(args.train_py.read_text())
    if not dests:
        print(f'error: no add_argument calls found in {args.train_py}', file=sys.stderr)
        return 2
    if args.write:
        if not args.source:
            p.error('--write needs --source (the timm version/commit train.py was read from)')
        write_args_file(dests, args.source, ARGS_FILE)
        print(f'wrote {len(dests)} names to {ARGS_FILE}')
    if args.check:
        problems = check_configs(dests, args.config_dir)
        print('\n'.join(problems + [f'{len(list(args.config_dir.glob("*.yaml")))} config files checked against '
                                    f'{args.train_py}: {"OK" if not problems else f"{len(problems)} problem(s)"}']))
        return 1 if problems else 0
    if not args.write:
        print('\n'.join(dests))
    return 0


if __name__ == '__main__':
    sys.exit(main())
