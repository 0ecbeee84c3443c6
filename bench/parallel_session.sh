#!/bin/bash
# One device call on an NGPU-GPU host: build the extension (CUTLASS headers from
# JAXQUANT_CUTLASS_DIR when set), run up to four single-GPU jobs in parallel (JOB0..JOB3, one
# GPU each, logs $OUT/jobN.log), then MESH_JOBS (one command per line, all GPUs, log
# $OUT/mesh.log) until DEADLINE seconds. Files a job writes under /tmp/art are tarred into
# $OUT/art.tgz (the device tool returns at most 8 files).
#   JOB0="cd bench && python3 e2e.py --size d2048 --variants bf16" bash bench/parallel_session.sh
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/jaxquant_out}
mkdir -p "$OUT" /tmp/art
LOG="$OUT/log.txt"
SECONDS=0
say() { echo "[$SECONDS s] $*" | tee -a "$LOG"; }
nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$LOG"
CMAKE_BUILD_PARALLEL_LEVEL=${BUILD_JOBS:-32} python3 -m pip install --no-build-isolation --no-deps -e . \
  > /tmp/art/build.log 2>&1 || { tail -60 /tmp/art/build.log | tee -a "$LOG"; exit 1; }
python3 -c "import jax; from jaxquant import _jaxquant_ffi as m; print(jax.devices()[0].device_kind, 'cuda', m.has_cuda(), 'sm90', m.grouped_sm90_status())" 2>&1 | tee -a "$LOG"
say "build done"
for i in 0 1 2 3; do
  var="JOB$i"; cmd="${!var:-}"
  [ -z "$cmd" ] && continue
  ( CUDA_VISIBLE_DEVICES=$i timeout "${JOB_TIMEOUT:-400}" bash -c "$cmd" > "$OUT/job$i.log" 2>&1
    say "job$i exit $?" ) &
done
wait
say "single-GPU jobs done"
i=0
while IFS= read -r line; do
  [ -z "$line" ] && continue
  i=$((i + 1)); left=$(( ${DEADLINE:-560} - SECONDS ))
  [ "$left" -lt 40 ] && { say "mesh job $i skipped: ${left}s left"; continue; }
  say "mesh job $i: $line"
  timeout "$left" bash -c "$line" >> "$OUT/mesh.log" 2>&1
  say "mesh job $i exit $?"
done <<< "${MESH_JOBS:-}"
tar czf "$OUT/art.tgz" -C /tmp art 2>/dev/null
say "done"
