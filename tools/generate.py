#!/usr/bin/env python
"""Write the generated files: from the paper facts (timm_lambda/paper.py) configs/timm/*.yaml (timm train.py
recipes), configs/mmdet/*.py (Table 14 configs) with their configs/mmdet/metafile.yml; and the generated blocks of
README.md and docs/*.md, the result tables among them from the committed JSON in docs/results/
(tools/_lib/results.py).

    python tools/generate.py           # write
    python tools/generate.py --check   # exit 1 and list the files that differ (what tests/test_generated.py checks)
"""
import argparse
import sys
from pathlib import Path

from _lib.docs import generated_files

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--check', action='store_true')
    args = p.parse_args(argv)
    stale = []
    for rel, text in generated_files(REPO).items():
        path = REPO / rel
        if not path.exists() or path.read_text() != text:
            stale.append(rel)
            if not args.check:
                path.write_text(text)
    print(('differ: ' if args.check else 'wrote: ') + (', '.join(stale) or 'nothing (all up to date)'))
    return 1 if args.check and stale else 0


if __name__ == '__main__':
    sys.exit(main())
