#!/usr/bin/env bash
# Device call of the branch wgrad-beside-gemms, run from its checkout, with main's tree carried in
# .device/old (git archive main | tar x -C .device/old; carry [".whl", ".device/old"]) and built beside it. Main's run 60 FP8 runs
# never re-made the FP8 weights after the first step (a118067's key; fixed on main since). This
# call: the FP8 experts' GPU tests of this tree (the ahead test steps a fused AdamW; the work
# beside the GEMMs delayed by 20 ms sleeps); whether the memory-bound FP8 kernels run beside the
# grouped GEMMs (experiments/fp8_overlap_probe.py, with the experts' forward + backward both ways);
# the transposes alone on both libraries (experiments/fp8_row_kernels.py); the one-GPU recipe 100 steps each: nccl bf16, FP8 on main, FP8 on this tree, nccl again,
# this tree's FP8 again (about 8 minutes in all).
source experiments/device_prelude.sh s20call1
old=$PWD/.device/old
(cd $old && PYTHONPATH=/tmp/site:$old MAX_JOBS=8 python3 -m moe_comm build --arch 90 --out /tmp/b_old > $o/build_old.log 2>&1) &
build_old=$!
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu.log 2>&1
rc=$?; stamp "fp8 experts gpu exit $rc"; grep -E "passed|failed|Error" $o/fp8_experts_gpu.log | tail -4
if [ $rc -ne 0 ]; then pack; exit 1; fi
timeout 120 python3 experiments/fp8_overlap_probe.py --out $o/overlap_probe.json > $o/overlap_probe.log 2>&1
stamp "overlap probe exit $?"; cut -c1-200 $o/overlap_probe.log
wait $build_old; stamp "old build exit $?"
# the transposes alone, this tree's library and main's, at the mild routing of runs 42-57 and at a
# hot expert (--skew 1: about 8x the mean). Main's script has no --skew, so this tree's copy runs in
# main's tree (its REPO is its own folder's parent: main's Python with main's library).
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
fp8="--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8"
TRAIN_TIMEOUT=110
train nccl_bf16 --moe_comm.backend nccl
TRAIN_TREE=$old TRAIN_LIBRARY=/tmp/b_old/moe_comm_cuda.so train nvshmem_fp8_main $fp8
train nvshmem_fp8_beside $fp8
train nccl_bf16_again --moe_comm.backend nccl
train nvshmem_fp8_beside_again $fp8
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
