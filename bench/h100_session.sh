#!/bin/bash
# One device call: build the extension with its CUDA kernels, run the GPU tests of the FFI, then
# bench/quantize.py. Logs and the JSON land in $OUT (the device tool's output folder).
#   bash bench/h100_session.sh            # TEST_TIMEOUT / BENCH_TIMEOUT / NPROC / TESTS override
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jaxquant_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/card.txt"
python3 -c "import jax, scikit_build_core, nanobind; print('jax', jax.__version__, '| scikit-build-core', scikit_build_core.__version__, '| nanobind', nanobind.__version__)"
SECONDS=0
CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
  || { tail -80 "$OUT/build.log"; exit 1; }
echo "build: ${SECONDS}s"
python3 -c "from jaxquant import _jaxquant_ffi as m; print('has_cuda', m.has_cuda(), 'archs', m.cuda_archs())"
SECONDS=0
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu \
  -n "${NPROC:-6}" -p no:cacheprovider ${TESTS:-tests/test_ffi_quantize.py tests/test_ffi_storage.py} \
  2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^\[jaxquant tests\]" | tail -70
echo "gpu tests: ${SECONDS}s"
SECONDS=0
timeout "${BENCH_TIMEOUT:-220}" python3 bench/quantize.py ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 \
  | tee "$OUT/bench.log" | grep -v "^  "
echo "bench: ${SECONDS}s"
