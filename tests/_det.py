"""Import this first in tests that need the [det] extra (mmdet, mmengine, mmcv): without it, the test module is
skipped cleanly with the install hint; with TIMM_LAMBDA_REQUIRE_DET=1 (CI) a missing extra is an error."""

import pytest

from timm_lambda._env import env

INSTALL_HINT = 'pip install "timm-lambda[det]"'

if env('TIMM_LAMBDA_REQUIRE_DET'):
    import mmdet  # noqa: F401
else:
    pytest.importorskip('mmdet', reason=f'detection extra not installed ({INSTALL_HINT})')
    pytest.importorskip('mmcv.ops', reason=f'mmcv with compiled ops not installed ({INSTALL_HINT}, tools/install.sh)')
