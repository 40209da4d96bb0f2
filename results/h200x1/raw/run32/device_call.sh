#!/usr/bin/env bash
# Device call 4 of the ninth session (2026-12-02): where the one-GPU recipe's step goes with FP8
# experts + FP8 dispatch against nvshmem bf16, profiled at step 15 of 20, same call.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; mkdir -p $o/runs $o/profiles
start=$(date +%s); stamp() { echo "[s9call4 $(( $(date +%s) - start )) s] $*"; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=12 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
for v in bf16 fp8; do
  extra=(); [ $v = fp8 ] && extra=(--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8)
  timeout 150 python3 -m moe_comm train recipes/deepseek_v3_671b_h200x1.toml --training.steps 20 --metrics.log_freq 1 \
    --metrics.no-enable-wandb --profiling.enable_profiling --profiling.profile_freq 15 \
    --job.dump_folder $o/runs/nvshmem_$v "${extra[@]}" > $o/train_$v.log 2>&1
  stamp "$v exit $?"
  trace=$(find $o/runs/nvshmem_$v -name "*rank0*trace*.json" | sort | tail -1)
  python3 experiments/profile_summary.py "$trace" $o/profiles/nvshmem_$v.json > $o/profile_$v.txt 2>&1
  head -60 $o/profile_$v.txt
done
find $o/runs -name "*trace*.json" -delete; rm -rf $o/runs/*/checkpoint
tar czf $OUT/s9call4.tgz -C $o . ; stamp packed
