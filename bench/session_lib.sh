# Sourced by the device-call scripts (bench/parallel_session.sh, bench/device_pass.sh): the
# environment every GPU job runs under, a timestamped log ($OUT/log.txt), and the loop over
# MESH_JOBS that both scripts end with.
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# One process per GPU: let XLA use nearly all of it (the d4096 model on one H100 needs ~26 GB of
# state beside ~44 GiB of temporaries, more than the default 75%).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.97}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/jaxquant_out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
SECONDS=0
say() { echo "[$SECONDS s] $*" | tee -a "$LOG"; }

# mesh_jobs RUNNER: for each non-empty line of $MESH_JOBS, in turn, while DEADLINE (seconds,
# default 560) leaves at least 40 s: `RUNNER INDEX SECONDS_LEFT LINE`.
mesh_jobs() {
  local runner=$1 i=0 line left
  while IFS= read -r line; do
    [ -z "$line" ] && continue
    i=$((i + 1)); left=$(( ${DEADLINE:-560} - SECONDS ))
    [ "$left" -lt 40 ] && { say "mesh job $i skipped: ${left}s left"; continue; }
    say "mesh job $i: $line"
    "$runner" "$i" "$left" "$line"
  done <<< "${MESH_JOBS:-}"
}
