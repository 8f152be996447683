#!/usr/bin/env bash
# Build an mmcv wheel WITH compiled ops (mmcv._ext) from mmcv's sdist, against
# the torch that is installed in the target Python.
#
#   bash tools/build_mmcv_wheel.sh --python .venv/bin/python --out DIR
#
# PyPI only has mmcv's sdist, and OpenMMLab's prebuilt wheels do not cover new
# torch releases, so we build it ourselves:
#   * setuptools<81 (mmcv's setup.py imports pkg_resources), no build isolation
#     (the build must see the installed torch),
#   * MMCV_WITH_OPS=1,
#   * the -std=c++17 flags in mmcv's setup.py raised to -std=c++20 (recent
#     torch headers need C++20),
#   * MAX_JOBS from the core count (and memory), ninja for parallel compiles.
# About 17+ minutes on 2 cores for CPU ops.
#
# CUDA ops (FORCE_CUDA=1; tools/install.sh sets it when it decides for CUDA,
# see docs/install.md "GPU (CUDA) install"): the script finds the toolkit itself
# (CUDA_HOME, CUDA_PATH, /usr/local/cuda, /usr/local/cuda-*, nvcc on PATH),
# requires nvcc's major version to equal torch.version.cuda's, and adds the
# headers that torch's pip dependencies ship (site-packages/nvidia/*/include,
# e.g. cusparse.h, which torch's CUDAContextLight.h includes and a minimal
# toolkit lacks) to CPATH.  TORCH_CUDA_ARCH_LIST (default: the visible GPUs',
# else "8.0;8.6;8.9;9.0+PTX") picks the cubins; ~18 minutes for 9.0 alone on 2
# cores, more per extra arch.  The wheel must then hold CUDA device code.  The wheel is written to --out (atomically);
# the build log is kept next to it as mmcv-<version>-build.log.
#
# Environment: MMCV_VERSION (default: the mmcv pin in constraints.txt),
# MAX_JOBS (default: nproc, capped by memory), MMCV_BUILD_NICE (default 10),
# FORCE_CUDA (default 0), TORCH_CUDA_ARCH_LIST, CUDA_HOME.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CONSTRAINTS="$ROOT/constraints.txt"
PY=""
OUT=""

die() { printf '[build_mmcv_wheel] ERROR: %s\n' "$*" >&2; exit 1; }
log() { printf '[build_mmcv_wheel] %s\n' "$*" >&2; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --python) PY="${2:?--python needs a value}"; shift 2 ;;
        --out) OUT="${2:?--out needs a value}"; shift 2 ;;
        -h|--help) sed -n '2,32p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
[[ -n "$PY" ]] || PY="$(command -v python || command -v python3 || true)"
[[ -n "$PY" && -x "$PY" ]] || die "no usable --python given"
[[ -n "$OUT" ]] || die "--out DIR is required"
[[ -f "$CONSTRAINTS" ]] || die "missing $CONSTRAINTS"

MMCV_VERSION="${MMCV_VERSION:-$(sed -n 's/^mmcv==\([^ ;#]*\).*/\1/p' "$CONSTRAINTS" | head -n1)}"
[[ -n "$MMCV_VERSION" ]] || die "no mmcv==X pin in $CONSTRAINTS and MMCV_VERSION unset"

pip_() { "$PY" -m pip --disable-pip-version-check "$@"; }

TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)" \
    || die "torch is not importable with $PY; install torch first (tools/install.sh does)"
log "building mmcv $MMCV_VERSION with ops against torch $TORCH_VERSION ($PY)"

# Build tooling, pinned by constraints.txt.  The venv's bin/ goes first on PATH
# so that torch's cpp_extension finds a ninja (it falls back to slow serial
# compiles without one).
pip_ install -q --progress-bar off -c "$CONSTRAINTS" "setuptools<81" wheel
PATH="$(dirname "$PY"):$PATH"
if ! command -v ninja >/dev/null 2>&1; then
    pip_ install -q --progress-bar off -c "$CONSTRAINTS" ninja
fi
command -v ninja >/dev/null 2>&1 || die "ninja is not available"
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 \
    || die "no C++ compiler found (install g++, e.g. apt-get install g++)"

