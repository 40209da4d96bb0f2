#!/usr/bin/env bash
# Device call prepared in session 21 (2026-12-04, no device lent that session), after run 64: the
# one-GPU recipe under TorchTitan's [compile] (model and loss, inductor) against eager, nccl bf16
# and nvshmem FP8 experts + FP8 dispatch, 100 steps each, in one call. Run 60's trace puts 57.5 ms
# of each FP8 step (and as much of nccl's) in torch's other kernels, much of it what compile fuses:
# autocast's casts of the weights and their gradients' widening (the bf16 -> fp32 copies ran in
# torch's unvectorised cast kernel: 9.7 ms a step), MLA's cats of q and k and their split's
# backward (12 ms), the loss's fp32 copy and log-softmax (11.5 ms), norms, SiLU-mul. The MoE
# layer's dispatch, experts and combine stay eager under compile (TorchTitan's apply_compile
# skips the experts; our MoE forward is not compiled), so both backends gain the same work.
# The first compiled run pays the compile; the second reads inductor's cache (same graphs: the
# compiled modules do not depend on the backend). Each run starts only while the call has time
# left for it (budget guard), packed after each; then, if time is left, the compiled FP8 step profiled.
source experiments/device_prelude.sh run65
fp8="--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8"
compiled="--compile.enable"  # components: TorchTitan's default, model and loss
room() { [ $(( $(date +%s) - start )) -lt $1 ] || { stamp "skipped: past $1 s"; return 1; }; }
TRAIN_TIMEOUT=280 train nccl_bf16_compiled --moe_comm.backend nccl $compiled; pack
grep -E "step 1/|first step" $o/train_nccl_bf16_compiled.log | cut -c1-220 | tail -1
room 330 && { TRAIN_TIMEOUT=150 train nvshmem_fp8_compiled $fp8 $compiled; pack; }
room 420 && { TRAIN_TIMEOUT=90 train nccl_bf16 --moe_comm.backend nccl; pack; }
room 500 && { TRAIN_TIMEOUT=80 train nvshmem_fp8 $fp8; pack; }
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
# where the compiled FP8 step goes (three profiled steps, inductor's cache warm), as run 60's eager one
room 520 && {
  timeout 70 python3 experiments/host_profile.py --out $o/hp --steps 18 --profile-steps 14 15 16 --timeout 60 \
    --runs nvshmem-fp8-compiled=nvshmem,--moe_comm.expert_dtype=fp8,--moe_comm.dispatch_dtype=fp8,--compile.enable \
    > $o/host_profile.log 2>&1
  stamp "host profile exit $?"; head -8 $o/hp/host_profile.md 2>/dev/null | tail -4
  for t in $(find $o -name 'trace*.json.gz'); do cp $t $o/fp8_compiled_profiled_steps.json.gz; done
  pack
}
