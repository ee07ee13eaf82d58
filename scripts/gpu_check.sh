#!/usr/bin/env bash
# GPU acceptance check for rawpaged's CUDA backend, for a CUDA host with no network (no pip): runs from the
# source tree with PYTHONPATH=., needs no model files, finishes in under 6 minutes.
#   1. environment (GPU, driver, CuPy),
#   2. the CUDA tests (CudaBackend vs the CPU backend and float64 references on the device), named by file:
#      `pytest -m cuda tests` would import every test module first, and those needing gguf or openai
#      (absent on a GPU host without a package index) would end the run with collection errors,
#   3. the kernel microbenchmark (benchmarks/kernels_cuda.py: paged_attention bandwidth vs copy bandwidth),
#   4. the engine's greedy-equality check (rawpaged/check_cuda_engine.py): CUDA vs CPU engine on seeded random
#      weights, eager and with decode replayed from CUDA graphs (--no-enforce-eager), decode tok/s at batch
#      1, 8, 32 and 64 for both and a 512-token prefill,
# then prints the benchmark table and a PASS/FAIL summary last.
#
# Usage: scripts/gpu_check.sh [--out DIR] [--quick] [--collect-only]      (default DIR: gpu_check_out)
#   --collect-only: only collect the CUDA tests (no GPU needed, pytest is: pip install -e ".[test]"; CI runs it
#                   without gguf/openai)
# Needs: python3 with cupy-cuda12x or cupy-cuda13x, numpy, numba, ml_dtypes, pytest.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=gpu_check_out
QUICK=()
COLLECT_ONLY=0
# every module with cuda-marked tests; tests/test_gpu_check.py checks this list against the markers
CUDA_TEST_FILES=(tests/kernels/test_cuda_gpu.py)
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT_DIR="$2"; shift 2 ;;
        --quick) QUICK=(--quick); shift ;;
        --collect-only) COLLECT_ONLY=1; shift ;;
        *) echo "usage: $0 [--out DIR] [--quick] [--collect-only]" >&2; exit 2 ;;
    esac
done
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export RAWPAGED_REQUIRE_CUDA=1  # tests/kernels/test_cuda_gpu.py fails instead of skipping without a GPU
PY=${PYTHON:-python3}
declare -A RESULT

if [ "$COLLECT_ONLY" = 1 ]; then
    RAWPAGED_REQUIRE_CUDA=0 $PY -m pytest -m cuda --collect-only -q -p no:cacheprovider "${CUDA_TEST_FILES[@]}"
    exit $?
fi
mkdir -p "$OUT_DIR"

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$OUT_DIR/env.txt"
$PY - <<'EOF' 2>&1 | tee -a "$OUT_DIR/env.txt"
import sys
import cupy
print("python", sys.version.split()[0], "| cupy", cupy.__version__, "| CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(),
      "| driver", cupy.cuda.runtime.driverGetVersion(), "| devices", cupy.cuda.runtime.getDeviceCount())
EOF

echo "== CUDA tests: ${CUDA_TEST_FILES[*]}"
timeout 170 $PY -m pytest -m cuda -q -p no:cacheprovider "${CUDA_TEST_FILES[@]}" 2>&1 | tee "$OUT_DIR/pytest_cuda.log"
RESULT[pytest]=${PIPESTATUS[0]}

echo "== kernel microbenchmark"
timeout 110 $PY benchmarks/kernels_cuda.py --out "$OUT_DIR" ${QUICK[@]+"${QUICK[@]}"} 2>&1 | tee "$OUT_DIR/bench.log"
RESULT[bench]=${PIPESTATUS[0]}

# Engine greedy equality: CUDA vs CPU engine on random models of the default and a head_dim-128 shape.
if [ -f rawpaged/check_cuda_engine.py ]; then
    echo "== engine greedy equality"
    budget=$(( 345 - SECONDS )); [ $budget -lt 30 ] && budget=30  # keep the whole script under 6 minutes
    timeout $budget $PY -m rawpaged.check_cuda_engine --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/engine.log"
    RESULT[engine]=${PIPESTATUS[0]}
fi

echo
echo "== summary (files in $OUT_DIR)"
[ -f "$OUT_DIR/kernels_cuda.txt" ] && cat "$OUT_DIR/kernels_cuda.txt"
status=0
for k in "${!RESULT[@]}"; do
    if [ "${RESULT[$k]}" = 0 ]; then echo "PASS $k"; else echo "FAIL $k (exit ${RESULT[$k]})"; status=1; fi
done
exit $status
