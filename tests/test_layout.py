"""Layout (issue 10, issue 22 item 4, issue 59 item 4): the installed packages hold what users import at run time,
``tools/`` what users run, ``benchmarks/`` the measurement programs (the lab), and each runs from a clean clone as CI
and users run it.

* **Installed** (``INSTALLED``; pyproject.toml, the wheel's contents are checked by tests/test_install.py):
  ``timm_lambda`` (layers, models, the paper facts the models read), ``timm_lambda_mmdet`` (the MMDetection
  plugin and the main job's entry points, ``python -m timm_lambda_mmdet train|test``) and ``mmdet_plugin`` (its
  old name). Every module in them is reached, through imports, from a module users import (``USER_MODULES``),
  and none imports the tools or the lab.
* **What users run**: ``tools/`` (``USER_TOOLS``): install, the quick runs, the GPU check and its bundle, the mmcv
  wheel build, the generator of the committed configs and doc tables; their code is ``tools/_lib/`` (import name
  ``_lib``). Not installed.
* **The lab**: ``benchmarks/*.py``, each listed with its command in docs/benchmarks.md (tests/test_docs.py); their
  shared code is ``benchmarks/harness/`` (import name ``harness``: the method of measuring, the commit and machine
  every result names). Not installed.
* ``python tools/x.py`` puts ``tools/`` first on ``sys.path`` (``python benchmarks/x.py`` likewise ``benchmarks/``),
  so a program imports installed modules and its own folder's library only, never a sibling script nor the other
  folder's library, and nothing edits ``sys.path``; the tests find both libraries the same way (``pythonpath`` in
  pyproject.toml). The GPU check, which runs the lab's programs, reads the lab's commit helper from its file.
"""
import ast
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# folder -> (its library's import name, what the folder holds)
FOLDERS = {'tools': '_lib', 'benchmarks': 'harness'}
PROGRAMS = sorted(p for folder in FOLDERS for p in (REPO / folder).glob('*.py'))
LIBRARIES = sorted(p for folder, lib in FOLDERS.items() for p in (REPO / folder / lib).rglob('*.py'))

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
# tools/: what users (and maintainers) run; a measurement program belongs in benchmarks/
USER_TOOLS = {
    'install.sh': 'the install (README)', 'build_mmcv_wheel.sh': 'the mmcv wheel build (docs/install.md)',
    'quickstart.py': "the README's main job", 'classification_quick_run.py': 'the classification quick run',
    'make_coco_dataset.py': "the quick start's data set alone", 'gpu_check.py': 'the GPU check (docs/install.md)',
    'gpu_bundle.py': "the GPU check's offline bundle", 'generate.py': 'writes the generated configs and doc blocks',
    'model_table.py': "prints the README's model table",
    'timm_train_args.py': "checks the recipes against timm's train.py",
    'test_version_floors.sh': 'the tests on the oldest torch and timm accepted (docs/install.md)',
}
# the [det] extra's import names: the mmdet quick start imports them, a plain install has none of them
DET_EXTRA = {'mmdet', 'mmengine', 'mmcv', 'pycocotools', 'cv2'}
LAB_AND_TOOLS = {'dev', 'tools', 'tests', 'benchmarks'} | set(FOLDERS.values())


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


def test_tools_hold_what_users_run():
    """tools/ holds the programs of ``USER_TOOLS`` and its library, nothing else: no measurement program, no repro."""
    found = {p.name for p in (REPO / 'tools').iterdir() if p.is_file()}
    assert found == set(USER_TOOLS), (sorted(found - set(USER_TOOLS)), sorted(set(USER_TOOLS) - found))
    assert {p.name for p in (REPO / 'tools').iterdir() if p.is_dir() and p.name != '__pycache__'} == {'_lib'}
    assert len(list((REPO / 'benchmarks').glob('*.py'))) >= 5


@pytest.mark.parametrize('path', PROGRAMS + LIBRARIES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_programs_import_installed_modules_and_their_own_library_only(path):
    folder = path.relative_to(REPO).parts[0]
    own = FOLDERS[folder]
    siblings = {p.stem for p in (REPO / folder).iterdir() if p.suffix == '.py' or p.is_dir()} - {own}
    names = set(_top_level_names(path))
    assert not names & siblings, f'{path.name} imports {sorted(names & siblings)} from {folder}/: move it to {own}/'
    assert not names & (LAB_AND_TOOLS - {own}), f'{path.name} imports {sorted(names & (LAB_AND_TOOLS - {own}))}'
    missing = sorted(n for n in names - {own} - DET_EXTRA if importlib.util.find_spec(n) is None)
    assert not missing, f'{path.name} imports {missing}, which no installed package provides'


@pytest.mark.parametrize('folder', FOLDERS)
def test_libraries_are_found_as_the_programs_find_them(folder):
    """``_lib`` is tools/_lib/ and ``harness`` benchmarks/harness/ for the tests, as for ``python tools/x.py`` and
    ``python benchmarks/x.py`` (and nothing installed shadows them)."""
    lib = FOLDERS[folder]
    assert Path(importlib.util.find_spec(lib).origin) == REPO / folder / lib / '__init__.py'


@pytest.mark.parametrize('path', PROGRAMS + LIBRARIES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_program_does_not_edit_sys_path(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    edits = [node.lineno for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr == 'path'
             and isinstance(node.value, ast.Name) and node.value.id == 'sys']
    edits += [node.lineno for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == 'sys'
              and any(alias.name == 'path' for alias in node.names)]
    assert not edits, f'{path.name} uses sys.path at lines {edits}'


@pytest.mark.parametrize('path', INSTALLED_FILES + [REPO / 'timm_lambda_autoload.py'],
                         ids=lambda p: p.relative_to(REPO).as_posix())
def test_installed_modules_do_not_import_the_tools_or_the_lab(path):
    names = set(_top_level_names(path)) & LAB_AND_TOOLS
    assert not names, f'{path.relative_to(REPO)} imports {sorted(names)}, which is not installed'


def test_python_packages_at_the_root_are_the_installed_ones():
    """A package at the repository root would not be found by ``python tools/x.py``: a tool's code goes to
    tools/_lib/, a measurement's to benchmarks/harness/."""
    assert {p.parent.name for p in REPO.glob('*/__init__.py')} == set(INSTALLED)


def test_every_installed_module_is_imported_at_run_time():
    """Every module of the installed packages is reached from ``USER_MODULES`` through imports: a module only the
    tools, the lab or the tests import belongs with them."""
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
                           f'({", ".join(USER_MODULES)}); move it to tools/_lib/ or benchmarks/harness/, or import '
                           f'it where it is used')
