#!/bin/bash
# One device call for bench/e2e.py: build the extension with its CUDA kernels, run the GPU tests
# named in TESTS (default: the XLA-fused quantize, delayed scaling's first scale and the gated
# amax it uses), then bench/e2e.py with E2E_ARGS. Logs, the
# JSON and the kernel-time splits land in $OUT (the device tool's output folder).
#   E2E_ARGS="--size d2048 --variants bf16,fp8_current" bash bench/e2e_session.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jaxquant_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/card.txt"
SECONDS=0
CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
  || { tail -80 "$OUT/build.log"; exit 1; }
echo "build: ${SECONDS}s"
DEFAULT_TESTS="tests/test_xla_quantize.py tests/test_delayed_first_scale.py tests/test_ffi_quantize.py::test_gated_amax_runs_only_while_the_gate_is_zero"
if [ -n "${TESTS-$DEFAULT_TESTS}" ]; then
  SECONDS=0
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -m gpu \
    -n "${NPROC:-4}" -p no:cacheprovider ${TESTS:-$DEFAULT_TESTS} \
    2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^\[jaxquant tests\]" | tail -30
  echo "gpu tests: ${SECONDS}s"
fi
SECONDS=0
timeout "${E2E_TIMEOUT:-420}" python3 bench/e2e.py ${E2E_ARGS:-} --json "$OUT/e2e.json" \
  --trace-dir /tmp/e2e_traces 2>&1 | tee "$OUT/e2e.log"
echo "e2e: ${SECONDS}s"
