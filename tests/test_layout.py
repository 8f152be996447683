"""Layout (issue 10, issue 22 item 4): the installed packages hold what users import at run time, the development
code lives beside the entry points in ``tools/``, and each tool runs from a clean clone as CI and users run it.

* **Installed** (``INSTALLED``; pyproject.toml, the wheel's contents are checked by tests/test_install.py):
  ``timm_lambda`` (layers, models, the paper facts the models read), ``timm_lambda_mmdet`` (the MMDetection
  plugin and the main job's entry points, ``python -m timm_lambda_mmdet train|test``) and ``mmdet_plugin`` (its
  old name). Every module in them is reached, through imports, from a module users import (``USER_MODULES``),
  and none imports the development code.
* **Development code**: ``tools/dev/``, the package ``dev`` (generators of configs and tables, doc renderers,
  benchmark harnesses, the quick starts' generated data and short runs). Not installed.
* **Entry points**: ``tools/*.py``. ``python tools/x.py`` puts ``tools/`` first on ``sys.path``, so they (and
  ``dev``) import installed modules and ``dev`` only, never a sibling script, and nothing edits ``sys.path``; the
  tests find ``dev`` the same way (``pythonpath = ["tools"]`` in pyproject.toml).
"""
import ast
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS_DIR = REPO / 'tools'
DEV_DIR = TOOLS_DIR / 'dev'
TOOLS = sorted(TOOLS_DIR.glob('*.py'))
DEV = sorted(DEV_DIR.rglob('*.py'))

INSTALLED = ('timm_lambda', 'timm_lambda_mmdet', 'mmdet_plugin')
INSTALLED_FILES = sorted(p for package in INSTALLED for p in (REPO / package).rglob('*.py'))
USER_MODULES = {
    'timm_lambda': 'the models and layers (also imported by the autoload hook on `import timm`)',
    'timm_lambda.build_cpu_kernel': '`python -m timm_lambda.build_cpu_kernel`, the CPU kernel\'s build at install',
    'timm_lambda_mmdet': 'the MMDetection plugin, imported by the configs (custom_imports)',
    'timm_lambda_mmdet.__main__': '`python -m timm_lambda_mmdet train|test`, the main job',
    'timm_lambda_mmdet.runner_checkpoints': 'opt-in, every config imports it (custom_imports)',
    'timm_lambda_mmdet.cpu_distributed': 'opt-in, the _cpu-ddp config imports it (custom_imports)',
    'timm_lambda_mmdet.overrides': 'short runs on your own data (docs/mmdetection.md)',
    'mmdet_plugin': "the plugin's old name",
}
# the [det] extra's import names: tools/dev's mmdet quick start imports them, a plain install has none of them
DET_EXTRA = {'mmdet', 'mmengine', 'mmcv', 'pycocotools', 'cv2'}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix('').parts
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def _imports(path: Path):
    """``(absolute module name, imported names, relative)`` of every import statement in ``path``, function-level
    ones too; relative imports are resolved against ``path``'s package."""
    package = _module_name(path).split('.') if path.name == '__init__.py' else _module_name(path).split('.')[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, (), False
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = '.'.join(base + ([node.module] if node.module else []))
            yield module, tuple(alias.name for alias in node.names), node.level > 0


def _top_level_names(path: Path):
    """Top-level names of the absolute imports (a relative import stays inside its package)."""
    for module, _, relative in _imports(path):
        if not relative:
            yield module.split('.')[0]


def test_there_are_tools():
    assert len(TOOLS) >= 5 and (DEV_DIR / '__init__.py').is_file()


@pytest.mark.parametrize('tool', TOOLS + DEV, ids=lambda p: p.relative_to(TOOLS_DIR).as_posix())
def test_tools_import_installed_modules_and_dev_only(tool):
    siblings = {p.stem for p in TOOLS_DIR.iterdir() if p.suffix == '.py' or p.is_dir()} - {'dev'}
    names = set(_top_level_names(tool))
    assert not names & siblings, f'{tool.name} imports {sorted(names & siblings)} from tools/: move it to tools/dev/'
    missing = sorted(n for n in names - {'dev'} - DET_EXTRA if importlib.util.find_spec(n) is None)
    assert not missing, f'{tool.name} imports {missing}, which no installed package provides'


def test_dev_is_tools_dev():
    """``dev`` is tools/dev/ for the tests, as for ``python tools/x.py`` (and nothing installed shadows it)."""
    assert Path(importlib.util.find_spec('dev').origin) == DEV_DIR / '__init__.py'


@pytest.mark.parametrize('tool', TOOLS + DEV, ids=lambda p: p.relative_to(TOOLS_DIR).as_posix())
def test_tool_does_not_edit_sys_path(tool):
    tree = ast.parse(tool.read_text(), filename=str(tool))
    edits = [node.lineno for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr == 'path'
             and isinstance(node.value, ast.Name) and node.value.id == 'sys']
    edits += [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == 'sys'
              and any(alias.name == 'path' for alias in node.names)]
    assert not edits, f'{tool.name} uses sys.path at lines {edits}'


@pytest.mark.parametrize('path', INSTALLED_FILES + [REPO / 'timm_lambda_autoload.py'],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_installed_modules_do_not_import_the_development_code(path):
    names = set(_top_level_names(path)) & {'dev', 'tools', 'tests'}
    assert not names, f'{path.relative_to(REPO)} imports {sorted(names)}, which is not installed'


def test_python_packages_at_the_root_are_the_installed_ones():
    """A package at the repository root would not be found by ``python tools/x.py``: development code goes to
    tools/dev/."""
    assert {p.parent.name for p in REPO.glob('*/__init__.py')} == set(INSTALLED)


def test_every_installed_module_is_imported_at_run_time():
    """Every module of the installed packages is reached from ``USER_MODULES`` through imports: a module only the
    tools or the tests import is development code and belongs in tools/dev/."""
    files = {_module_name(p): p for p in INSTALLED_FILES}
    reached, todo = set(), [m for m in USER_MODULES if m in files]
    assert len(todo) == len(USER_MODULES), sorted(set(USER_MODULES) - set(files))
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        for imported, names, _ in _imports(files[module]):
            candidates = [imported] + [f'{imported}.{n}' for n in names]
            for name in candidates:  # a module and its parent packages
                parts = name.split('.')
                todo += ['.'.join(parts[:i]) for i in range(1, len(parts) + 1) if '.'.join(parts[:i]) in files]
    unreached = sorted(set(files) - reached)
    assert not unreached, (f'{unreached}: in the installed packages but imported by no module users import '
                           f'({", ".join(USER_MODULES)}); move it to tools/dev/ or import it where it is used')
