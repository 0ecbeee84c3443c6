#!/bin/bash
# One call on a 4-GPU machine that checks several issues at once (logs in $OUT):
#   1. the README's GPU install as written, offline (`pip install --no-index --no-build-isolation
#      -e ".[cuda,test,examples]"`; the CUDA wheels jax[cuda13] asks for that the image lacks
#      were installed from carried wheels first), then `python examples/train_lm.py`;
#   2. in parallel, one GPU each: the GPU tests of GPU_TESTS (GPU 0, after train_lm), the
#      end-to-end step at d2048 (GPU 1) and d4096 (GPU 2), EXTRA_ONE (GPU 3);
# $OUT keeps 8 logs (the device tool returns 8 files): JSONs stay in /tmp, tables are in the logs.
#   3. on all 4 GPUs: MULTI_TESTS (pytest), then MESH_JOBS (one command per line, each given
#      `--json /tmp/meshN.json`), until DEADLINE seconds.
source "$(dirname "$0")/session_lib.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"

say "install: python3 -m pip install --no-index --no-build-isolation -e \".[cuda,test,examples]\""
CMAKE_BUILD_PARALLEL_LEVEL=64 python3 -m pip install --no-index --no-build-isolation \
  -e ".[cuda,test,examples]" > "$OUT/install.log" 2>&1
say "install exit $?"; grep -i "error\|Successfully\|requires\|sm90" "$OUT/install.log" | head -20 | tee -a "$LOG"
python3 -c "import jaxquant, jax; from jaxquant import _jaxquant_ffi as m; print(jax.devices()[0].device_kind, 'cuda', m.has_cuda(), 'sm90', m.grouped_sm90_status())" 2>&1 | tee -a "$LOG"

gpu() { CUDA_VISIBLE_DEVICES=$1 bash -c "$2" > "$OUT/$3.log" 2>&1; say "$3 exit $?"; }
( T0=$SECONDS; gpu 0 "python3 examples/train_lm.py --no-progress" train_lm
  say "train_lm wall $((SECONDS - T0)) s"
  [ -n "${GPU_TESTS:-}" ] && gpu 0 "timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu -p no:cacheprovider $GPU_TESTS" gpu_tests ) &
( gpu 1 "timeout ${E2E_TIMEOUT:-330} python3 bench/e2e.py --size d2048 --variants ${E2E_VARIANTS:-bf16,flax_fp8_direct,fp8_current,fp8_delayed,fp8_block} --steps 100 --json /tmp/e2e_d2048.json --trace-dir /tmp/e2e2048" e2e_d2048 ) &
( gpu 2 "timeout ${E2E_TIMEOUT:-330} python3 bench/e2e.py --size d4096 --variants ${E2E4_VARIANTS:-bf16,fp8_current,fp8_delayed} --steps 40 --json /tmp/e2e_d4096.json --trace-dir /tmp/e2e4096" e2e_d4096 ) &
( [ -n "${EXTRA_ONE:-}" ] && gpu 3 "$EXTRA_ONE" extra_one ) &
wait
say "single-GPU phase done"
if [ -n "${MULTI_TESTS:-}" ]; then
  JAXQUANT_MULTIDEVICE=1 timeout "${MULTI_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider $MULTI_TESTS > "$OUT/multi_tests.log" 2>&1
  say "multi tests exit $?"; tail -3 "$OUT/multi_tests.log" | tee -a "$LOG"
fi
to_table() {
  timeout "$2" bash -c "$3 --json /tmp/mesh$1.json" 2>&1 \
    | grep -E "ms/step|rror|per device|exchange" | cut -c1-300 | tee -a "$LOG"
}
mesh_jobs to_table
say "done"
