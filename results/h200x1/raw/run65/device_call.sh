#!/usr/bin/env bash
# Ran on 2026-12-05 (session 25) on the tree eb1d9fa (branch row-kernels, merged into main after), carrying [".whl"]; what it printed: results/h200x1/README.md, twenty-fifth session.
# Device call prepared in sessions 21-22 (2026-12-04, no device lent in either), after run 64: the
# one-GPU recipe, nccl bf16 and nvshmem FP8 experts + FP8 dispatch, under TorchTitan's [compile]
# three ways in one call, 60 steps each: model and loss compiled (`--compile.enable`, its default
# components), the loss alone (`--compile.components loss`), and eager.
# Run 60's trace puts much of each step in torch's other kernels, the same work in both backends:
#   - the loss: the fp32 copy of the 8,192 x 129,280 logits and its log-softmax, 11.5 ms (about
#     36 bytes moved per logit, forward and backward); compiled, inductor reduces over the bf16
#     logits and keeps no fp32 copy for the backward (`check`: 5.9 GiB of logits at the peak);
#   - autocast's weight casts and their gradients' casts back to fp32 (torch's unrolled copy
#     kernel, 13 ms a step), MLA's cats of q and k and their split's backward (12 ms), norms.
# TorchTitan's apply_compile compiles each block's attention and norms and the MoE's router and
# shared expert, not its experts (our MoE's dispatch, experts and combine stay eager); under nccl
# it also compiles TorchTitan's grouped-GEMM experts. About 9 ms less in both steps would take
# run 63's FP8 / nccl from 1.197 to about 1.203.
# The first compiled run pays the compile (inductor's cache serves the next). Each run starts only
# while the call has time left for it, packed after each; the loss-compiled pair before the eager
# pair (the eager one ran in every call since run 56, and in run 64 this session).
source experiments/device_prelude.sh run65
fp8="--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8"
compiled="--compile.enable"  # components: TorchTitan's default, model and loss
loss="--compile.enable --compile.components loss"
room() { [ $(( $(date +%s) - start )) -lt $1 ] || { stamp "skipped: past $1 s"; return 1; }; }
export TRAIN_STEPS=60  # medians over steps 11-60
TRAIN_TIMEOUT=240 train nccl_bf16_compiled --moe_comm.backend nccl $compiled; pack
grep -E "step 1/" $o/train_nccl_bf16_compiled.log | cut -c1-220 | tail -1
room 330 && { TRAIN_TIMEOUT=120 train nvshmem_fp8_compiled $fp8 $compiled; pack; }
room 440 && { TRAIN_TIMEOUT=75 train nccl_bf16_loss_compiled --moe_comm.backend nccl $loss; pack; }
room 480 && { TRAIN_TIMEOUT=70 train nvshmem_fp8_loss_compiled $fp8 $loss; pack; }
room 520 && { TRAIN_TIMEOUT=65 train nccl_bf16 --moe_comm.backend nccl; pack; }
room 530 && { TRAIN_TIMEOUT=60 train nvshmem_fp8 $fp8; pack; }
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
