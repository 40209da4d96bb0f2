#!/usr/bin/env bash
# Device call 3 of the eighteenth session (2026-12-04). This tree, over run 57's: the WeightCache
# makes every copy on its own stream without record_stream (run 57 reserved 130.6 GiB, 19 more
# than before: two steps' copies held). The FP8 experts' GPU tests; the one-GPU recipe 100 steps
# each, one call: nccl bf16, nvshmem FP8 experts + FP8 dispatch, nvshmem bf16, nccl bf16 again;
# then the 2-PE error layout owed since run 55 (its launch timed at its own end: wait_all).
source experiments/device_prelude.sh s18call3
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu.log 2>&1
rc=$?; stamp "fp8 experts gpu exit $rc"; grep -E "passed|failed|Error" $o/fp8_experts_gpu.log | tail -4
if [ $rc -ne 0 ]; then pack; exit 1; fi
fp8="--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8"
run() {  # name, then train overrides
  local name=$1; shift
  timeout 110 python3 -m moe_comm train recipes/deepseek_v3_671b_h200x1.toml --training.steps 100 --metrics.log_freq 1 \
    --metrics.no-enable-wandb --job.dump_folder $o/runs/$name "$@" > $o/train_$name.log 2>&1
  stamp "$name exit $?"; grep -E "done|FAILED|Error" $o/train_$name.log | cut -c1-200 | tail -2
}
run nccl_bf16 --moe_comm.backend nccl
run nvshmem_fp8 $fp8
run nvshmem_bf16
run nccl_bf16_again --moe_comm.backend nccl
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
MOE_COMM_GPU_LAYOUTS=2_errors MOE_COMM_GPU_TEST_CONCURRENCY=2 MOE_COMM_GPU_REPORTS=$o/reports timeout 90 \
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_nvshmem_gpu.py > $o/nvshmem_gpu.log 2>&1
stamp "nvshmem gpu (2_errors) exit $?"; tail -3 $o/nvshmem_gpu.log
pack
