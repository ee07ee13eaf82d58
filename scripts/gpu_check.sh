#!/usr/bin/env bash
# GPU acceptance check for rawpaged's CUDA backend, for a CUDA host with no package index: runs from the source
# tree (PYTHONPATH=.), needs no model files, and reports whatever happens. Stages, in order, each with its own
# time cap (a slow stage cannot starve the next) and an overall budget (a stage that no longer fits is SKIPped):
#   env              GPU, driver, Python and package versions
#   wheels           the wheels of scripts/gpu_wheels.sh (pydantic, llguidance) into a target folder, if WHEELS is there
#   imports          numba, ml_dtypes and cupy import together against the host's NumPy; rawpaged and its CUDA backend
#   engine-timed     rawpaged/tools/check_cuda_engine.py on the default model's shape: CUDA vs CPU greedy equality, eager
#                    and with CUDA graphs, decode tok/s at batch 1/8/32/64, a 512-token prefill
#   pytest           pytest -m cuda tests (CudaBackend vs the CPU backend and float64 references on the device)
#   bench            benchmarks/kernels_cuda.py (paged_attention bandwidth vs copy bandwidth)
#   server           scripts/server_smoke.py: python server.py --device cuda on a random model of the default shape
#                    (streamed chat, websocket, n=4, json_object, 16 concurrent completions, every block back)
#   engine-features  check_cuda_engine.py's other shapes (head_dim 128, Q8_0 on load, Mistral window, Qwen3)
#   engine-moe       check_cuda_engine.py's random mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral): CUDA vs CPU
#                    greedy equality through the MoE kernels
#   sanitizer        compute-sanitizer --tool memcheck over the kernel tests; optional: a refusal is reported
#                    (REFUSED), not a failure
# Each stage writes stage_<name>.json (status, exit code, seconds, cap, log tail) and its log to --out as soon as
# it ends, plus its own JSON (engine_<shape>.json, kernels_cuda.json, server_smoke.json, pytest_cuda.xml);
# summary.txt holds the device name and a PASS/FAIL/SKIP/TIMEOUT line per stage, rewritten after each stage.
# --archive FILE packs --out into FILE after each stage (for a runner that returns only a few files).
#
# Usage: scripts/gpu_check.sh [--out DIR] [--archive FILE] [--budget SECONDS] [--quick] [--collect-only]
#        [--stages a,b,...]
#   --collect-only: collect the CUDA tests and check the stage list, no GPU needed (CI runs it as the host would)
#   --budget: overall seconds (default 480); --stages: run only these (e.g. to rerun what failed)
# Needs: python3 with cupy-cuda12x or cupy-cuda13x, numpy, numba, ml_dtypes, pytest, aiohttp; the server stage
# also pydantic and llguidance (carried as wheels: scripts/gpu_wheels.sh, then carry .whl).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=gpu_check_out
ARCHIVE=
BUDGET=480
QUICK=()
COLLECT_ONLY=0
STAGES_WANTED=
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/rawpaged-site}
ALL_STAGES=(env wheels imports engine-timed pytest bench server engine-features engine-moe sanitizer)
declare -A CAP=([env]=20 [wheels]=40 [imports]=60 [engine-timed]=150 [pytest]=110 [bench]=60 [server]=90
    [engine-features]=90 [engine-moe]=90 [sanitizer]=90)
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT_DIR="$2"; shift 2 ;;
        --archive) ARCHIVE="$2"; shift 2 ;;
        --budget) BUDGET="$2"; shift 2 ;;
        --quick) QUICK=(--quick); shift ;;
        --collect-only) COLLECT_ONLY=1; shift ;;
        --stages) STAGES_WANTED=",$2,"; shift 2 ;;
        *) echo "usage: $0 [--out DIR] [--archive FILE] [--budget S] [--quick] [--collect-only] [--stages a,b]" >&2
           exit 2 ;;
    esac
done
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
CUDA_TESTS=(-m cuda -p no:cacheprovider tests)

