#!/usr/bin/env python
"""Write the generated files: from the paper facts (timm_lambda/paper.py) configs/timm/*.yaml (timm train.py
recipes), configs/mmdet/*.py (Table 14 configs) with their configs/mmdet/metafile.yml; and the generated blocks of
README.md and docs/*.md, the result tables among them from the committed JSON in docs/results/
(tools/_lib/results.py).

    python tools/generate.py           # write
    python tools/generate.py --check   # exit 1 and list the files that differ (what tests/test_generated.py checks)
    python tools/generate.py --kinds   # each result in docs/results/ and its kind (what a new block registers)
"""
import argparse
import sys
from pathlib import Path

from _lib.docs import generated_files

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--check', action='store_true')
    p.add_argument('--kinds', action='store_true', help="list each result's kind, newest of its kind marked *")
    args = p.parse_args(argv)
    if args.kinds:
        from _lib import results
        for r in results.results():
            kind = results.kind_of(r)
            newest = kind is not None and not results.baseline(r) and results.newest(kind).name == r.name
            print(f"{'*' if newest else ' '} {r.name}: {kind}")
        return 0
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