FORCE_CUDA="${FORCE_CUDA:-0}"
CHECK_PY="$ROOT/timm_lambda_mmdet/mmcv_cuda.py"   # stdlib-only helpers, run as a script
if [[ "$FORCE_CUDA" == "1" ]]; then
    # The toolkit: nvcc whose major version matches torch's CUDA, and the headers torch's CUDA headers include.
    TORCH_CUDA="$("$PY" -c 'import torch; print(torch.version.cuda or "")')"
    [[ -n "$TORCH_CUDA" ]] || die "FORCE_CUDA=1, but torch $TORCH_VERSION has no CUDA (torch.version.cuda is None); install a CUDA build of torch"
    if [[ -z "${CUDA_HOME:-}" ]]; then
        for d in "${CUDA_PATH:-}" /usr/local/cuda $(ls -d /usr/local/cuda-* 2>/dev/null | sort -rV); do
            if [[ -n "$d" && -x "$d/bin/nvcc" ]]; then CUDA_HOME="$d"; break; fi
        done
    fi
    if [[ -z "${CUDA_HOME:-}" ]] && command -v nvcc >/dev/null 2>&1; then
        nvcc_real="$(readlink -f "$(command -v nvcc)")"
        CUDA_HOME="$(dirname "$(dirname "$nvcc_real")")"
        # a wrapper script (exec /usr/local/cuda-X/bin/nvcc "$@") is not inside a toolkit: ask nvcc itself
        [[ -d "$CUDA_HOME/include" ]] || CUDA_HOME="$(dirname "$(dirname "$(sed -n 's/^exec \([^ ]*nvcc\).*/\1/p' "$nvcc_real" | head -n1)")")"
    fi
    [[ -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/nvcc" ]] \
        || die "FORCE_CUDA=1 needs the CUDA $TORCH_CUDA toolkit (nvcc), found none in CUDA_HOME${CUDA_HOME:+=$CUDA_HOME}, CUDA_PATH, /usr/local/cuda*, PATH; install it (e.g. apt-get install cuda-toolkit-${TORCH_CUDA%%.*}-${TORCH_CUDA#*.}) and/or set CUDA_HOME"
    NVCC_CUDA="$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p' | head -n1)"
    [[ "${NVCC_CUDA%%.*}" == "${TORCH_CUDA%%.*}" ]] \
        || die "nvcc $CUDA_HOME/bin/nvcc is CUDA ${NVCC_CUDA:-?}, torch $TORCH_VERSION is built with CUDA $TORCH_CUDA: the major versions must match; set CUDA_HOME to a CUDA ${TORCH_CUDA%%.*}.x toolkit"
    export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
    # torch's pip dependencies ship CUDA headers (nvidia/cu13/include, nvidia/cusparse/include, ...): put them
    # on CPATH after the toolkit's own, for the headers a minimal toolkit lacks.
    NV_INC="$("$PY" - nvidia-include-dirs <"$CHECK_PY")"
    CPATH="$CUDA_HOME/include${NV_INC:+:$NV_INC}${CPATH:+:$CPATH}"
    export CPATH
    missing=""
    for h in cuda_runtime_api.h cusparse.h cublas_v2.h cusolverDn.h; do
        found=""
        IFS=: read -r -a inc_dirs <<<"$CPATH"
        for d in "${inc_dirs[@]}"; do [[ -f "$d/$h" ]] && { found=1; break; }; done
        [[ -n "$found" ]] || missing+=" $h"
    done
    [[ -z "$missing" ]] || die "CUDA headers missing:$missing (searched CPATH=$CPATH); install the toolkit's dev packages (e.g. cuda-libraries-dev-${TORCH_CUDA%%.*}-${TORCH_CUDA#*.}) or the nvidia-*-cu${TORCH_CUDA%%.*} pip packages torch depends on"
    TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$(TIMM_LAMBDA_MMCV_CUDA=1 "$PY" - decide <"$CHECK_PY" | sed -n 's/^archs=//p')}"
    export TORCH_CUDA_ARCH_LIST
    log "CUDA ops: nvcc $CUDA_HOME/bin/nvcc (CUDA $NVCC_CUDA, torch's $TORCH_CUDA), TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
fi

if [[ -z "${MAX_JOBS:-}" ]]; then
    cores="$(nproc 2>/dev/null || echo 2)"
    mem_gib="$(awk '/MemAvailable/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null || echo 0)"
    MAX_JOBS="$cores"
    # ~2 GiB per compiler process for the heavier mmcv sources
    if [[ "$mem_gib" -gt 0 && $((mem_gib / 2)) -lt "$MAX_JOBS" ]]; then MAX_JOBS=$((mem_gib / 2)); fi
    [[ "$MAX_JOBS" -ge 1 ]] || MAX_JOBS=1
fi
export MAX_JOBS

WORK="$(mktemp -d "${TMPDIR:-/tmp}/mmcv-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
LOG="$OUT/mmcv-$MMCV_VERSION-build.log"

# Fetch the sdist from the package index (never a wheel).
log "downloading the mmcv $MMCV_VERSION sdist"
pip_ download -q --progress-bar off --no-deps --no-binary mmcv --no-build-isolation \
    -d "$WORK/sdist" "mmcv==$MMCV_VERSION" \
    || die "could not download the mmcv==$MMCV_VERSION sdist"
sdist="$(ls "$WORK"/sdist/mmcv-"$MMCV_VERSION".tar.gz 2>/dev/null | head -n1)"
[[ -n "$sdist" ]] || die "pip download did not produce mmcv-$MMCV_VERSION.tar.gz"
tar -xzf "$sdist" -C "$WORK"
SRC="$WORK/mmcv-$MMCV_VERSION"
[[ -f "$SRC/setup.py" ]] || die "unexpected sdist layout: $SRC/setup.py missing"

# Raise the C++ standard: recent torch headers do not compile as C++17.
grep -q -- '-std=c++17' "$SRC/setup.py" || die "mmcv setup.py has no -std=c++17 flag to patch"
sed -i 's/-std=c++17/-std=c++20/g' "$SRC/setup.py"
if grep -q -- '-std=c++17' "$SRC/setup.py"; then die "patching -std=c++17 -> -std=c++20 failed"; fi

log "compiling (MAX_JOBS=$MAX_JOBS, nice ${MMCV_BUILD_NICE:-10}); log: $LOG"
start=$SECONDS
if ! MMCV_WITH_OPS=1 FORCE_CUDA="$FORCE_CUDA" nice -n "${MMCV_BUILD_NICE:-10}" \
        "$PY" -m pip --disable-pip-version-check wheel -v --progress-bar off \
        --no-build-isolation --no-deps -w "$WORK/wheel" "$SRC" >"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    die "mmcv build failed after $((SECONDS - start)) s; full log: $LOG"
fi
whl="$(ls "$WORK"/wheel/mmcv-"$MMCV_VERSION"-*.whl 2>/dev/null | head -n1)"
[[ -n "$whl" ]] || die "the build produced no mmcv wheel; see $LOG"
# The wheel must contain the compiled ops.
"$PY" - "$whl" <<'EOF' || die "the built wheel has no compiled ops (mmcv/_ext*.so); see $LOG"
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
sys.exit(0 if any(n.startswith("mmcv/_ext") and n.endswith(".so") for n in names) else 1)
EOF
if [[ "$FORCE_CUDA" == "1" ]]; then
    # FORCE_CUDA=1 must give CUDA kernels (device code in mmcv/_ext*.so), not a silent CPU-only build
    unzip_dir="$WORK/check"
    "$PY" -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract(n, sys.argv[2]) for n in z.namelist() if n.startswith("mmcv/_ext") and n.endswith(".so")]' "$whl" "$unzip_dir"
    "$PY" - has-cuda-ops "$(ls "$unzip_dir"/mmcv/_ext*.so | head -n1)" <"$CHECK_PY" \
        || die "FORCE_CUDA=1, but the built mmcv/_ext*.so holds no CUDA device code (.nv_fatbin); see $LOG"
fi
cp "$whl" "$OUT/.$(basename "$whl").part"
mv -f "$OUT/.$(basename "$whl").part" "$OUT/$(basename "$whl")"
log "built $OUT/$(basename "$whl") in $((SECONDS - start)) s"
echo "$OUT/$(basename "$whl")"
