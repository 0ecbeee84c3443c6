#!/bin/bash
# One device call of issue 14 on a machine with NGPU (4, default, or 2) GPUs (bench/scaling.py,
# results in $OUT):
#   phase 1, each on its own GPU, while the extension builds: bf16 1 GPU, MoE 1 GPU (bf16
#     experts, ragged_dot), then fp8_current 1 GPU once the build is done (and a GPU is free);
#   phase 2, all GPUs, one job at a time: bf16 and fp8_current interleaved at dp=N and tp=N,
#     the MoE at ep=N, bf16/fp8 at dp=2 x tp=N/2 (4 GPUs), fp8 at dp=N without the XLA
#     overlap flags.
# Everything stops at DEADLINE seconds (default 300); each job writes its JSON as it goes.
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/jaxquant_out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
DEADLINE=${DEADLINE:-300}
NGPU=${NGPU:-4}
ALL=$(seq -s, 0 $((NGPU - 1)))
SECONDS=0
say() { echo "[$SECONDS s] $*" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$LOG"
say "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
DENSE0="--d-model 4096 --layers 8 --heads 32 --seq 2048 --batch 8 --remat --scan-layers --steps ${STEPS:-6} --warmup 2"
MOE0="--d-model 1024 --layers 4 --heads 16 --seq 2048 --batch 8 --moe 8,2 --moe-capacity 1.5 --remat --scan-layers --optimizer sgd --steps 6 --warmup 2"

job() {  # name gpus extra-env args...: bench/scaling.py with a share of the time left
  local name=$1 gpus=$2 envs=$3; shift 3
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 30 ]; then say "$name: skipped (${left}s left)"; return; fi
  say "$name: start (gpus $gpus)"
  env $envs CUDA_VISIBLE_DEVICES=$gpus timeout "$left" python3 bench/scaling.py "$@" \
    --json "$OUT/$name.json" > "/tmp/$name.log" 2>&1
  say "$name: exit $?"
  grep -E "ms/step|rror|Traceback" "/tmp/$name.log" | cut -c1-400 | tee -a "$LOG"
}

DENSE="$DENSE0"; MOE="$MOE0"
# An XLA that rejects an overlap flag would stop every job at start-up: check them once.
FLAGS=$(python3 -c "import sys; sys.path.insert(0, 'examples'); from lm.xla_flags import OVERLAP_FLAGS; print(' '.join(OVERLAP_FLAGS))")
NOOV=""
if ! XLA_FLAGS="$FLAGS" JAX_PLATFORMS=cpu timeout 60 python3 -c "import jax; jax.devices()" >> "$LOG" 2>&1; then
  say "XLA rejects an overlap flag: every job runs with --no-xla-overlap"; NOOV=--no-xla-overlap
fi
DENSE="$DENSE0 $NOOV"; MOE="$MOE0 $NOOV"
# The extension (the FP8 paths need it); bf16 and the bf16 MoE run from the source tree meanwhile.
rm -f jaxquant/_jaxquant_ffi*.so
(CMAKE_BUILD_PARALLEL_LEVEL=64 timeout 240 python3 -m pip install --no-build-isolation --no-deps \
   -e . > /tmp/build.log 2>&1; echo "build exit $?" >> /tmp/build.log) &
BUILD=$!
job bf16_one 0 "PYTHONPATH=$PWD" --recipe bf16 --meshes 1 $DENSE &
ONE=$!
job moe_one 1 "PYTHONPATH=$PWD" --recipe bf16 --meshes 1 $MOE &
MOE1=$!
wait $BUILD
say "build: $(tail -1 /tmp/build.log)"; tail -5 /tmp/build.log >> "$LOG"
FP8GPU=2
[ "$NGPU" -lt 4 ] && { wait $ONE; FP8GPU=0; }
if python3 -c "from jaxquant import _jaxquant_ffi as m; assert m.has_cuda()" >> "$LOG" 2>&1; then
  job fp8_one $FP8GPU "" --recipe fp8_current --meshes 1 $DENSE
else
  say "no CUDA extension: FP8 jobs skipped"; tail -40 /tmp/build.log >> "$LOG"
fi
wait $ONE $MOE1
job dense_a $ALL "" --recipe bf16,fp8_current --meshes dp=$NGPU/tp=$NGPU $DENSE
job moe_mesh $ALL "" --recipe bf16 --meshes ep=$NGPU $MOE
[ "$NGPU" -ge 4 ] && job dense_b $ALL "" --recipe bf16,fp8_current --meshes dp=2,tp=$((NGPU / 2)) $DENSE
[ -z "$NOOV" ] && job no_overlap $ALL "" --recipe fp8_current --meshes dp=$NGPU --no-xla-overlap $DENSE
python3 bench/mesh_report.py "$OUT"/*.json >> "$LOG" 2>&1
say "done"
