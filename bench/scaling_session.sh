#!/bin/bash
# Device call(s) of issue 8 on a 4-GPU machine: bench/scaling.py per recipe, the 1-GPU runs in
# parallel (one GPU each), then each recipe's meshes in turn (all 4 GPUs). JSON + logs in $OUT.
#   PART=dense bash bench/scaling_session.sh   # bf16 and fp8_current, d4096 x 8 layers
#   PART=moe   bash bench/scaling_session.sh   # the MoE hybrid recipe, then tests/multidevice
# Uses a carried prebuilt cp312 extension (jaxquant/_jaxquant_ffi.cpython-312-*.so) if it loads,
# else builds. MESHES / STEPS / ONE_TIMEOUT / MESH_TIMEOUT / TEST_TIMEOUT override.
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/jaxquant_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/card.txt"
echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE-unset}"
CU=$(python3 -c "import nvidia.cu13; print(nvidia.cu13.__path__[0])" 2>/dev/null)
mkdir -p /tmp/py312shim/nvidia && ln -sfn "$CU" /tmp/py312shim/nvidia/cu13  # prebuilt RUNPATH
export PYTHONPATH=$PWD
if ! python3 -c "from jaxquant import _jaxquant_ffi as m; assert m.has_cuda()"; then
  echo "building the extension"; rm -f jaxquant/_jaxquant_ffi*.so; unset PYTHONPATH
  CMAKE_BUILD_PARALLEL_LEVEL=48 timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . \
    > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
MESHES=${MESHES:-dp=4/tp=4/dp=2,tp=2}
STEPS=${STEPS:-8}
if [ "${PART:-dense}" = dense ]; then
  RECIPES="bf16 fp8_current"
  MODEL="--d-model 4096 --layers 8 --heads 32 --seq 2048 --batch 8 --remat --scan-layers"
else
  RECIPES="moe_nvfp4_fwd_mxfp8_bwd"
  MODEL="--d-model 1024 --layers 4 --heads 16 --seq 2048 --batch 8 --moe 8,2 --remat --scan-layers"
fi
run() {  # recipe meshes tag gpus timeout
  CUDA_VISIBLE_DEVICES=$4 timeout "$5" python3 bench/scaling.py --recipe "$1" \
    --meshes "$2" --steps "$STEPS" $MODEL --json "$OUT/$3.json" > "$OUT/$3.log" 2>&1
  echo "$3: exit $? after ${SECONDS}s"; grep -E "ms/step|error" "$OUT/$3.log" | cut -c1-400
}
SECONDS=0
gpu=0
for r in $RECIPES; do run "$r" 1 "${r}_1gpu" $gpu "${ONE_TIMEOUT:-150}" & gpu=$((gpu + 1)); done
wait
for r in $RECIPES; do run "$r" "$MESHES" "${r}_mesh" 0,1,2,3 "${MESH_TIMEOUT:-200}"; done
if [ "${PART:-dense}" = moe ]; then  # issue 6: the multi-device tests, two GPUs per process
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$((2 * i)),$((2 * i + 1)) JAXQUANT_MULTIDEVICE=1 timeout "${TEST_TIMEOUT:-150}" \
      python3 -m pytest -q -p no:cacheprovider --jaxquant-shard=$i/2 -k "${TESTS_K-not reference}" \
      tests/multidevice > "$OUT/tests_$i.log" 2>&1 &
  done
  wait
  for i in 0 1; do grep -v "^\[jaxquant" "$OUT/tests_$i.log" | grep -E "passed|failed|FAILED|rror" | tail -8; done
fi
python3 bench/scaling_report.py "$OUT"/*.json | tee "$OUT/table.md"
