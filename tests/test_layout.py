"""Layout (issue 10): ``tools/`` holds thin entry points that import installed packages only, never a sibling
file or a ``sys.path`` edit, so each runs from a clean clone exactly as CI and users run it."""
import ast
import importlib.util
from pathlib import Path

import pytest

TOOLS = sorted((Path(__file__).resolve().parents[1] / 'tools').glob('*.py'))


def _imported_top_level_names(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split('.')[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module.split('.')[0]


def test_there_are_tools():
    assert len(TOOLS) >= 5


@pytest.mark.parametrize('tool', TOOLS, ids=lambda p: p.name)
def test_tool_imports_only_installed_modules(tool):
    tree = ast.parse(tool.read_text(), filename=str(tool))
    missing = sorted({name for name in _imported_top_level_names(tree) if importlib.util.find_spec(name) is None})
    assert not missing, f'{tool.name} imports {missing}, which no installed package provides'


@pytest.mark.parametrize('tool', TOOLS, ids=lambda p: p.name)
def test_tool_does_not_edit_sys_path(tool):
    tree = ast.parse(tool.read_text(), filename=str(tool))
    edits = [node.lineno for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr == 'path'
             and isinstance(node.value, ast.Name) and node.value.id == 'sys']
    assert not edits, f'{tool.name} uses sys.path at lines {edits}'
