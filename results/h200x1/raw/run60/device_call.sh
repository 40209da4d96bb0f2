#!/usr/bin/env bash
# Device call 1 of the nineteenth session (2026-12-04). Run 58's tree plus the fix of run 59's
# double making (a118067: whole weights keyed on their versions alone). The FP8 experts' GPU
# tests; the one-GPU recipe 100 steps each, one call, through the prelude's `train` helper (its
# first use on the device): nccl bf16, nvshmem FP8 experts + FP8 dispatch, nvshmem bf16, nccl bf16
# again, FP8 again; then the FP8 step profiled (three steps) as in run 59.
source experiments/device_prelude.sh s19call1
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu.log 2>&1
rc=$?; stamp "fp8 experts gpu exit $rc"; grep -E "passed|failed|Error" $o/fp8_experts_gpu.log | tail -4
if [ $rc -ne 0 ]; then pack; exit 1; fi
fp8="--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8"
TRAIN_TIMEOUT=110
train nccl_bf16 --moe_comm.backend nccl
train nvshmem_fp8 $fp8
train nvshmem_bf16
train nccl_bf16_again --moe_comm.backend nccl
train nvshmem_fp8_again $fp8
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
timeout 70 python3 experiments/host_profile.py --out $o/hp --steps 18 --profile-steps 14 15 16 --timeout 60 \
  --runs nvshmem-fp8=nvshmem,--moe_comm.expert_dtype=fp8,--moe_comm.dispatch_dtype=fp8 > $o/host_profile.log 2>&1
stamp "host profile exit $?"; head -8 $o/hp/host_profile.md 2>/dev/null | tail -4
for t in $(find $o -name 'trace*.json.gz'); do cp $t $o/fp8_profiled_steps.json.gz; done
pack
