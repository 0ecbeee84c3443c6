#!/bin/bash
# One device call for issue 15 (run from the worktree root): build the extension with the
# CUTLASS Hopper grouped GEMM (headers from $JAXQUANT_CUTLASS_DIR), run the GPU tests of the
# grouped FFI targets, then bench/grouped.py --gemms (grouped GEMMs alone vs the dense bf16 / FP8
# GEMMs of the same FLOPs, and GroupedDense steps). Logs and the JSON land in $OUT.
#   BUILD_TIMEOUT / TEST_TIMEOUT / BENCH_TIMEOUT / NPROC / TESTS / TEST_K (pytest -k) / BENCH_ARGS /
#   SKIP_TESTS / SKIP_BENCH override
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/jaxquant_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/card.txt"
SECONDS=0
CMAKE_BUILD_PARALLEL_LEVEL=16 timeout "${BUILD_TIMEOUT:-300}" python3 -m pip install -v \
  --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: ${SECONDS}s"
grep -i "grouped sm90\|spill\|stack frame" "$OUT/build.log" | sort | uniq -c | head -20
python3 -c "from jaxquant import _jaxquant_ffi as m; print('sm90:', m.grouped_sm90_status()); print(sorted(t for t in m.registrations()['CUDA'] if 'grouped' in t))"
if [ -z "${SKIP_TESTS:-}" ]; then
  SECONDS=0
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu -n "${NPROC:-4}" -p no:cacheprovider \
    -k "${TEST_K:-}" ${TESTS:-tests/test_grouped_ffi.py} 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -v "^\[jaxquant tests\]" | tail -40
  echo "gpu tests: ${SECONDS}s"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  SECONDS=0
  timeout "${BENCH_TIMEOUT:-240}" python3 bench/grouped.py --gemms ${BENCH_ARGS:-} \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -60
  echo "bench: ${SECONDS}s"
fi
