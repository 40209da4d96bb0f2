#!/usr/bin/env bash
# Device call 2 of the nineteenth session (2026-12-04). Run 60's FP8 runs never re-made the FP8
# weights after the first step (a118067 keyed them on versions that TorchTitan's fused AdamW does
# not bump); this tree counts optimizer steps once per outermost step again. The FP8 experts' GPU
# tests (the ahead test now steps a fused AdamW); whether the memory-bound FP8 kernels can run
# beside the grouped GEMMs (experiments/fp8_overlap_probe.py); the one-GPU recipe 100 steps each:
# nccl bf16, nvshmem FP8 experts + FP8 dispatch, nccl again, FP8 again.
source experiments/device_prelude.sh s19call2
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu.log 2>&1
rc=$?; stamp "fp8 experts gpu exit $rc"; grep -E "passed|failed|Error" $o/fp8_experts_gpu.log | tail -4
if [ $rc -ne 0 ]; then pack; exit 1; fi
timeout 90 python3 experiments/fp8_overlap_probe.py --out $o/overlap_probe.json > $o/overlap_probe.log 2>&1
stamp "overlap probe exit $?"; cat $o/overlap_probe.log | cut -c1-220
fp8="--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8"
TRAIN_TIMEOUT=110
train nccl_bf16 --moe_comm.backend nccl
train nvshmem_fp8 $fp8
train nccl_bf16_again --moe_comm.backend nccl
train nvshmem_fp8_again $fp8
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
