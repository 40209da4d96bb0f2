#!/usr/bin/env bash
# Device call 2 of the eighteenth session (2026-12-04), issue 35's last target. This tree, over
# run 56's: the FP8 weights of the one-GPU recipe made right after each optimizer step on a stream
# of their own (fp8_experts.WeightCache(weights=...): the GPU idles there while the host reads the
# loss, logs the step and moves the next batch over), and quantise_rows / gate_backward held to
# 2 / 4 resident blocks an SM with their prefetch (run 56: quantise_rows slower at 72 registers).
# Build this tree and 2c6eda9 (.device/old); the FP8 experts' GPU tests; the FP8 kernels alone,
# this tree then 2c6eda9; the one-GPU recipe 100 steps each, one call: nccl bf16, nvshmem FP8
# experts + FP8 dispatch, nvshmem bf16, nvshmem FP8 on 2c6eda9, nccl bf16 again.
source experiments/device_prelude.sh s18call2
old=/tmp/old_tree; rm -rf $old; cp -r .device/old $old
(cd $old && PYTHONPATH=/tmp/site:$old MAX_JOBS=8 python3 -m moe_comm build --arch 90 --out /tmp/b_old > $o/build_old.log 2>&1) &
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu.log 2>&1
rc=$?; stamp "fp8 experts gpu exit $rc"; grep -E "passed|failed|Error" $o/fp8_experts_gpu.log | tail -4
wait; stamp "old build: $(tail -1 $o/build_old.log)"
timeout 60 python3 experiments/fp8_row_kernels.py --out $o/kernels_new.json > $o/kernels_new.log 2>&1
stamp "kernels, this tree"; cat $o/kernels_new.log
(cd $old && PYTHONPATH=/tmp/site:$old MOE_COMM_LIBRARY=/tmp/b_old/moe_comm_cuda.so timeout 60 python3 \
  experiments/fp8_row_kernels.py --out $o/kernels_old.json > $o/kernels_old.log 2>&1)
stamp "kernels, 2c6eda9"; cat $o/kernels_old.log
if [ $rc -ne 0 ]; then pack; exit 1; fi
fp8="--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8"
run() {  # dir, library, name, then train overrides
  local dir=$1 lib=$2 name=$3; shift 3
  (cd $dir && PYTHONPATH=/tmp/site:$dir MOE_COMM_LIBRARY=$lib timeout 110 python3 -m moe_comm train \
    recipes/deepseek_v3_671b_h200x1.toml --training.steps 100 --metrics.log_freq 1 --metrics.no-enable-wandb \
    --job.dump_folder $o/runs/$name "$@" > $o/train_$name.log 2>&1)
  stamp "$name exit $?"; grep -E "done|FAILED|Error" $o/train_$name.log | cut -c1-200 | tail -2
}
run $PWD /tmp/b/moe_comm_cuda.so nccl_bf16 --moe_comm.backend nccl
run $PWD /tmp/b/moe_comm_cuda.so nvshmem_fp8 $fp8
run $PWD /tmp/b/moe_comm_cuda.so nvshmem_bf16
run $old /tmp/b_old/moe_comm_cuda.so nvshmem_fp8_2c6eda9 $fp8
run $PWD /tmp/b/moe_comm_cuda.so nccl_bf16_again --moe_comm.backend nccl
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
