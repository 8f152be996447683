#!/usr/bin/env python
"""Print the README model table: every registered name, parameters, the paper's count, default resolution, what it
reproduces (timm_lambda.docs.model_table; README.md holds it as a generated block, see tools/generate.py).

    python tools/model_table.py
"""
from timm_lambda.docs import model_table

if __name__ == '__main__':
    print(model_table())
