#!/usr/bin/env bash
# Device call 3 of the ninth session (2026-12-02): the one-GPU recipe, 30 steps each, in one call
# with the shipped FP8 quantise kernels (run 26 used an intermediate one): nccl bf16, nvshmem bf16,
# nvshmem with FP8 experts + FP8 dispatch (no AC: one forward per step, so no WeightCache), and
# the same three under AC full (the FP8 run with its WeightCache).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; mkdir -p $o/runs
start=$(date +%s); stamp() { echo "[s9call3 $(( $(date +%s) - start )) s] $*"; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=12 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
run() {  # name, then train overrides
  local name=$1; shift
  timeout 150 python3 -m moe_comm train recipes/deepseek_v3_671b_h200x1.toml --training.steps 30 --metrics.log_freq 1 \
    --metrics.no-enable-wandb --job.dump_folder $o/runs/$name "$@" > $o/train_$name.log 2>&1
  stamp "$name exit $?"; grep -E "done|FAILED" $o/train_$name.log | cut -c1-200
}
run nccl_bf16 --moe_comm.backend nccl
run nvshmem_bf16
run nvshmem_fp8 --moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8
run nccl_bf16_acfull --moe_comm.backend nccl --activation_checkpoint.mode full
run nvshmem_fp8_acfull --moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8 --activation_checkpoint.mode full
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
rm -rf $o/runs/*/checkpoint; tar czf $OUT/s9call3.tgz -C $o . ; stamp packed
