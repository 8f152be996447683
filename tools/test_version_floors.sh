#!/usr/bin/env bash
# Run the non-mmdet tests on the OLDEST torch and timm that pyproject.toml accepts (its floors, checked at import
# by timm_lambda/_compat.py), in a scratch virtualenv. This is the run that justifies the floors (docs/install.md).
#
#     tools/test_version_floors.sh                # torch 2.4.1 / torchvision 0.19.1 / timm 1.0.21
#     VENV=/tmp/floors TORCH=2.5.1 TORCHVISION=0.20.1 tools/test_version_floors.sh   # another torch
#     PIP_FIND_LINKS=/tmp/oldwheels tools/test_version_floors.sh   # take a downloaded torch wheel from a folder
#     tools/test_version_floors.sh -x tests/test_models.py          # extra arguments go to pytest
#
# PyPI's Linux x86_64 torch wheels are CUDA builds: the first run downloads the nvidia-* packages too (a few GB).
# The venv is reused by later runs (delete it to start fresh). Tests that need the [det] extra (mmdet, mmcv,
# mmengine) skip themselves, as in any install without it; `-m "not slow"` leaves out the end-to-end runs.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH="${TORCH:-2.4.1}"
TORCHVISION="${TORCHVISION:-0.19.1}"   # must match torch: 2.4.1 -> 0.19.1, 2.5.1 -> 0.20.1, 2.6.0 -> 0.21.0
TIMM="${TIMM:-1.0.21}"
VENV="${VENV:-/tmp/timm-lambda-floors-torch${TORCH}-timm${TIMM}}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# pytest-xdist (pyproject.toml's addopts run the tests on every core), onnx/onnxscript/onnxruntime: the [test] extra
# (the ONNX export tests); matplotlib: the table4 benchmark smoke test; setuptools + wheel: pyproject.toml's build
# requirements (tests/test_install.py builds a wheel without isolation).
"$VENV/bin/pip" install -q "torch==$TORCH" "torchvision==$TORCHVISION" "timm==$TIMM" \
    pytest pytest-xdist onnx onnxscript onnxruntime matplotlib "setuptools>=64,<81" wheel
# timm-lambda itself, editable and without dependencies (they are the pinned-above ones); installs the
# timm_lambda_autoload.pth hook into the venv like a normal install.
"$VENV/bin/pip" install -q --no-deps -e "$REPO"
# the tiled form's CPU kernel against the floor torch, at install as tools/install.sh builds it (a failure warns: its
# tests then build it, or skip without a compiler)
"$VENV/bin/python" -m timm_lambda.build_cpu_kernel || echo "[floors] WARNING: the CPU kernel did not build (above)" >&2

# Deselected on the floor versions, each for a reason that is not a timm-lambda defect:
DESELECT=(
    # constraints.txt pins the tested stack (torch 2.14.1, timm 1.0.31, ...); this test checks that the
    # environment IS that stack, which a floor environment is by design not.
    --deselect tests/test_install.py::test_constraints_pin_the_installed_versions
)

cd "$REPO"
"$VENV/bin/python" -c 'import torch, timm, timm_lambda; print("torch", torch.__version__, "timm", timm.__version__)'
exec "$VENV/bin/python" -m pytest tests -m "not slow" -q -p no:cacheprovider "${DESELECT[@]}" "$@"
