#!/bin/bash
# One device call on 2 GPUs (issue 6): the multi-device tests on the FFI path, then
# bench/sharded_step.py (train_lm's step, 1 GPU vs --mesh dp=2). Logs land in $OUT.
# Uses a prebuilt cp312 extension when one is carried (jaxquant/_jaxquant_ffi.cpython-312-*.so),
# else builds. BENCH_TIMEOUT / TEST_TIMEOUT / TESTS_K / BENCH_ARGS override.
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/jaxquant_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/card.txt"
python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
CU=$(python3 -c "import nvidia.cu13; print(nvidia.cu13.__path__[0])" 2>/dev/null)
mkdir -p /tmp/py312shim/nvidia && ln -sfn "$CU" /tmp/py312shim/nvidia/cu13  # prebuilt RUNPATH
export PYTHONPATH=$PWD
if ! python3 -c "from jaxquant import _jaxquant_ffi as m; assert m.has_cuda(); print('extension: has_cuda', m.cuda_archs())"; then
  echo "no usable prebuilt extension: building"; rm -f jaxquant/_jaxquant_ffi*.so; unset PYTHONPATH
  SECONDS=0
  CMAKE_BUILD_PARALLEL_LEVEL=32 timeout 240 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || tail -30 "$OUT/build.log"
  echo "build: ${SECONDS}s"
fi
SECONDS=0
timeout "${BENCH_TIMEOUT:-85}" python3 bench/sharded_step.py --mesh dp=2 ${BENCH_ARGS:---layers 2 --steps 15 --warmup 2} --json "$OUT/step.json" 2>&1 | tee "$OUT/step.log" | grep -v "^ "
echo "bench: ${SECONDS}s"
SECONDS=0
for i in 0 1 2 3; do
  JAXQUANT_MULTIDEVICE=1 timeout "${TEST_TIMEOUT:-95}" python3 -m pytest -q -p no:cacheprovider \
    --jaxquant-shard=$i/4 -k "${TESTS_K-not reference}" tests/multidevice > "$OUT/tests_$i.log" 2>&1 &
done
wait
echo "tests: ${SECONDS}s"
for i in 0 1 2 3; do grep -v "^\[jaxquant" "$OUT/tests_$i.log" | grep -E "passed|failed|FAILED|Error|error" | tail -12; done
