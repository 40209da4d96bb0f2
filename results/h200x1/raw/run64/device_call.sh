#!/usr/bin/env bash
# Ran on 2026-12-05 (session 25) on the tree eb1d9fa (branch row-kernels), carrying [".whl", ".device/old", ".device/mid"]; what it printed: results/h200x1/README.md, twenty-fifth session.
# Device call of the branch row-kernels (prepared in sessions 20-23, not yet run). Three trees, each
# built: main's in .device/old and the branch before session 23's commit in .device/mid (both
# `git archive REV | tar x -C DIR; rm -rf DIR/results`), carried with [".whl", ".device/old",
# ".device/mid"], and this one. What the branch changes, against main:
# - mid: the row kernels (quantise_rows, gate, gate_backward, weights) take one block barrier a row
#   instead of two (BlockMax, rows.cuh), and quantise_rows and gate_backward no longer keep their
#   experts' walk in local memory (ptxas -v with the build's flags: 112 and 96 bytes of stack frame
#   with spills on main, 8 and 0 there);
# - this tree: every quantiser multiplies by the scale's reciprocal instead of dividing each value
#   (common/vec.cuh), and the gate's sigmoid takes the hardware's exp2 and reciprocal (rows.cuh):
#   SASS instructions of quantise_rows 4,080 -> 3,216, gate_backward 8,240 -> 5,256, gate 3,944 ->
#   1,904, weights 2,968 -> 1,648, group_columns 2,112 -> 1,728 (all template instances).
# The FP8 experts' GPU tests and the FP8 dispatch cases at 1 rank and 2x2 (the quantisers bit for bit
# against the reference, which now multiplies too); each tree's row kernels and transposes, in turn,
# twice; then the one-GPU recipe 100 steps each: nccl bf16, this tree's FP8, nccl, FP8 (about 8
# minutes). Merge if the tests pass and the kernels are faster. The SM clock and power are sampled
# through the first FP8 run.
source experiments/device_prelude.sh run64
old=$PWD/.device/old mid=$PWD/.device/mid
(cd $old && PYTHONPATH=/tmp/site:$old MAX_JOBS=8 python3 -m moe_comm build --arch 90 --out /tmp/b_old > $o/build_old.log 2>&1) &
build_old=$!
(cd $mid && PYTHONPATH=/tmp/site:$mid MAX_JOBS=8 python3 -m moe_comm build --arch 90 --out /tmp/b_mid > $o/build_mid.log 2>&1) &
build_mid=$!
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu.log 2>&1
rc=$?; stamp "fp8 experts gpu exit $rc"; grep -E "passed|failed|Error" $o/fp8_experts_gpu.log | tail -4
if [ $rc -ne 0 ]; then pack; exit 1; fi
MOE_COMM_GPU_LAYOUTS=1,2x2 MOE_COMM_GPU_TEST_CONCURRENCY=2 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider \
  -k fp8 tests/test_nvshmem_gpu.py > $o/nvshmem_gpu_fp8.log 2>&1
rc=$?; stamp "nvshmem gpu fp8 cases exit $rc"; grep -E "FAIL|passed|failed" $o/nvshmem_gpu_fp8.log | tail -6
if [ $rc -ne 0 ]; then pack; exit 1; fi
wait $build_old; stamp "old build exit $?"
wait $build_mid; stamp "mid build exit $?"
only="quantise_rows gate gate_backward weights_13 weights_2 group_columns_dy group_columns_h group_columns_dh13"
for n in 1 2; do
  for tree in main mid this; do
    case $tree in
      main) dir=$old lib=/tmp/b_old/moe_comm_cuda.so ;;
      mid) dir=$mid lib=/tmp/b_mid/moe_comm_cuda.so ;;
      this) dir=$PWD lib=/tmp/b/moe_comm_cuda.so ;;
    esac
    (cd $dir && PYTHONPATH=/tmp/site:$dir MOE_COMM_LIBRARY=$lib timeout 60 python3 experiments/fp8_row_kernels.py \
      --only $only --out $o/row_kernels_${tree}_$n.json > $o/row_kernels_${tree}_$n.log 2>&1)
    stamp "$tree's row kernels ($n) exit $?"; grep -E "quantise|gate|weights|group" $o/row_kernels_${tree}_$n.log | cut -c1-80
  done
done
pack
fp8="--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8"
TRAIN_TIMEOUT=110
train nccl_bf16 --moe_comm.backend nccl; pack
# the SM clock and power every 50 ms through the first FP8 run: is the first backward MoE layer slow
# (run 60's trace: every kernel of it 15-70% slower) because the GPU slows after the output layer?
(timeout 100 nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv -lms 50 > $o/clocks_nvshmem_fp8.csv 2>&1) &
clocks=$!
train nvshmem_fp8 $fp8; kill $clocks 2>/dev/null; pack
train nccl_bf16_again --moe_comm.backend nccl; pack
train nvshmem_fp8_again $fp8
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
