"""Shared helpers for tests/test_mmdet_*.py (import tests/_det.py first: it skips them without the extra)."""
import os
import os.path as osp
import subprocess
import sys

import mmdet

from timm_lambda.paper import TABLE14 as _TABLE14

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
CONFIG_DIR = osp.join(REPO, 'configs', 'mmdet')
MMDET_TOOLS = osp.join(osp.dirname(mmdet.__file__), '.mim', 'tools')
CLASSES = ('square', 'circle', 'triangle', 'star')

# config file -> timm backbone, for every Table 14 row
TABLE14 = {f"mask-rcnn_{model.replace('_nose', '-nose')}_fpn_syncbn_lsj-130k_coco.py": model
           for _, model, *_ in _TABLE14}


def subprocess_env():
    env = dict(os.environ)
    env.setdefault('OMP_NUM_THREADS', '2')
    env['PYTHONWARNINGS'] = 'ignore'
    return env


def run(cmd, timeout=400, cwd=REPO):
    """Run a command from the repository root (so ``python -m`` imports this checkout)."""
    proc = subprocess.run(cmd, cwd=cwd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout


def python_m(*args):
    return [sys.executable, '-m', *args]
