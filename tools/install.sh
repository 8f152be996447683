#!/usr/bin/env bash
# Install timm-lambda with the detection and test extras, at the tested
# versions pinned in constraints.txt.  Idempotent; a second run is fast.
#
#   bash tools/install.sh            # into ./.venv (created if missing)
#   VENV=/path/to/venv bash tools/install.sh
#   (or run it with a virtualenv activated: it installs into $VIRTUAL_ENV)
#
# Steps:
#   1. virtualenv: $VENV, else the active $VIRTUAL_ENV, else <repo>/.venv
#      (created with ${PYTHON:-python3}, which must be >= 3.9);
#   2. torch + torchvision (+ setuptools<81, wheel), pinned by constraints.txt;
#   3. mmcv with compiled ops, CPU-only or with CUDA kernels (docs/install.md
#      "GPU (CUDA) install"): TIMM_LAMBDA_MMCV_CUDA=1 asks for CUDA ops, =0 for
#      CPU ops; unset ("auto"): CUDA ops when torch has CUDA, a GPU is visible,
#      nvcc is found and CI is unset, else CPU ops.  TORCH_CUDA_ARCH_LIST:
#      the visible GPUs', else 8.0;8.6;8.9;9.0+PTX.  First usable source wins,
#      each checked for the ops asked for (CUDA device code in mmcv/_ext*.so):
#        a. the installed mmcv, if its ops load against the installed torch;
#        b. the wheel cache ${TIMM_LAMBDA_WHEEL_CACHE:-${XDG_CACHE_HOME:-~/.cache}/timm-lambda/wheels}/torch-<version>/
#           cpu/ or cuda-<archs>/ (a wheel directly in torch-<version>/ is an older CPU-only build);
#        c. a wheel offered by pip's find-links (PIP_FIND_LINKS / pip config);
#        d. a source build (tools/build_mmcv_wheel.sh, ~17+ min on 2 cores for
#           CPU ops, ~18 min per CUDA arch), whose wheel is stored in the cache;
#   4. pip install -c constraints.txt ".[det,test]", an import check, and the
#      tiled form's C++ CPU kernel (python -m timm_lambda.build_cpu_kernel:
#      about 40 s on 2 cores, once per CPU, torch and Python; the layers never
#      compile it at run time).  A failed build (no compiler) warns and the
#      install goes on: the models run the GEMM path, about half as fast;
#   5. timm's tests/test_models.py of the installed timm (tests/test_timm_suite.py).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CONSTRAINTS="$ROOT/constraints.txt"

log() { printf '[install] %s\n' "$*" >&2; }
die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 1; }
[[ -f "$CONSTRAINTS" ]] || die "missing $CONSTRAINTS"

# 1. virtualenv ---------------------------------------------------------------
if [[ -n "${VENV:-}" ]]; then
    VENV_DIR="$VENV"
elif [[ -n "${VIRTUAL_ENV:-}" ]]; then
    VENV_DIR="$VIRTUAL_ENV"
else
    VENV_DIR="$ROOT/.venv"
fi
if [[ ! -x "$VENV_DIR/bin/python" ]]; then
    BASE_PY="${PYTHON:-python3}"
    command -v "$BASE_PY" >/dev/null 2>&1 || die "$BASE_PY not found; set PYTHON=/path/to/python3.9+"
    "$BASE_PY" -c 'import sys; sys.exit(sys.version_info < (3, 9))' \
        || die "$BASE_PY is older than Python 3.9"
    log "creating virtualenv $VENV_DIR with $("$BASE_PY" -V 2>&1)"
    "$BASE_PY" -m venv "$VENV_DIR"
fi
PY="$VENV_DIR/bin/python"
log "using $PY ($("$PY" -V 2>&1))"

pip_() { "$PY" -m pip --disable-pip-version-check "$@"; }
PIP_QUIET=(--progress-bar off)
[[ -n "${CI:-}" ]] && PIP_QUIET+=(-q)

# 2. torch --------------------------------------------------------------------
log "installing torch, torchvision and build tooling (constraints.txt)"
pip_ install "${PIP_QUIET[@]}" -c "$CONSTRAINTS" "setuptools<81" wheel torch torchvision

# 3. mmcv with compiled ops -----------------------------------------------------
MMCV_VERSION="$(sed -n 's/^mmcv==\([^ ;#]*\).*/\1/p' "$CONSTRAINTS" | head -n1)"
[[ -n "$MMCV_VERSION" ]] || die "no mmcv==X pin in $CONSTRAINTS"
TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__)')"
CACHE_ROOT="${TIMM_LAMBDA_WHEEL_CACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/timm-lambda/wheels}/torch-${TORCH_VERSION//+/_}"
CHECK_PY="$ROOT/timm_lambda_mmdet/mmcv_cuda.py"   # stdlib-only (and timm_lambda/_env.py beside it), run as a script

