"""The version floors (timm_lambda/_compat.py): a torch or timm below them fails at import with an error that
names the installed and required versions and the ``pip install -U`` that fixes it, and the timm autoload hook
prints that message. The floors themselves are tested by tools/test_version_floors.sh (docs/install.md)."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _helpers import dynamo_onnx_export_error
from timm_lambda import _compat
from timm_lambda._compat import MIN_TIMM, MIN_TORCH, VersionTooOld, check_versions, parse_version

REPO = Path(__file__).resolve().parents[1]


def test_floors_match_pyproject():
    text = (REPO / 'pyproject.toml').read_text()
    assert f'"torch>={MIN_TORCH}"' in text and f'"timm>={MIN_TIMM},<2"' in text


@pytest.mark.parametrize('version, parsed', [('2.4.1+cu121', (2, 4, 1)), ('2.6.0a0+git1234', (2, 6, 0)),
                                             ('1.0.21', (1, 0, 21)), ('2.10.0.dev20250101', (2, 10, 0))])
def test_parse_version(version, parsed):
    assert parse_version(version) == parsed


def test_installed_versions_pass():
    check_versions()


@pytest.mark.parametrize('torch_version, timm_version', [(MIN_TORCH, MIN_TIMM), ('2.4.0+cpu', MIN_TIMM),
                                                         ('2.10.0', '1.0.31'), ('3.0', '1.1.0')])
def test_versions_at_or_above_the_floor_pass(torch_version, timm_version):
    check_versions(torch_version, timm_version)


def test_old_torch_names_versions_and_the_upgrade(monkeypatch):
    import torch
    monkeypatch.setattr(torch, '__version__', '2.3.1+cu121')
    with pytest.raises(ImportError) as info:
        check_versions()
    assert isinstance(info.value, VersionTooOld)
    message = str(info.value)
    assert f'torch 2.3.1+cu121 (needs >= {MIN_TORCH})' in message
    assert f'pip install -U "torch>={MIN_TORCH}" torchvision' in message
    assert 'timm ' + MIN_TIMM not in message.split('installed:')[1]  # timm is new enough: not named as old


def test_old_timm_names_versions_and_the_upgrade(monkeypatch):
    import timm
    monkeypatch.setattr(timm, '__version__', '1.0.9')
    with pytest.raises(VersionTooOld, match=re.escape(f'timm 1.0.9 (needs >= {MIN_TIMM})')) as info:
        check_versions()
    assert str(info.value).endswith(f'pip install -U "timm>={MIN_TIMM}"')


def test_both_old():
    with pytest.raises(VersionTooOld) as info:
        check_versions('2.1.2', '0.9.16')
    message = str(info.value)
    assert 'torch 2.1.2' in message and 'timm 0.9.16' in message
    assert f'pip install -U "torch>={MIN_TORCH}" torchvision "timm>={MIN_TIMM}"' in message


def test_autoload_hook_prints_what_to_upgrade(tmp_path):
    """`import timm` under a torch below the floor: timm imports, the models are not registered, and the hook's
    warning is the floor message (not the generic 'import failed' one)."""
    code = textwrap.dedent("""
        import sys, torch
        torch.__version__ = '2.3.1'
        import timm_lambda_autoload
        timm_lambda_autoload.install()
        import timm
        print('timm_lambda' in sys.modules, hasattr(timm, 'create_model'))
        """)
    env = {k: v for k, v in os.environ.items() if k != 'TIMM_LAMBDA_NO_AUTOLOAD'}
    env['PYTHONPATH'] = str(REPO)  # this source tree's hook and package
    proc = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ['False', 'True']
    assert 'RuntimeWarning' in proc.stderr and 'not registered with timm' in proc.stderr, proc.stderr
    assert f'torch 2.3.1 (needs >= {MIN_TORCH})' in proc.stderr, proc.stderr
    assert f'pip install -U "torch>={MIN_TORCH}" torchvision' in proc.stderr, proc.stderr
    assert 'failed after' not in proc.stderr, proc.stderr


def test_load_state_dict_pre_hook_shim(monkeypatch):
    """The torch < 2.5 path of the shim (the private hook API) calls the hook like the public one."""
    from torch import nn
    calls = []

    def hook(module, state_dict, prefix, *args):
        calls.append((module, prefix))

    for use_private in (False, True):
        calls.clear()
        outer = nn.Sequential(nn.Linear(2, 2))
        if use_private:
            monkeypatch.setattr(nn.Module, 'register_load_state_dict_pre_hook', None, raising=False)
        _compat.register_load_state_dict_pre_hook(outer[0], hook)
        outer.load_state_dict(outer.state_dict())
        assert calls == [(outer[0], '0.')]



def test_dynamo_onnx_exporter_floor():
    """The reason the dynamo-exporter tests skip on is torch's: on torch 2.4 the missing keyword; on the pinned
    stack (torch >= 2.14) the exporter works and they run."""
    import torch
    pytest.importorskip('onnxscript')
    error = dynamo_onnx_export_error()
    if _compat._older(torch.__version__, '2.5'):
        assert error is not None and 'no dynamic_shapes' in error
    elif not _compat._older(torch.__version__, '2.14'):
        assert error is None
    else:
        assert error is None or 'cannot export a plain Conv + BatchNorm' in error
