#!/usr/bin/env bash
# Device call prepared in session 22 (2026-12-04, no device lent that session), after run 64: the
# one-GPU recipe with only its loss compiled (TorchTitan's `--compile.enable --compile.components
# loss`: the model stays eager) against eager, nccl bf16 and nvshmem FP8 experts + FP8 dispatch,
# 100 steps each, in one call. Run 60's trace puts 11.5 ms of each step in the loss's fp32 copy
# of the 8,192 x 129,280 logits and its log-softmax (eager: about 36 bytes moved per logit over
# forward and backward), the same in both backends; inductor fuses the upcast, the log-softmax and
# their backward into reductions that read the bf16 logits and write their bf16 gradient. It also
# keeps no fp32 logits for the backward (`check`: logits 5.9 GiB at the step's peak, 4 bytes of the
# 6 each fp32). If the FP8 step and nccl's lose the same ~9 ms, FP8 / nccl rises about 0.5% (run
# 63: 0.338 against 0.405 s). Lower risk and shorter than compiling the model too (raw/run67/).
# The first compiled run pays the loss's compile; the others read inductor's cache. Each run starts
# only while the call has time left for it, packed after each; then, if time is left, the
# loss-compiled FP8 step profiled (where the loss's kernels go).
source experiments/device_prelude.sh run65
fp8="--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8"
loss="--compile.enable --compile.components loss"
room() { [ $(( $(date +%s) - start )) -lt $1 ] || { stamp "skipped: past $1 s"; return 1; }; }
TRAIN_TIMEOUT=150 train nccl_bf16_loss_compiled --moe_comm.backend nccl $loss; pack
grep -E "Compiling the loss|step 1/" $o/train_nccl_bf16_loss_compiled.log | cut -c1-220 | tail -2
TRAIN_TIMEOUT=90
room 250 && { train nvshmem_fp8_loss_compiled $fp8 $loss; pack; }
room 320 && { train nccl_bf16 --moe_comm.backend nccl; pack; }
room 390 && { train nvshmem_fp8 $fp8; pack; }
room 460 && { train nccl_bf16_loss_compiled_again --moe_comm.backend nccl $loss; pack; }
room 520 && { train nvshmem_fp8_loss_compiled_again $fp8 $loss; pack; }
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
# where the loss-compiled FP8 step goes (three profiled steps, inductor's cache warm), as run 60's eager one
room 510 && {
  timeout 75 python3 experiments/host_profile.py --out $o/hp --steps 18 --profile-steps 14 15 16 --timeout 65 \
    --runs nvshmem-fp8-loss-compiled=nvshmem,--moe_comm.expert_dtype=fp8,--moe_comm.dispatch_dtype=fp8,--compile.enable,--compile.components=loss \
    > $o/host_profile.log 2>&1
  stamp "host profile exit $?"; head -8 $o/hp/host_profile.md 2>/dev/null | tail -4
  for t in $(find $o -name 'trace*.json.gz'); do cp $t $o/fp8_loss_compiled_profiled_steps.json.gz; done
  pack
}
