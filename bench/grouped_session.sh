#!/bin/bash
# One device call for issue 7: build the extension (grouped kernels included), run the GPU tests
# of the grouped FFI targets, then bench/grouped.py (8 and 64 experts, every recipe vs bf16
# jax.lax.ragged_dot). Logs and the JSON land in $OUT.
#   TEST_TIMEOUT / BENCH_TIMEOUT / NPROC / TESTS / BENCH_ARGS / SKIP_TESTS override
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/jaxquant_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/card.txt"
SECONDS=0
CMAKE_BUILD_PARALLEL_LEVEL=16 timeout "${BUILD_TIMEOUT:-300}" python3 -m pip install --no-build-isolation \
  --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: ${SECONDS}s"
python3 -c "from jaxquant import _jaxquant_ffi as m; print('has_cuda', m.has_cuda(), sorted(t for t in m.registrations()['CUDA'] if 'grouped' in t))"
if [ -z "${SKIP_TESTS:-}" ]; then
  SECONDS=0
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -m gpu -x -n "${NPROC:-4}" -p no:cacheprovider \
    ${TESTS:-tests/test_grouped_ffi.py} 2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^\[jaxquant tests\]" | tail -40
  echo "gpu tests: ${SECONDS}s"
fi
SECONDS=0
timeout "${BENCH_TIMEOUT:-200}" python3 bench/grouped.py ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 \
  | tee "$OUT/bench.log" | tail -40
echo "bench: ${SECONDS}s"
