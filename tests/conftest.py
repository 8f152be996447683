"""Shared pytest configuration for timm-lambda.

Keep this minimal: shared fixtures only.  Install/packaging checks live in
tests/test_install.py.
"""
import importlib.metadata as _md
import sys


def pytest_report_header(config):
    """Show the versions the tests run against (no heavy imports here)."""
    parts = []
    for dist in ("timm-lambda", "torch", "torchvision", "timm", "mmcv", "mmengine", "mmdet"):
        try:
            parts.append(f"{dist} {_md.version(dist)}")
        except _md.PackageNotFoundError:
            parts.append(f"{dist} (not installed)")
    return [f"python: {sys.executable}", "versions: " + ", ".join(parts)]


def pytest_collection_modifyitems(config, items):
    """tests/test_timm_suite.py imports timm's whole model test matrix: keep our models' items only."""
    from timm_lambda import registered_models
    ours = set(registered_models())
    keep, drop = [], []
    for item in items:
        if item.module.__name__ == 'test_timm_suite' and item.name != 'test_timm_suite_available':
            callspec = getattr(item, 'callspec', None)
            name = callspec.params.get('model_name') if callspec else None
            if not name or name.split('.')[0] not in ours:
                drop.append(item)
                continue
            item.add_marker('timm_suite')
            item.add_marker('slow')
        keep.append(item)
    if drop:
        items[:] = keep
        config.hook.pytest_deselected(items=drop)
