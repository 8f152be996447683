#!/usr/bin/env bash
# On a machine with a CUDA GPU (never in CI): the CUDA tests, then the lambda layer against cuDNN's 3x3 convolution and
# the model comparisons (docs/benchmarks.md, "GPU"), each section under its own time limit so that one hang does not
# cost the rest. Logs and JSON go to $OUT (default work_dirs/gpu_check); $PYTHON (default .venv/bin/python, else
# python3) runs them. About 6 minutes on an H200.
#
#   bash tools/gpu_check.sh
#   OUT=/tmp/gpu WORKERS=16 bash tools/gpu_check.sh
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=${OUT:-work_dirs/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(), torch.__version__)" || exit 1

# mmdet's Mask R-CNN test needs mmcv's CUDA ops (docs/install.md, "GPU (CUDA) install"): left out here
timeout "${T_TESTS:-900}" "$PY" -m pytest -o addopts="" -m cuda tests/test_cuda.py -k "not mmdet" -n "${WORKERS:-8}" -q \
    --tb=short -rfE > "$OUT/tests.log" 2>&1
echo "CUDA tests: exit code $? ($OUT/tests.log)"; tail -1 "$OUT/tests.log"

for mode in train eval; do
    for batch in 1 8; do
        for dtype in float32 bfloat16; do
            timeout 180 "$PY" tools/benchmark_lambda_layer.py --device cuda --tf32 --dtype $dtype --batch $batch \
                --mode $mode --repeats 15 --json "$OUT/lambda_layer_${dtype}_b${batch}_${mode}.json" 2>&1 | grep -v '^|---'
        done
    done
done
timeout 600 "$PY" tools/benchmark_models.py cuda --repeats 10 --json "$OUT/models_cuda.json"
timeout 300 "$PY" tools/benchmark_models.py c4 --device cuda --repeats 10
timeout 300 "$PY" tools/benchmark_models.py backbone --device cuda --repeats 10
