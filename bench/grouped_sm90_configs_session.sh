#!/bin/bash
# One device call (run from the worktree root, CUTLASS headers in $JAXQUANT_CUTLASS_DIR): build
# the extension with every CUTLASS grouped GEMM configuration, run the GPU tests of the CUTLASS
# kernel (`-k sm90`: the default and every alternative configuration), then time every
# configuration (`--sm90-configs all`) of the per-tensor FP8 and Float8Block grouped GEMMs at 8
# and 64 experts in one process. Logs and the JSON land in $OUT.
#   EXPERTS (default "8 64") / FORMATS (bench/grouped.py --formats names, one per line) /
#   CONFIGS (default all) / TEST_K / SKIP_TESTS override; the build and test timeouts as
#   bench/grouped_sm90_session.sh.
set -o pipefail
OUT=${OUT:-/tmp/jaxquant_out}
mkdir -p "$OUT"
SKIP_BENCH=1 TEST_K="${TEST_K:-sm90}" bash bench/grouped_sm90_session.sh || exit 1
FORMATS=${FORMATS:-$'Float8CurrentScaling\nFloat8Block 1x128 x 128x128 w'}
mapfile -t formats <<< "$FORMATS"
SECONDS=0
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout "${BENCH_TIMEOUT:-300}" python3 bench/grouped.py --gemms --no-steps \
  --experts ${EXPERTS:-8 64} --sm90-configs "${CONFIGS:-all}" --formats "${formats[@]}" \
  --json "$OUT/bench_configs.json" 2>&1 | tee "$OUT/bench_configs.log" | tail -80
echo "bench: ${SECONDS}s"
