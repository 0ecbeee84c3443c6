#!/bin/bash
# Device calls of issue 8 on a 4-GPU machine: bench/scaling.py jobs, the 1-GPU runs in parallel
# (one GPU each), then each job's meshes in turn (all 4 GPUs). JSON + logs in $OUT.
#   PART=dense bash bench/scaling_session.sh  # timing: bf16 and fp8_current, d4096 x 8 layers
#   PART=check bash bench/scaling_session.sh  # losses with SGD + split FP8 accumulation, fp8_block,
#                                             # the MoE hybrid recipe, then tests/multidevice
# Uses a carried prebuilt cp312 extension (jaxquant/_jaxquant_ffi.cpython-312-*.so) if it loads,
# else builds. STEPS / ONE_TIMEOUT / MESH_TIMEOUT / TEST_TIMEOUT override.
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/jaxquant_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE-unset}"
CU=$(python3 -c "import nvidia.cu13; print(nvidia.cu13.__path__[0])" 2>/dev/null)
mkdir -p /tmp/py312shim/nvidia && ln -sfn "$CU" /tmp/py312shim/nvidia/cu13  # prebuilt RUNPATH
export PYTHONPATH=$PWD
if [ -z "$SKIP_BUILD" ] && ! python3 -c "from jaxquant import _jaxquant_ffi as m; assert m.has_cuda()"; then
  echo "building the extension"; rm -f jaxquant/_jaxquant_ffi*.so; unset PYTHONPATH
  CMAKE_BUILD_PARALLEL_LEVEL=48 timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . \
    > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
DENSE=${DENSE:-"--d-model 4096 --layers 8 --heads 32 --seq 2048 --batch 8 --remat --scan-layers"}
MOE=${MOE:-"--d-model 1024 --layers 4 --heads 16 --seq 2048 --batch 8 --moe 8,2 --remat --scan-layers"}
ALL=dp=4/tp=4/dp=2,tp=2
# jobs: tag|recipe|meshes|model and scaling.py flags|environment
if [ "${PART:-dense}" = dense ]; then
  JOBS=("bf16|bf16|$ALL|$DENSE|" "fp8|fp8_current|$ALL|$DENSE|")
else
  JOBS=("bf16sgd|bf16|$ALL|$DENSE --optimizer sgd --steps 6|"
        "fp8sgd|fp8_current|$ALL|$DENSE --optimizer sgd --steps 6|JAXQUANT_FP8_ACCUMULATION=split"
        "block|fp8_block|dp=4|$DENSE --steps 6|"
        "moe|moe_nvfp4_fwd_mxfp8_bwd|$ALL|$MOE --optimizer sgd --steps 6|")
fi
run() {  # tag recipe meshes flags env gpus timeout
  env $5 CUDA_VISIBLE_DEVICES=$6 timeout "$7" python3 bench/scaling.py --recipe "$2" \
    --meshes "$3" --steps "${STEPS:-8}" $4 --json "$RUNS/$1_$8.json" > "$RUNS/$1_$8.log" 2>&1
  echo "$1 $8: exit $? after ${SECONDS}s"; grep -E "ms/step|error" "$RUNS/$1_$8.log" | cut -c1-300
}
RUNS=/tmp/scaling_runs; rm -rf $RUNS; mkdir -p $RUNS  # $OUT takes 8 files: merged below
SECONDS=0
gpu=0
for job in "${JOBS[@]}"; do
  IFS='|' read -r tag recipe meshes flags envs <<< "$job"
  run "$tag" "$recipe" 1 "$flags" "$envs" $gpu "${ONE_TIMEOUT:-150}" 1gpu & gpu=$((gpu + 1))
done
wait
for job in "${JOBS[@]}"; do
  IFS='|' read -r tag recipe meshes flags envs <<< "$job"
  run "$tag" "$recipe" "$meshes" "$flags" "$envs" 0,1,2,3 "${MESH_TIMEOUT:-200}" mesh
done
if [ "${PART:-dense}" != dense ]; then  # issue 6: the multi-device tests, two GPUs per process
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$((2 * i)),$((2 * i + 1)) JAXQUANT_MULTIDEVICE=1 timeout "${TEST_TIMEOUT:-150}" \
      python3 -m pytest -q -p no:cacheprovider --jaxquant-shard=$i/2 -k "${TESTS_K-not reference}" \
      tests/multidevice > "$OUT/tests_$i.log" 2>&1 &
  done
  wait
  for i in 0 1; do grep -v "^\[jaxquant" "$OUT/tests_$i.log" | grep -E "passed|failed|FAILED|rror" | tail -8; done
  cat "$OUT"/tests_*.log > "$OUT/tests.log"; rm -f "$OUT"/tests_*.log
fi
python3 bench/scaling_report.py $RUNS/*.json > "$OUT/table.md"; cat "$OUT/table.md"
for f in $RUNS/*.log; do echo "=== $f"; cat "$f"; done > "$OUT/runs.log"
python3 -c "import glob, json, sys; json.dump([json.load(open(f)) for f in sorted(glob.glob(sys.argv[1] + '/*.json'))], open(sys.argv[2], 'w'), indent=1)" $RUNS "$OUT/runs.json"
