#!/usr/bin/env bash
# Device call 3 of the fourteenth session (2026-12-03): fp8_experts.ROW_ALIGN = 128 shipped (run 39
# measured it in a copy of the tree). Build; the nvshmem cases at 1 PE (the FP8 experts' layout
# padded to ROW_ALIGN, and the MoE layer with FP8 experts at EP 1); the one-GPU recipe with FP8
# experts + FP8 dispatch, 30 steps. Trimmed to the session's last 260 device seconds (four starts
# were refused): no nccl peer, no layer bench (run 39 measured ROW_ALIGN 128 there).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s14call3 $(( $(date +%s) - start )) s] $*"; }
pack() { rm -rf $o/runs/*/checkpoint; tar czf $OUT/s14call3.tgz -C $o . ; stamp packed; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"; tail -1 $o/build.log
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
MOE_COMM_GPU_LAYOUTS=1 timeout 70 python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/test_nvshmem_gpu.py > $o/nvshmem_gpu_1.log 2>&1
stamp "nvshmem gpu exit $?"; grep -E "FAIL|passed|failed" $o/nvshmem_gpu_1.log | tail -4
run() {  # name, then train overrides
  local name=$1; shift
  timeout 60 python3 -m moe_comm train recipes/deepseek_v3_671b_h200x1.toml --training.steps 30 --metrics.log_freq 1 \
    --metrics.no-enable-wandb --job.dump_folder $o/runs/$name "$@" > $o/train_$name.log 2>&1
  stamp "$name exit $?"; grep -E "done|FAILED|Error" $o/train_$name.log | cut -c1-200 | tail -2
}
run nvshmem_fp8 --moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