# CPU or CUDA ops (timm_lambda_mmdet/mmcv_cuda.py: decide_mmcv_build)
DECISION="$("$PY" "$CHECK_PY" decide)" || die "${DECISION#error=}"
MMCV_CUDA="$(sed -n 's/^cuda=//p' <<<"$DECISION")"
MMCV_SWITCH="$(sed -n 's/^switch=//p' <<<"$DECISION")"  # $TIMM_LAMBDA_MMCV_CUDA read as 0, 1 or auto
MMCV_ARCHS="$(sed -n 's/^archs=//p' <<<"$DECISION")"
log "mmcv ops: $([[ "$MMCV_CUDA" == 1 ]] && echo "CPU + CUDA (TORCH_CUDA_ARCH_LIST=$MMCV_ARCHS)" || echo "CPU only"); $(sed -n 's/^reason=//p' <<<"$DECISION")"
if [[ "$MMCV_CUDA" == 1 ]]; then
    arch_tag="${MMCV_ARCHS//[;, ]/_}"
    CACHE_DIR="$CACHE_ROOT/cuda-${arch_tag//+/}"
else
    CACHE_DIR="$CACHE_ROOT/cpu"
fi
WHEEL_NAME="mmcv-$MMCV_VERSION-$("$PY" -c 'import sys; t = "cp%d%d" % sys.version_info[:2]; print(t + "-" + t)')-linux_$(uname -m).whl"

# True if mmcv==$MMCV_VERSION is installed and its compiled ops (mmcv/_ext*.so)
# load against the installed torch and are the ops asked for: CUDA kernels
# when MMCV_CUDA=1, none with TIMM_LAMBDA_MMCV_CUDA=0; in auto mode a CPU
# decision also keeps an installed CUDA build (it has the CPU ops too).
# Loads the extension file directly, so it works before mmcv's own
# dependencies (mmengine, cv2) are installed.
mmcv_ops_ok() {
    local want_ops="cpu-or-cuda"
    if [[ "$MMCV_CUDA" == 1 ]]; then want_ops="cuda"
    elif [[ "$MMCV_SWITCH" == 0 ]]; then want_ops="cpu"; fi
    "$PY" - "$MMCV_VERSION" "$want_ops" "$CHECK_PY" <<'EOF'
import importlib.metadata as md, importlib.util, sys
want, want_ops, check_py = sys.argv[1:4]
try:
    have = md.version("mmcv")
except md.PackageNotFoundError:
    sys.exit("mmcv is not installed")
if have != want:
    sys.exit(f"mmcv {have} is installed, want {want}")
exts = [f for f in (md.distribution("mmcv").files or [])
        if f.parts[:1] == ("mmcv",) and f.name.startswith("_ext.") and f.name.endswith(".so")]
if not exts:
    sys.exit("the installed mmcv has no compiled ops (no mmcv/_ext*.so)")
import torch  # noqa: F401  (loads libtorch for the extension's symbols)
spec = importlib.util.spec_from_file_location("mmcv._ext", str(exts[0].locate()))
try:
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
except ImportError as e:
    sys.exit(f"mmcv's compiled ops do not load against torch {torch.__version__}: {e}")
if not hasattr(mod, "nms") or not hasattr(mod, "roi_align_forward"):
    sys.exit("mmcv._ext lacks nms/roi_align_forward")
ns = {"__name__": "mmcv_cuda", "__file__": check_py}
exec(compile(open(check_py).read(), check_py, "exec"), ns)
cuda = ns["has_cuda_device_code"](str(exts[0].locate()))
if want_ops == "cuda" and not cuda:
    sys.exit("mmcv's compiled ops are CPU-only (no CUDA device code in mmcv/_ext*.so), CUDA ops were asked for")
if want_ops == "cpu" and cuda:
    sys.exit("mmcv's compiled ops include CUDA kernels, TIMM_LAMBDA_MMCV_CUDA=0 asks for a CPU-only build")
EOF
}

MMCV_SOURCE=""
if mmcv_ops_ok 2>/dev/null; then
    MMCV_SOURCE="already installed"
fi
# an older install cached its (CPU-only) wheel directly in torch-<version>/
if [[ -z "$MMCV_SOURCE" && "$MMCV_CUDA" != 1 && ! -f "$CACHE_DIR/$WHEEL_NAME" && -f "$CACHE_ROOT/$WHEEL_NAME" ]]; then
    mkdir -p "$CACHE_DIR" && mv -f "$CACHE_ROOT/$WHEEL_NAME" "$CACHE_DIR/$WHEEL_NAME"
fi
if [[ -z "$MMCV_SOURCE" && -f "$CACHE_DIR/$WHEEL_NAME" ]]; then
    log "installing mmcv from the wheel cache: $CACHE_DIR/$WHEEL_NAME"
    pip_ install "${PIP_QUIET[@]}" --no-deps --force-reinstall "$CACHE_DIR/$WHEEL_NAME"
    if mmcv_ops_ok; then
        MMCV_SOURCE="cache $CACHE_DIR/$WHEEL_NAME"
    else
        log "the cached wheel is unusable; removing it"
        rm -f "$CACHE_DIR/$WHEEL_NAME"
    fi
