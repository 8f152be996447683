"""timm's own ``tests/test_models.py`` run on every model this package registers.

The file ships in timm's sdist, not its wheel; ``tools/install.sh`` keeps the one of the installed timm
version in ``$TIMM_LAMBDA_CACHE`` (default ``~/.cache/timm-lambda``) ``/timm-tests/<version>/``. Its test
functions and fixtures are imported into this module, unchanged, and ``tests/conftest.py`` keeps the items
whose ``model_name`` is one of ours (marker ``timm_suite``): default cfgs (meta device, dtype changes),
forward, backward, features, TorchScript, FX, FX + TorchScript. As timm's own CI, it leaves the deepest models out
(ResNet-RS depths 350 and 420; tests/test_models.py runs their forward and backward), and it runs the FX and
TorchScript tests on one member of each family of models that differ only in depth (lambdaresnet50,
lambdaresnet50_c4, resnetrs50_nose, aa_resnet34 and aa_resnet50): tests/_timm_suite_filters.py.
``TIMM_LAMBDA_TIMM_SUITE_ALL=1`` runs every test on every model.

    python -m pytest tests/test_timm_suite.py        # the longest part of CI
    python -m pytest tests -m "not timm_suite"       # everything else
"""
import importlib.metadata
import importlib.util
import os
from pathlib import Path

import pytest

from timm_lambda._env import env


def _suite_path() -> Path:
    cache = os.environ.get('TIMM_LAMBDA_CACHE') or os.path.join(
        os.environ.get('XDG_CACHE_HOME') or os.path.join(os.environ.get('HOME') or '/tmp', '.cache'), 'timm-lambda')
    return Path(cache) / 'timm-tests' / importlib.metadata.version('timm') / 'test_models.py'


SUITE = _suite_path()
if SUITE.is_file():
    _spec = importlib.util.spec_from_file_location('timm_sdist_test_models', SUITE)
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    globals().update({k: v for k, v in vars(_module).items() if k.startswith('test_') or k == 'cfg_device'})
elif env('TIMM_LAMBDA_REQUIRE_TIMM_SUITE'):
    raise FileNotFoundError(f'{SUITE} is missing: run tools/install.sh (it fetches timm\'s sdist tests)')
else:
    def test_timm_suite_available():
        pytest.skip(f'{SUITE} is missing: run tools/install.sh to fetch timm\'s tests/test_models.py, '
                    f'or set TIMM_LAMBDA_REQUIRE_TIMM_SUITE=1 to make this an error')
