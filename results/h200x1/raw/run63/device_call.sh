#!/usr/bin/env bash
# Device call of the branch wgrad-beside-gemms after run 62 (the session's last device time, about
# 6.5 minutes). Since run 62: the backward in the order that hides most beside the GEMMs (run 61's
# probe: x's and dh13's transposes beside dW2's GEMM, dgrad dx's GEMM last with the last widening
# beside it; dW3 no longer split; each side block's event recorded just before its GEMM, so the
# side work does not start ahead of the GEMM); group_columns' grid with the column tiles along x again (run 62:
# the e4m3 transposes 20% slower with the chunks along x). The FP8 experts' GPU tests; the probe's
# experts forward + backward beside vs one stream; the transposes alone (mild and hot-expert
# routing); the one-GPU recipe 100 steps each: nccl bf16, FP8, nccl, FP8, packed after each.
source experiments/device_prelude.sh s20call3
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu.log 2>&1
rc=$?; stamp "fp8 experts gpu exit $rc"; grep -E "passed|failed|Error" $o/fp8_experts_gpu.log | tail -4
if [ $rc -ne 0 ]; then pack; exit 1; fi
timeout 60 python3 experiments/fp8_overlap_probe.py --out $o/overlap_probe.json > $o/overlap_probe.log 2>&1
stamp "overlap probe exit $?"; grep -E "FP8 experts|grids" $o/overlap_probe.log | cut -c1-200
only="group_columns_dy group_columns_h group_columns_dh13 transpose_rows_x weights_transposed_13 weights_transposed_2"
for skew in 0 1; do
  timeout 60 python3 experiments/fp8_row_kernels.py --skew $skew --only $only --out $o/row_kernels_skew$skew.json \
    > $o/row_kernels_skew$skew.log 2>&1
  stamp "row kernels skew $skew exit $?"; grep -E "group_columns|transpose" $o/row_kernels_skew$skew.log | cut -c1-80
done
pack
fp8="--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8"
TRAIN_TIMEOUT=110
train nccl_bf16 --moe_comm.backend nccl; pack
train nvshmem_fp8 $fp8; pack
train nccl_bf16_again --moe_comm.backend nccl; pack
train nvshmem_fp8_again $fp8
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
