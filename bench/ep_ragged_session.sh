#!/bin/bash
# The ragged expert exchange on a machine with NGPU (4, default) GPUs, about 3 minutes
# (results in $OUT):
#   1. the GPU tests of tests/multidevice/test_expert_parallel_ragged.py: ragged vs fixed-size
#      dropless exchange bit for bit on 2 and NGPU GPUs (real ragged_all_to_all and its
#      transpose), the lm MoE layer (bf16, fp8_current) with either exchange;
#   2. bench/scaling.py: mesh_session.sh's MoE (d_model 1024, 4 layers, 8 experts top-2, bf16
#      experts, SGD, 6 steps) dropless, on 1 GPU and at ep=NGPU (auto: the ragged exchange),
#      losses of the 6 steps compared; EXTRA=1 adds ep=NGPU with the fixed-size dropless
#      exchange (the peer it replaces) if time is left.
# Runs from the source tree (PYTHONPATH), no extension build: bf16 experts are
# jax.lax.ragged_dot, the FP8 layer test takes the reference path.
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/jaxquant_out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
DEADLINE=${DEADLINE:-200}
NGPU=${NGPU:-4}
SECONDS=0
say() { echo "[$SECONDS s] $*" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
MOE="--d-model 1024 --layers 4 --heads 16 --seq 2048 --batch 8 --moe 8,2 --remat --scan-layers --optimizer sgd --steps 6 --warmup 2"
# An XLA that rejects an overlap flag would stop the bench at start-up: check them once.
FLAGS=$(python3 -c "import sys; sys.path.insert(0, 'examples'); from lm.xla_flags import OVERLAP_FLAGS; print(' '.join(OVERLAP_FLAGS))")
if ! XLA_FLAGS="$FLAGS" JAX_PLATFORMS=cpu timeout 60 python3 -c "import jax; jax.devices()" >> "$LOG" 2>&1; then
  say "XLA rejects an overlap flag: the bench runs with --no-xla-overlap"; MOE="$MOE --no-xla-overlap"
fi

say "GPU tests"
JAXQUANT_MULTIDEVICE=1 timeout 110 python3 -m pytest -q -s -p no:cacheprovider -m gpu \
  tests/multidevice/test_expert_parallel_ragged.py 2>&1 | sed -E "s/\[jaxquant tests\].*$//" \
  | tail -40 | tee -a "$LOG"

bench() {  # name args...: bench/scaling.py within the time left
  local name=$1; shift
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 40 ]; then say "$name: skipped (${left}s left)"; return; fi
  say "$name: start"
  timeout "$left" python3 bench/scaling.py --recipe bf16 "$@" $MOE --json "$OUT/$name.json" \
    > "/tmp/$name.log" 2>&1
  say "$name: exit $?"
  grep -E "ms/step|ep exchange|rror|Traceback" "/tmp/$name.log" | cut -c1-400 | tee -a "$LOG"
  python3 bench/mesh_report.py "$OUT/$name.json" >> "$LOG" 2>&1
}

bench moe_ragged --meshes 1/ep=$NGPU
[ "${EXTRA:-0}" = 1 ] && bench moe_fixed --meshes ep=$NGPU --moe-exchange fixed
say "done"
