#!/usr/bin/env python
"""Print the README model table: every registered name, parameters, the paper's count, multiply-adds beside the
paper's FLOPs, default resolution, what it reproduces (tools/_lib/docs.py; README.md holds it as a generated block,
see tools/generate.py).

    python tools/model_table.py
    python tools/model_table.py --attention   # LambdaNetworks Table 3, AA paper Tables 3 and 6: ours vs paper
"""
import argparse

from _lib.docs import attention_tables, model_table

if __name__ == '__main__':
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--attention', action='store_true',
                   help='the attention comparisons (LambdaNetworks Table 3, AA paper Tables 3 and 6) instead')
    print(attention_tables() if p.parse_args().attention else model_table())
