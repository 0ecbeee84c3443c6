#!/bin/bash
# Issue 24 (weights quantized once, shared inputs, delayed scaling's compile time and host work)
# on one GPU, one device call per STAGE (each fits the 10-minute limit; the first call builds,
# later calls on the warm machine rebuild incrementally):
#   STAGE=tests   build; GPU tests of the delayed-scaling kernels and the remat / grad-accum /
#                 shared-input counts (the counting tests run on the GPU's compiled HLO)
#   STAGE=compile bench/compile_time.py at d2048 (trace+lower and XLA compile, program size)
#   STAGE=e2e     bench/e2e.py d2048, every row of the issue's table (E2E_ARGS to change it)
#   STAGE=e2e4096 bench/e2e.py d4096: bf16, Flax FP8 and delayed scaling, both timing modes
#   STAGE=remat   bench/scaling.py's d4096 8-layer remat model on 1 GPU, bf16 vs FP8
# Logs and JSON land in $OUT.
source "$(dirname "$0")/session_lib.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/card.txt"
CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
  || { tail -80 "$OUT/build.log"; exit 1; }
say "build done"
case "${STAGE:-tests}" in
  tests)
    timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_delayed_kernels.py \
      tests/test_weights_once.py tests/test_delayed_first_scale.py \
      "tests/test_ffi_quantize.py::test_gated_amax_runs_only_while_the_gate_is_zero" \
      2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^\[jaxquant tests\]" | tail -30 ;;
  compile)
    timeout 560 python3 bench/compile_time.py --size d2048 --repeat 1 \
      --variants bf16,fp8_current,fp8_delayed,modules_fp8_current,modules_fp8_delayed \
      2>&1 | tee "$OUT/compile_time.log" ;;
  e2e)
    timeout 560 python3 bench/e2e.py --size d2048 ${E2E_ARGS:-} --json "$OUT/e2e_d2048.json" \
      --trace-dir /tmp/e2e_traces 2>&1 | tee "$OUT/e2e_d2048.log" ;;
  e2e4096)
    timeout 560 python3 bench/e2e.py --size d4096 --steps 40 --profile-steps 0 \
      --variants ${VARIANTS:-bf16,flax_fp8_direct,fp8_delayed,modules_bf16,modules_fp8_delayed,bf16+fetch,flax_fp8_direct+fetch,fp8_delayed+fetch} \
      --json "$OUT/e2e_d4096.json" 2>&1 | tee "$OUT/e2e_d4096.log" ;;
  remat)
    timeout 560 python3 bench/scaling.py --recipe bf16,fp8_current --meshes 1 --d-model 4096 \
      --layers 8 --heads 32 --seq 2048 --batch 8 --remat --scan-layers --steps 6 \
      --json "$OUT/remat.json" 2>&1 | tee "$OUT/remat.log" ;;
  *) echo "STAGE=${STAGE}: expected tests, compile, e2e, e2e4096 or remat"; exit 2 ;;
esac
say "stage ${STAGE:-tests} done"
