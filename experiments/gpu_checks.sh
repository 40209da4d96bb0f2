#!/usr/bin/env bash
# On a GPU machine (2 GPUs): build csrc/, run the nvshmem correctness cases on 1 and 2 GPUs, and
# the dispatch/combine benchmark. Usage: experiments/gpu_checks.sh OUT_DIR [cases|bench|all]
# Every step keeps NVLink multicast off (it can take a shared host down).
set -uo pipefail
out=${1:?usage: gpu_checks.sh OUT_DIR [cases|bench|all]}
what=${2:-all}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MOE_COMM_INIT_TIMEOUT=${MOE_COMM_INIT_TIMEOUT:-60}
py=${PYTHON:-python3}

if [ -z "${MOE_COMM_LIBRARY:-}" ]; then
  start=$(date +%s)
  $py -m moe_comm build --arch 90 --out /tmp/moe_comm_build > "$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
  export MOE_COMM_LIBRARY=/tmp/moe_comm_build/moe_comm_cuda.so
fi

if [ "$what" = cases ] || [ "$what" = all ]; then
  for n in 1 2; do
    timeout 240 $py -m torch.distributed.run --standalone --nproc_per_node $n tests/gpu/nvshmem_cases.py \
      "$out/cases_$n.json" > "$out/cases_$n.log" 2>&1
    echo "cases on $n GPU(s): exit $?"; grep -E "PASS|FAIL" "$out/cases_$n.log" | head -20
  done
fi

if [ "$what" = bench ] || [ "$what" = all ]; then
  $py experiments/bench_comm.py p2p "$out/bench_p2p.json" 2>&1 | tail -2
  timeout 300 $py -m torch.distributed.run --standalone --nproc_per_node 2 experiments/bench_comm.py run \
    "$out/bench_main.json" --backends nvshmem nccl --num-sms ${NUM_SMS:-20 24 32 64} 2>&1 | tee "$out/bench_main.log" | grep -v Warning | tail -20
  timeout 120 $py -m torch.distributed.run --standalone --nproc_per_node 2 experiments/bench_comm.py run \
    "$out/bench_symm.json" --backends torch_symm 2>&1 | tee "$out/bench_symm.log" | grep -v Warning | tail -8
fi
