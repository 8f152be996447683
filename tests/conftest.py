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
