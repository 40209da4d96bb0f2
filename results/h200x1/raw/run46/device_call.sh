#!/usr/bin/env bash
# Device call 1 of the sixteenth session (2026-12-03): the one-GPU recipe, 100 steps each, one call,
# with and without TorchTitan's dataloader worker loading two batches ahead
# (--training.dataloader.num_workers 1 --training.dataloader.prefetch_factor 2), the lever the
# fifteenth session found for the idle at each step's start (the batch loaded on the main thread
# after log_freq 1's loss read has drained the GPU). Runs interleaved so drift hits both sides.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s16call1 $(( $(date +%s) - start )) s] $*"; }
pack() { rm -rf $o/runs/*/checkpoint; tar czf $OUT/s16call1.tgz -C $o . ; stamp packed; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
fp8="--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8"
workers="--training.dataloader.num_workers 1 --training.dataloader.prefetch_factor 2"
run() {  # name, then train overrides
  local name=$1; shift
  timeout 130 python3 -m moe_comm train recipes/deepseek_v3_671b_h200x1.toml --training.steps 100 --metrics.log_freq 1 \
    --metrics.no-enable-wandb --job.dump_folder $o/runs/$name "$@" > $o/train_$name.log 2>&1
  stamp "$name exit $?"; grep -E "done|FAILED|Error" $o/train_$name.log | cut -c1-200 | tail -2
}
run nccl_bf16 --moe_comm.backend nccl
run nvshmem_fp8 $fp8
run nccl_bf16_workers --moe_comm.backend nccl $workers
run nvshmem_bf16_workers $workers
run nvshmem_fp8_workers $fp8 $workers
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
for r in $o/runs/*; do python3 - "$r" <<'PY'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if l.strip()]
s = [r for r in recs if r["step"] > 10]
print(sys.argv[1].split("/")[-1], "data_loading ms median", round(1e3 * statistics.median(r["time_metrics/data_loading(s)"] for r in s), 2))
PY
done
pack