if [ -n "$STAGES_WANTED" ]; then
    for s in ${STAGES_WANTED//,/ }; do
        [ -n "${CAP[$s]:-}" ] || { echo "unknown stage $s (stages: ${ALL_STAGES[*]})" >&2; exit 2; }
    done
fi
if [ "$COLLECT_ONLY" = 1 ]; then
    RAWPAGED_REQUIRE_CUDA=0 $PY -m pytest --collect-only -q "${CUDA_TESTS[@]}"
    exit $?
fi
export RAWPAGED_REQUIRE_CUDA=1  # the CUDA tests fail instead of skipping without a GPU
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/summary.txt"
DEVICE_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
declare -A STATUS OPTIONAL
ORDER=()

write_summary() {
    {
        echo "device: ${DEVICE_NAME:-unknown (nvidia-smi gave nothing)}"
        echo "budget: ${BUDGET} s, used ${SECONDS} s"
        for s in "${ORDER[@]}"; do echo "${STATUS[$s]} $s"; done
    } > "$OUT_DIR/summary.txt"
    if [ -n "$ARCHIVE" ]; then tar czf "$ARCHIVE" -C "$OUT_DIR" . 2>/dev/null; fi
}

# run_stage NAME [optional] -- COMMAND...: runs COMMAND under min(cap, budget left), logs to stage_NAME.log, records
# stage_NAME.json. An optional stage whose log says the device is not supported is REFUSED, not FAIL.
run_stage() {
    local name=$1; shift
    local optional=0
    if [ "$1" = optional ]; then optional=1; shift; fi
    shift  # --
    if [ -n "$STAGES_WANTED" ] && [[ "$STAGES_WANTED" != *",$name,"* ]]; then return; fi
    ORDER+=("$name")
    [ "$optional" = 1 ] && OPTIONAL[$name]=1
    local left=$(( BUDGET - SECONDS )) cap=${CAP[$name]}
    local limit=$(( cap < left ? cap : left ))
    local log="$OUT_DIR/stage_$name.log" rc status start=$SECONDS
    echo "== $name (cap ${cap} s, ${left} s of the budget left)"
    if [ "$limit" -lt 10 ] || { [ "$optional" = 1 ] && [ "$limit" -lt "$cap" ]; }; then
        status=SKIP; rc=-1
        echo "skipped: ${left} s left of the budget" | tee "$log"
    else
        timeout -k 5 "$limit" "$@" 2>&1 | tee "$log"
        rc=${PIPESTATUS[0]}
        if [ $rc = 0 ]; then status=PASS
        elif [ $rc = 124 ] || [ $rc = 137 ]; then status=TIMEOUT
        elif [ "$optional" = 1 ] && grep -qiE "not supported|unsupported|error 999|refused" "$log"; then status=REFUSED
        else status=FAIL
        fi
    fi
    STATUS[$name]=$status
    echo "-> $status $name (exit $rc, $(( SECONDS - start )) s)"
    $PY - "$OUT_DIR/stage_$name.json" "$name" "$status" "$rc" "$(( SECONDS - start ))" "$limit" "$log" <<'EOF'
import json, sys
path, name, status, rc, seconds, limit, log = sys.argv[1:]
try:
    tail = open(log, errors="replace").read().splitlines()[-30:]
except OSError:
    tail = []
json.dump({"stage": name, "status": status, "exit_code": int(rc), "seconds": int(seconds), "limit_s": int(limit),
           "log": log.rsplit("/", 1)[-1], "tail": tail}, open(path, "w"), indent=2)
EOF
    write_summary
}

stage_env() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    nproc; uname -r
    $PY - <<'EOF'
import importlib.metadata as md, sys
print("python", sys.version.split()[0])
for name in ("numpy", "numba", "llvmlite", "ml_dtypes", "cupy-cuda13x", "cupy-cuda12x", "pytest", "aiohttp",
             "pydantic", "llguidance", "safetensors", "tokenizers"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "absent")
EOF
}

stage_wheels() {
    if ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
        echo "no wheels in $WHEELS: the server stage needs pydantic and llguidance installed (scripts/gpu_wheels.sh)"
        return 0
    fi
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
        && ls "$SITE"
}

stage_imports() {
    $PY - <<'EOF'
import json, sys, time
t0 = time.perf_counter()
import numpy, numba, ml_dtypes, cupy  # together, against the host's NumPy
print("numpy", numpy.__version__, "| numba", numba.__version__, "| ml_dtypes", ml_dtypes.__version__,
      "| cupy", cupy.__version__)
print("CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(), "| driver", cupy.cuda.runtime.driverGetVersion(),
      "| devices", cupy.cuda.runtime.getDeviceCount())
import rawpaged
from rawpaged.kernels.cuda.backend import CudaBackend
be = CudaBackend()
x = cupy.arange(8, dtype=cupy.float32)
assert float((x * 2).sum()) == 56.0
print("rawpaged", rawpaged.__version__, "| CudaBackend on", be.device.id, "| SMs", be.num_sms,
      "| smem opt-in", be.max_smem_optin, f"| {time.perf_counter() - t0:.1f} s")
EOF
}

if [ -d "$WHEELS" ]; then export PYTHONPATH="$SITE:$PYTHONPATH"; fi
export PY SITE WHEELS
export -f stage_env stage_wheels stage_imports  # timeout runs them in a child bash
run_stage env -- bash -c stage_env
run_stage wheels -- bash -c stage_wheels
run_stage imports -- bash -c stage_imports
run_stage engine-timed -- $PY -m rawpaged.tools.check_cuda_engine --out "$OUT_DIR" --shapes smollm2-135m-shape
run_stage pytest -- $PY -m pytest -q --junitxml="$OUT_DIR/pytest_cuda.xml" "${CUDA_TESTS[@]}"
run_stage bench -- $PY benchmarks/kernels_cuda.py --out "$OUT_DIR" ${QUICK[@]+"${QUICK[@]}"}
run_stage server -- $PY scripts/server_smoke.py --device cuda --out "$OUT_DIR"
run_stage engine-features -- $PY -m rawpaged.tools.check_cuda_engine --out "$OUT_DIR" \
    --shapes llama-like-head128,q8_0-on-load,mistral-window256-yarn,qwen3-head128-llama3
run_stage engine-moe -- $PY -m rawpaged.tools.check_cuda_engine --out "$OUT_DIR" \
    --shapes qwen3-moe-head64,qwen2-moe-head64,mixtral-head64
if command -v compute-sanitizer > /dev/null; then
    run_stage sanitizer optional -- compute-sanitizer --tool memcheck --error-exitcode 1 \
        $PY -m pytest -q -x tests/kernels/test_cuda_gpu.py -m cuda -p no:cacheprovider -k "not graph"
fi

echo
echo "== summary (files in $OUT_DIR)"
[ -f "$OUT_DIR/kernels_cuda.txt" ] && cat "$OUT_DIR/kernels_cuda.txt"
cat "$OUT_DIR/summary.txt"
status=0
for s in "${ORDER[@]}"; do  # an optional stage reports, it does not fail the check
    case "${STATUS[$s]}" in PASS|REFUSED) ;; *) [ -n "${OPTIONAL[$s]:-}" ] || status=1 ;; esac
done
exit $status
