"""The ``TIMM_LAMBDA_*`` variables (issue 39): one convention and one parser (``timm_lambda/_env.py``: 1/true/yes/on
and 0/false/no/off in any case, unset or empty the default), one table of variables, an invalid value an error naming
the variable and its values when the package loads; the ``.pth`` hook and tools/install.sh's ``mmcv_cuda.py`` load
that parser by its file (no copies)."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _helpers import load_file
from timm_lambda import _env

REPO = Path(__file__).resolve().parents[1]


# stdlib-only modules of this checkout by their files (the installed ``timm_lambda_autoload`` is already imported by
# the ``.pth`` hook; loading it again under another name leaves that hook as it is)
timm_lambda_autoload = load_file('timm_lambda_autoload.py', '_test_env_autoload')
mmcv_cuda = load_file('timm_lambda_mmdet/mmcv_cuda.py', '_test_env_mmcv_cuda')

ON = ['1', 'true', 'True', 'TRUE', 'yes', 'Yes', 'on', 'ON', ' 1 ', 'yes\n']
OFF = ['0', 'false', 'False', 'no', 'NO', 'off', 'Off', ' 0']
UNSET = [None, '', '  ']
BAD = ['2', 'maybe', 'y', 'n', 'enable', 'cuda', '1.0', '-1', 'truee']


@pytest.mark.parametrize('default', [True, False])
def test_flag_words_any_case(default):
    for value in ON:
        assert _env.parse_flag('TIMM_LAMBDA_X', value, default) is True, value
    for value in OFF:
        assert _env.parse_flag('TIMM_LAMBDA_X', value, default) is False, value
    for value in UNSET:
        assert _env.parse_flag('TIMM_LAMBDA_X', value, default) is default, value


@pytest.mark.parametrize('value', BAD + ['auto'])
def test_flag_refuses_other_values_naming_the_variable_and_its_values(value):
    with pytest.raises(ValueError) as e:
        _env.parse_flag('TIMM_LAMBDA_STRICT', value, True)
    assert str(e.value) == (f'TIMM_LAMBDA_STRICT={value!r} is not a valid value: use 1/true/yes/on or '
                            '0/false/no/off (any case), or leave it unset')


def test_choice_takes_its_words_and_the_flag_words():
    for value in ('auto', 'AUTO', ' Auto '):
        assert _env.parse_choice('TIMM_LAMBDA_MMCV_CUDA', value, ('auto',), 'auto') == 'auto'
    for value in ON:
        assert _env.parse_choice('TIMM_LAMBDA_MMCV_CUDA', value, ('auto',), 'auto') == '1'
    for value in OFF:
        assert _env.parse_choice('TIMM_LAMBDA_MMCV_CUDA', value, ('auto',), 'auto') == '0'
    for value in UNSET:
        assert _env.parse_choice('TIMM_LAMBDA_MMCV_CUDA', value, ('auto',), 'auto') == 'auto'
    for value in BAD:
        with pytest.raises(ValueError, match=r"^TIMM_LAMBDA_MMCV_CUDA='.*' is not a valid value: use auto, "
                                             r"1/true/yes/on or 0/false/no/off \(any case\), or leave it unset$"):
            _env.parse_choice('TIMM_LAMBDA_MMCV_CUDA', value, ('auto',), 'auto')


def test_a_name_takes_its_words_only():
    """``TIMM_LAMBDA_BACKEND`` names a backend: its words (the registry's) in any case; a flag word means nothing
    there."""
    from timm_lambda.layers.position_lambda import backends
    kind, default, choices, _ = _env.VARIABLES['TIMM_LAMBDA_BACKEND']
    assert (kind, default, choices) == ('name', 'auto', None)  # (the registry's names: one list of them)
    choices = ('auto',) + backends.names()
    assert _env.parse_choice('TIMM_LAMBDA_BACKEND', ' Triton_TC ', choices, default, flags=False) == 'triton_tc'
    assert _env.parse_choice('TIMM_LAMBDA_BACKEND', '', choices, default, flags=False) == 'auto'
    for value in ('1', 'on', 'off', 'triton'):
        with pytest.raises(ValueError, match=r"^TIMM_LAMBDA_BACKEND='.*' is not a valid value: use auto, cpu_kernel, "
                                             r"triton_tc, triton_fma, gemm, plain, or leave it unset$"):
            _env.parse_choice('TIMM_LAMBDA_BACKEND', value, choices, default, flags=False)


def test_every_variable_of_the_package_is_in_the_table():
    """Each ``TIMM_LAMBDA_*`` name the package and its tools read is in :data:`_env.VARIABLES` (path and cache
    variables and the benchmarks' commit excepted), and the table's kinds and defaults are the call sites'."""
    import re
    found = set()
    for root in ('timm_lambda', 'timm_lambda_mmdet', 'tools', 'benchmarks'):
        for path in (REPO / root).rglob('*'):
            if path.suffix in ('.py', '.sh'):
                found |= set(re.findall(r'TIMM_LAMBDA_[A-Z0-9_]+', path.read_text()))
    found |= set(re.findall(r'TIMM_LAMBDA_[A-Z0-9_]+', (REPO / 'timm_lambda_autoload.py').read_text()))
    # paths and the benchmarks' commit: values, not switches
    paths = {'TIMM_LAMBDA_WHEEL_CACHE', 'TIMM_LAMBDA_CACHE', 'TIMM_LAMBDA_COMMIT'}
    assert found - paths - {'TIMM_LAMBDA_'} <= set(_env.VARIABLES) | set(_env.RETIRED), found
    assert _env.VARIABLES['TIMM_LAMBDA_BACKEND'][:3] == ('name', 'auto', None)
    assert _env.VARIABLES['TIMM_LAMBDA_CPU_ARCH'][:2] == ('pattern', 'native')
    assert _env.VARIABLES['TIMM_LAMBDA_NO_AUTOLOAD'][:2] == ('flag', False)
    assert _env.VARIABLES['TIMM_LAMBDA_STRICT'][:2] == ('flag', False)
    assert _env.VARIABLES['TIMM_LAMBDA_MMCV_CUDA'][:3] == ('choice', 'auto', ('auto',))


@pytest.mark.parametrize('name', sorted(_env.VARIABLES))
def test_check_names_an_invalid_variable(name, monkeypatch):
    """:func:`_env.check` (at ``import timm_lambda``) refuses an invalid value of each variable, naming it; a name's
    (the backend's) is refused when the package has registered its backends."""
    for other in _env.VARIABLES:
        monkeypatch.delenv(other, raising=False)
    for other in _env.RETIRED:
        monkeypatch.delenv(other, raising=False)
    _env.check()
    kind, _, choices, _ = _env.VARIABLES[name]
    good, bad = {'name': ((choices or ('GEMM',))[0].upper(), 'maybe'),
                 'pattern': ('x86-64-v3', 'native; rm')}.get(kind, ('Off', 'maybe'))
    monkeypatch.setenv(name, good)
    _env.check()
    monkeypatch.setenv(name, bad)
    if kind == 'name' and choices is None:  # (the backend: its names are the registry's)
        from timm_lambda.layers.position_lambda import backends
        with pytest.raises(ValueError, match=f"^{name}='{bad}' is not a valid value: use auto, cpu_kernel, "):
            backends.set_backend_from_environment()
        return
    with pytest.raises(ValueError, match=f"^{name}='{re.escape(bad)}' is not a valid value: use "):
        _env.check()


def test_the_hook_and_the_install_script_read_the_packages_parser():
    """No copies: the ``.pth`` hook and ``mmcv_cuda.py`` load ``timm_lambda/_env.py`` by its file (the package is not
    imported for it) and read their variables by it, errors included."""
    assert not hasattr(timm_lambda_autoload, '_flag') and not hasattr(mmcv_cuda, '_TRUE')
    for value in ON + OFF + UNSET + BAD + ['auto', 'AUTO']:
        try:
            want = _env.parse_choice('TIMM_LAMBDA_MMCV_CUDA', value, ('auto',), 'auto')
        except ValueError as e:
            with pytest.raises(ValueError) as got:
                mmcv_cuda.read_switch(value)
            assert str(got.value) == str(e)
        else:
            assert mmcv_cuda.read_switch(value) == want, value
    assert mmcv_cuda._env().parse_flag.__code__.co_filename == str(REPO / 'timm_lambda' / '_env.py')


def _python(code, env_extra, pythonpath, cwd):
    env = {k: v for k, v in os.environ.items() if not k.startswith('TIMM_LAMBDA_') and k != 'PYTHONPATH'}
    env.update(env_extra, PYTHONPATH=os.pathsep.join(str(p) for p in pythonpath))
    return subprocess.run([sys.executable, '-c', textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize('value, hooked', [(None, True), ('0', True), ('false', True), ('No', True), ('OFF', True),
                                           ('1', False), ('true', False), ('YES', False), ('on', False),
                                           ('maybe', True)])
def test_autoload_switch(value, hooked, tmp_path):
    """The worktree's hook (found before the installed one through PYTHONPATH) with fake ``timm`` and ``timm_lambda``
    packages: false words keep it (``false``/``no`` turned it off before issue 39), true words turn it off, and an
    invalid value keeps it, so that ``import timm_lambda`` reports the value (next test)."""
    stub = tmp_path / 'stub'
    (stub / 'timm').mkdir(parents=True)
    (stub / 'timm' / '__init__.py').write_text('')
    (stub / 'timm_lambda').mkdir()
    (stub / 'timm_lambda' / '__init__.py').write_text('')
    (stub / 'timm_lambda' / '_env.py').write_text((REPO / 'timm_lambda' / '_env.py').read_text())  # (its parser)
    out = _python('''
        import sys, timm_lambda_autoload, timm
        print(timm_lambda_autoload.__file__, 'timm_lambda' in sys.modules)
    ''', {} if value is None else {'TIMM_LAMBDA_NO_AUTOLOAD': value}, [stub, REPO], tmp_path)
    assert out.returncode == 0, out.stderr
    path, loaded = out.stdout.split()
    assert Path(path) == REPO / 'timm_lambda_autoload.py'
    assert loaded == str(hooked)


def test_the_package_reads_the_switches_at_load_and_refuses_an_invalid_one(tmp_path):
    """With the real packages: ``GEMM`` chooses the gemm backend, ``no`` turns strict mode off, ``false`` keeps the
    autoload hook; an invalid value fails ``import timm_lambda`` with the variable and its values in the last line,
    a retired variable with its successor, and the hook's warning at ``import timm`` starts with them."""
    out = _python('''
        import sys, timm
        from timm_lambda.layers.position_lambda import backends
        print('timm_lambda' in sys.modules, backends.get_backend(), backends.is_strict(),
              'lambdaresnet50' in timm.list_models())
    ''', dict(TIMM_LAMBDA_BACKEND='GEMM', TIMM_LAMBDA_STRICT='no', TIMM_LAMBDA_NO_AUTOLOAD='false'), [REPO],
        tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ['True', 'gemm', 'False', 'True']
    bad = _python('import timm_lambda', dict(TIMM_LAMBDA_NO_AUTOLOAD='1', TIMM_LAMBDA_BACKEND='always'), [REPO],
                  tmp_path)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1] == (
        "ValueError: TIMM_LAMBDA_BACKEND='always' is not a valid value: use auto, cpu_kernel, triton_tc, triton_fma, "
        "gemm, plain, or leave it unset")
    retired = _python('import timm_lambda', dict(TIMM_LAMBDA_NO_AUTOLOAD='1', TIMM_LAMBDA_CPU_KERNEL='0'), [REPO],
                      tmp_path)
    assert retired.returncode == 1 and retired.stderr.strip().splitlines()[-1] == (
        'ValueError: TIMM_LAMBDA_CPU_KERNEL is no longer read: unset it and use TIMM_LAMBDA_BACKEND '
        '(gemm runs the tiled form without the CPU kernel); docs/install.md, "Environment variables"')
    hook = _python('import timm', dict(TIMM_LAMBDA_NO_AUTOLOAD='maybe'), [REPO], tmp_path)
    assert hook.returncode == 0, hook.stderr[-3000:]
    warning = next(line for line in hook.stderr.splitlines() if 'RuntimeWarning' in line)
    assert warning.split('RuntimeWarning: ', 1)[1].startswith(
        "timm-lambda: TIMM_LAMBDA_NO_AUTOLOAD='maybe' is not a valid value: use 1/true/yes/on or 0/false/no/off")
