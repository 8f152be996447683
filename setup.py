"""setuptools glue that pyproject.toml cannot express.

All metadata lives in pyproject.toml.  This file only ships
``timm_lambda_autoload.pth`` at the root of the wheel (i.e. into
site-packages), which makes every Python that has timm-lambda installed run
``import timm_lambda_autoload`` at start-up: that installs a tiny import hook
which imports ``timm_lambda`` right after ``timm`` (see timm_lambda_autoload.py).
"""
import glob
import os

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py

PTH_FILE = "timm_lambda_autoload.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class build_py(_build_py):
    """build_py that also puts the autoload .pth file at the root of the wheel."""

    def run(self):
        super().run()
        src = os.path.join(HERE, PTH_FILE)
        if not self.editable_mode:
            self.copy_file(src, os.path.join(self.build_lib, PTH_FILE), preserve_mode=0)
            return
        # `pip install -e .` (PEP 660): setuptools' editable_wheel points the
        # `install` command's install_lib at the root of the wheel it is
        # assembling (build_lib is thrown away), so put the .pth there.
        wheel_root = getattr(self.get_finalized_command("install"), "install_lib", None)
        if wheel_root and glob.glob(os.path.join(wheel_root, "*.dist-info")):
            self.copy_file(src, os.path.join(wheel_root, PTH_FILE), preserve_mode=0)
        else:
            self.warn(f"could not add {PTH_FILE} to the editable wheel; "
                      "`import timm_lambda` explicitly to register the models with timm")

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        if not self.editable_mode:
            outputs.append(os.path.join(self.build_lib, PTH_FILE))
        return outputs

    def get_source_files(self):  # so that the sdist contains the .pth file
        return super().get_source_files() + [PTH_FILE]


setup(cmdclass={"build_py": build_py})
