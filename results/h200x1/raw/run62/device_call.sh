#!/usr/bin/env bash
# Device call of the branch wgrad-beside-gemms after run 61 (its GEMM-side work measured there),
# main's tree carried in .device/old (git archive main | tar x -C .device/old, results/ removed;
# carry [".whl", ".device/old"]). This tree adds: no zero-filled gradients for dispatch's
# non-differentiable outputs; group_columns in chunks of the mean expert's rows (at least 1,024;
# run 61's fixed 1,024 slowed the balanced transposes); dW3's GEMM in two halves, the first half's
# widening beside the second. The FP8 experts' GPU tests; the nvshmem world-1 and 2-PE cases (dispatch's
# backward, bf16 and FP8 rows); the transposes alone on both trees (mild and hot-expert routing);
# the one-GPU recipe 100 steps each: nccl bf16, this tree's FP8, nccl, FP8 (about 8 minutes).
source experiments/device_prelude.sh s20call2
old=$PWD/.device/old
(cd $old && PYTHONPATH=/tmp/site:$old MAX_JOBS=8 python3 -m moe_comm build --arch 90 --out /tmp/b_old > $o/build_old.log 2>&1) &
build_old=$!
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu.log 2>&1
rc=$?; stamp "fp8 experts gpu exit $rc"; grep -E "passed|failed|Error" $o/fp8_experts_gpu.log | tail -4
if [ $rc -ne 0 ]; then pack; exit 1; fi
MOE_COMM_GPU_LAYOUTS=1,2 MOE_COMM_GPU_TEST_CONCURRENCY=2 MOE_COMM_GPU_REPORTS=$o/reports timeout 120 \
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_nvshmem_gpu.py > $o/nvshmem_gpu.log 2>&1
rc=$?; stamp "nvshmem gpu (1,2) exit $rc"; grep -E "passed|failed|FAIL" $o/nvshmem_gpu.log | cut -c1-200 | tail -6
if [ $rc -ne 0 ]; then pack; exit 1; fi
wait $build_old; stamp "old build exit $?"
cp experiments/fp8_row_kernels.py $old/experiments/fp8_row_kernels_skew.py
only="group_columns_dy group_columns_h group_columns_dh13 transpose_rows_x weights_transposed_13 weights_transposed_2"
for skew in 0 1; do
  timeout 60 python3 experiments/fp8_row_kernels.py --skew $skew --only $only --out $o/row_kernels_skew$skew.json \
    > $o/row_kernels_skew$skew.log 2>&1
  stamp "row kernels skew $skew exit $?"; grep -E "group_columns|transpose" $o/row_kernels_skew$skew.log | cut -c1-80
  (cd $old && PYTHONPATH=/tmp/site:$old MOE_COMM_LIBRARY=/tmp/b_old/moe_comm_cuda.so timeout 60 python3 \
    experiments/fp8_row_kernels_skew.py --skew $skew --only $only --out $o/row_kernels_main_skew$skew.json \
    > $o/row_kernels_main_skew$skew.log 2>&1)
  stamp "main's row kernels skew $skew exit $?"; grep -E "group_columns|transpose" $o/row_kernels_main_skew$skew.log | cut -c1-80
done
pack
fp8="--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8"
TRAIN_TIMEOUT=110
train nccl_bf16 --moe_comm.backend nccl
train nvshmem_fp8 $fp8
train nccl_bf16_again --moe_comm.backend nccl
train nvshmem_fp8_again $fp8
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
