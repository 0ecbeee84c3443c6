#!/bin/bash
# One short 4-GPU call: bf16 and fp8_current on fsdp=4 against each recipe's 1-GPU step (the
# 1-GPU runs on GPUs 0 and 1 side by side, then the mesh), issue 14's d_model 4096 model.
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/jaxquant_out}
mkdir -p "$OUT"
SECONDS=0
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
CMAKE_BUILD_PARALLEL_LEVEL=64 python3 -m pip install --no-build-isolation \
  --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
echo "build ${SECONDS}s"
D="--d-model 4096 --layers 8 --heads 32 --seq 2048 --batch 8 --remat --scan-layers --steps ${STEPS:-5} --warmup 2"
run() { timeout "$1" python3 bench/scaling.py $D "${@:2}" 2>&1 | grep -E "ms/step|rror" | cut -c1-250; }
CUDA_VISIBLE_DEVICES=0 run 80 --recipe bf16 --meshes 1 > /tmp/one_bf16.txt &
CUDA_VISIBLE_DEVICES=1 run 80 --recipe fp8_current --meshes 1 > /tmp/one_fp8.txt &
wait; cat /tmp/one_bf16.txt /tmp/one_fp8.txt
echo "1 GPU done ${SECONDS}s"
run 100 --recipe bf16,fp8_current --meshes fsdp=4
echo "done ${SECONDS}s"
