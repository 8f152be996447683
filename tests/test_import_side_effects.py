"""Importing a package of ours changes nothing in torch or mmengine (issue 18, item 4): torch's ``weights_only``
allow-list and every function of the already imported mmengine modules are the same objects before and after.
Process-wide changes are opt-in modules (``timm_lambda_mmdet.runner_checkpoints``,
``timm_lambda_mmdet.cpu_distributed``) that configs list in ``custom_imports``; the mmdet backbone imports
``timm_lambda`` itself, so it knows our models without the ``import timm`` hook. Each check runs in a fresh
interpreter."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from timm_lambda._env import env

REPO = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter: our dependencies imported first (their own import-time effects are not ours:
# ``import timm`` imports torch._dynamo, which allow-lists one class and wraps torch.manual_seed), a snapshot of
# torch's safe globals and of the identity of every callable in the loaded torch, torch.serialization and
# mmengine modules, the import, a second snapshot. Prints what changed as JSON.
SNAPSHOT = '''
import importlib, json, sys
import torch
import timm  # noqa
try:
    import mmengine.dist.utils, mmengine.runner, mmengine.runner.checkpoint, mmengine.model, mmdet.models  # noqa
except ImportError:
    pass

def snapshot():
    safe = sorted(repr(g) for g in getattr(torch.serialization, 'get_safe_globals', lambda: [])())
    funcs = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name in ('torch', 'torch.serialization') or name.split('.')[0] == 'mmengine'):
            continue
        for attr, value in list(vars(mod).items()):
            if callable(value):
                funcs[name + '.' + attr] = id(value)
    return safe, funcs

safe, funcs = snapshot()
importlib.import_module(sys.argv[1])
safe2, funcs2 = snapshot()
print(json.dumps(dict(safe_globals_added=sorted(set(safe2) - set(safe)),
                      functions_replaced=sorted(k for k in funcs if funcs2.get(k) != funcs[k]))))
'''


def _have(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


HAVE_DET = all(_have(m) for m in ('mmdet', 'mmengine', 'mmcv'))
requires_det = pytest.mark.skipif(not HAVE_DET and not env('TIMM_LAMBDA_REQUIRE_DET'),
                                  reason='detection extra not installed (pip install "timm-lambda[det]")')


def _run(args, env_extra=None, timeout=600):
    env = dict(os.environ, PYTHONWARNINGS='ignore', **(env_extra or {}))
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _changes(module: str) -> dict:
    # without the autoload hook, which would import timm_lambda with timm, before the first snapshot
    out = _run(['-c', SNAPSHOT, module], env_extra=dict(TIMM_LAMBDA_NO_AUTOLOAD='1'))
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize('module', [
    'timm_lambda',
    pytest.param('timm_lambda_mmdet', marks=requires_det),
    pytest.param('mmdet_plugin', marks=requires_det),
])
def test_importing_our_packages_changes_nothing_in_torch_or_mmengine(module):
    assert _changes(module) == dict(safe_globals_added=[], functions_replaced=[])


@requires_det
def test_the_opt_in_modules_are_what_changes_them():
    """The snapshot sees the changes: the allow-list opt-in adds safe globals, the CPU opt-in replaces mmengine's
    ``_init_dist_pytorch``."""
    allow_list = _changes('timm_lambda_mmdet.runner_checkpoints')
    assert any('HistoryBuffer' in g for g in allow_list['safe_globals_added'])
    assert _changes('timm_lambda_mmdet.cpu_distributed')['functions_replaced'] == [
        'mmengine.dist.utils._init_dist_pytorch']


@requires_det
def test_backbone_knows_the_lambdaresnets_without_the_autoload_hook():
    code = textwrap.dedent('''
        import sys
        import timm
        assert 'timm_lambda' not in sys.modules, 'the autoload hook ran despite TIMM_LAMBDA_NO_AUTOLOAD=1'
        import torch
        from mmdet.registry import MODELS
        import timm_lambda_mmdet  # noqa: F401  (registers TimmLambdaResNet)
        for name in ('lambdaresnet101', 'lambdaresnet101_c4', 'lambdaresnet152', 'resnetrs101_nose'):
            backbone = MODELS.build(dict(type='TimmLambdaResNet', model_name=name, norm_cfg=dict(type='BN')))
            print(name, sum(p.numel() for p in backbone.parameters()))
        with torch.no_grad():
            outs = backbone.eval()(torch.randn(1, 3, 64, 64))
        print([tuple(o.shape) for o in outs])
    ''')
    out = _run(['-c', code], env_extra=dict(TIMM_LAMBDA_NO_AUTOLOAD='1'))
    assert [line.split()[0] for line in out.splitlines()[:4]] == [
        'lambdaresnet101', 'lambdaresnet101_c4', 'lambdaresnet152', 'resnetrs101_nose']
    assert out.splitlines()[4] == '[(1, 256, 16, 16), (1, 512, 8, 8), (1, 1024, 4, 4), (1, 2048, 2, 2)]'
