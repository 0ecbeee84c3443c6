#!/bin/bash
# One device call on an NGPU-GPU host: build the extension (CUTLASS headers from
# JAXQUANT_CUTLASS_DIR when set), run up to four single-GPU jobs in parallel (JOB0..JOB3, one
# GPU each, logs $OUT/jobN.log), then MESH_JOBS (one command per line, all GPUs, log
# $OUT/mesh.log) until DEADLINE seconds. Files a job writes under /tmp/art are tarred into
# $OUT/art.tgz (the device tool returns at most 8 files).
#   JOB0="cd bench && python3 e2e.py --size d2048 --variants bf16" bash bench/parallel_session.sh
source "$(dirname "$0")/session_lib.sh"
mkdir -p /tmp/art
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
to_mesh_log() { timeout "$2" bash -c "$3" >> "$OUT/mesh.log" 2>&1; say "mesh job $1 exit $?"; }
mesh_jobs to_mesh_log
tar czf "$OUT/art.tgz" -C /tmp art 2>/dev/null
say "done"