fi
if [[ -z "$MMCV_SOURCE" ]]; then
    # Only pip's find-links (PIP_FIND_LINKS or pip config), never the index:
    # the index has only the sdist, which needs the patched build below.
    if pip_ install "${PIP_QUIET[@]}" --no-deps --force-reinstall --no-index --only-binary mmcv \
            "mmcv==$MMCV_VERSION" 2>/dev/null; then
        if mmcv_ops_ok; then
            MMCV_SOURCE="find-links wheel"
        else
            log "the find-links mmcv wheel does not fit torch $TORCH_VERSION or lacks the ops asked for; building from source"
        fi
    else
        log "no mmcv $MMCV_VERSION wheel in find-links (PIP_FIND_LINKS='${PIP_FIND_LINKS:-}') or cache"
    fi
fi
if [[ -z "$MMCV_SOURCE" ]]; then
    if [[ "$MMCV_CUDA" == 1 ]]; then
        log "building mmcv $MMCV_VERSION with CUDA ops ($MMCV_ARCHS) from source into $CACHE_DIR (~18 minutes per arch on 2 cores; see docs/install.md)"
        FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="$MMCV_ARCHS" \
            bash "$ROOT/tools/build_mmcv_wheel.sh" --python "$PY" --out "$CACHE_DIR" >/dev/null
    else
        log "building mmcv $MMCV_VERSION (CPU ops) from source into $CACHE_DIR (takes ~17+ minutes on 2 cores)"
        FORCE_CUDA=0 bash "$ROOT/tools/build_mmcv_wheel.sh" --python "$PY" --out "$CACHE_DIR" >/dev/null
    fi
    [[ -f "$CACHE_DIR/$WHEEL_NAME" ]] || die "the build did not produce $CACHE_DIR/$WHEEL_NAME"
    pip_ install "${PIP_QUIET[@]}" --no-deps --force-reinstall "$CACHE_DIR/$WHEEL_NAME"
    mmcv_ops_ok || die "the freshly built mmcv wheel does not load; see $CACHE_DIR/mmcv-$MMCV_VERSION-build.log"
    MMCV_SOURCE="source build (cached as $CACHE_DIR/$WHEEL_NAME)"
fi
log "mmcv $MMCV_VERSION with $("$PY" "$CHECK_PY" has-cuda-ops && echo "CPU + CUDA" || echo "CPU-only") ops: $MMCV_SOURCE"

# 4. the package itself ----------------------------------------------------------
log "installing timm-lambda[det,test] (constraints.txt)"
pip_ install "${PIP_QUIET[@]}" -c "$CONSTRAINTS" ".[det,test]"

"$PY" - <<'EOF' || die "post-install import check failed (see above)"
import importlib.metadata as md
from mmcv.ops import RoIAlign, batched_nms  # noqa: F401  (compiled ops)
import mmdet  # noqa: F401  (runs mmdet's mmcv/mmengine version checks)
print("[install] OK: " + ", ".join(f"{d} {md.version(d)}" for d in
      ("timm-lambda", "torch", "torchvision", "timm", "mmcv", "mmengine", "mmdet")))
EOF
# The tiled form's CPU kernel: built here, at install, never inside a training step. No compiler: a warning, not
# a failed install (the position lambdas then run as batched GEMMs, correct and about half as fast).
log "building the tiled form's C++ CPU kernel: $PY -m timm_lambda.build_cpu_kernel (about 40 s on 2 cores, once)"
if ! "$PY" -m timm_lambda.build_cpu_kernel; then
    log "WARNING: the CPU kernel did not build (the cause is above); the models run the GEMM path on a CPU (about half as fast); after fixing it: $PY -m timm_lambda.build_cpu_kernel"
fi
# 5. timm's own model tests (tests/test_timm_suite.py runs them on our models) --------
# They ship in timm's sdist, not its wheel: keep tests/test_models.py of the installed timm version.
TIMM_VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("timm"))')"
TIMM_TESTS="${TIMM_LAMBDA_CACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/timm-lambda}/timm-tests/$TIMM_VERSION"
if [[ ! -f "$TIMM_TESTS/test_models.py" ]]; then
    log "fetching timm $TIMM_VERSION's tests/test_models.py from its sdist into $TIMM_TESTS"
    tmp="$(mktemp -d)"
    if pip_ download -q --no-deps --no-binary :all: "timm==$TIMM_VERSION" -d "$tmp" >/dev/null 2>&1 \
            && tar -xzf "$tmp"/timm-*.tar.gz -C "$tmp" --wildcards '*/tests/test_models.py'; then
        mkdir -p "$TIMM_TESTS" && cp "$tmp"/timm-*/tests/test_models.py "$TIMM_TESTS/"
    else
        log "WARNING: could not fetch timm's sdist; tests/test_timm_suite.py will say how to get it"
    fi
    rm -rf "$tmp"
fi
log "done; run the tests with: $PY -m pytest tests"
