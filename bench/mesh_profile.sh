#!/bin/bash
# One device call: where a mesh step's time goes. Builds the extension, then bench/scaling.py
# with --profile-dir for bf16 and fp8_current on MESHES (default 1/dp=4/fsdp=4, the issue-14
# model), printing each run's per-device kernel split (GEMM / quantize / NCCL / other).
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/jaxquant_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/card.txt"
SECONDS=0
CMAKE_BUILD_PARALLEL_LEVEL=64 python3 -m pip install --no-build-isolation --no-deps -e . \
  > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: ${SECONDS}s"
DENSE="--d-model 4096 --layers 8 --heads 32 --seq 2048 --batch 8 --remat --scan-layers --steps ${STEPS:-5} --warmup 2"
timeout "${DEADLINE:-420}" python3 bench/scaling.py --recipe "${RECIPES:-bf16,fp8_current}" \
  --meshes "${MESHES:-1/dp=4/fsdp=4}" $DENSE ${EXTRA:-} --profile-dir /tmp/mesh_traces \
  --json "$OUT/profile.json" 2>&1 | grep -v "^{" | tee "$OUT/profile.log"
echo "profile: ${SECONDS}s"
