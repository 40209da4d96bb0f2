#!/usr/bin/env bash
# On a GPU machine (any number of GPUs): build csrc/ and DeepEP v1.2.1, run the GPU tests (the
# nvshmem cases at 1-8 ranks and on virtual nodes, sharing GPUs under CUDA MPS where there are
# fewer GPUs than ranks; the hang, capacity and preflight tests; the deepep cases), then the
# dispatch/combine benchmark on every GPU of the machine.
# Usage: experiments/gpu_checks.sh OUT_DIR [tests|bench|all] [DEEPEP_SOURCE]
# DEEPEP_SOURCE: a DeepEP v1.2.1 folder or `git archive` of it (machines without network).
# Every step keeps NVLink multicast off (the device machines' rule; it can take a shared host down).
set -uo pipefail
out=${1:?usage: gpu_checks.sh OUT_DIR [tests|bench|all] [DEEPEP_SOURCE]}
what=${2:-all}
deepep=${3:-}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MOE_COMM_INIT_TIMEOUT=${MOE_COMM_INIT_TIMEOUT:-120}
py=${PYTHON:-python3}
gpus=$($py -c "import torch; print(torch.cuda.device_count())")

if [ -z "${MOE_COMM_LIBRARY:-}" ]; then
  start=$(date +%s)
  $py -m moe_comm build --arch 90 --out /tmp/moe_comm_build > "$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
  export MOE_COMM_LIBRARY=/tmp/moe_comm_build/moe_comm_cuda.so
fi
if ! $py -c "import deep_ep" 2>/dev/null; then
  $py -m moe_comm build-deepep ${deepep:+--source "$deepep"} > "$out/deepep_build.log" 2>&1 || tail -20 "$out/deepep_build.log"
fi

if [ "$what" = tests ] || [ "$what" = all ]; then
  MOE_COMM_GPU_REPORTS="$out" $py -m pytest -m gpu -q -p no:cacheprovider tests/test_nvshmem_gpu.py \
    tests/test_deepep_gpu.py -rf 2>&1 | tee "$out/pytest_gpu.log" | tail -20
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
  [ "$gpus" -ge 2 ] && $py experiments/bench_comm.py p2p "$out/bench_p2p.json" 2>&1 | tail -2
  timeout 600 $py -m torch.distributed.run --standalone --nproc_per_node "$gpus" experiments/bench_comm.py run \
    "$out/bench_main.json" --backends nvshmem nccl deepep --num-sms ${NUM_SMS:-20 24 32 64} 2>&1 \
    | tee "$out/bench_main.log" | grep -v Warning | tail -30
fi
