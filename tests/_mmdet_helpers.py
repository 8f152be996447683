"""Shared helpers for tests/test_mmdet_*.py."""
import importlib.util
import os
import os.path as osp
import subprocess
import sys

import mmdet

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
CONFIG_DIR = osp.join(REPO, 'configs', 'mmdet')
MMDET_TOOLS = osp.join(osp.dirname(mmdet.__file__), '.mim', 'tools')
CLASSES = ('square', 'circle', 'triangle', 'star')

TABLE14 = {
    'mask-rcnn_resnetrs101-nose_fpn_syncbn_lsj-130k_coco.py':
    'resnetrs101_nose',
    'mask-rcnn_resnetrs101_fpn_syncbn_lsj-130k_coco.py': 'resnetrs101',
    'mask-rcnn_lambdaresnet101_fpn_syncbn_lsj-130k_coco.py':
    'lambdaresnet101',
    'mask-rcnn_resnetrs152-nose_fpn_syncbn_lsj-130k_coco.py':
    'resnetrs152_nose',
    'mask-rcnn_resnetrs152_fpn_syncbn_lsj-130k_coco.py': 'resnetrs152',
    'mask-rcnn_lambdaresnet152_fpn_syncbn_lsj-130k_coco.py':
    'lambdaresnet152',
}


def load_tool(name):
    """Import tools/<name>.py as a module."""
    path = osp.join(REPO, 'tools', f'{name}.py')
    if osp.join(REPO, 'tools') not in sys.path:
        sys.path.insert(0, osp.join(REPO, 'tools'))
    spec = importlib.util.spec_from_file_location(f'_tool_{name}', path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def subprocess_env():
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(
        [REPO] + ([env['PYTHONPATH']] if env.get('PYTHONPATH') else []))
    env.setdefault('OMP_NUM_THREADS', '2')
    env['PYTHONWARNINGS'] = 'ignore'
    return env


def run(cmd, timeout=400, cwd=REPO):
    proc = subprocess.run(
        cmd, cwd=cwd, env=subprocess_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return proc.returncode, proc.stdout
