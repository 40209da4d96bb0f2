#!/usr/bin/env bash
# Device call of the branch row-kernels (prepared in session 20, not yet run), main's
# tree carried in .device/old (git archive main | tar x -C .device/old; rm -rf .device/old/results;
# carry [".whl", ".device/old"]) and built beside it. The branch's row kernels (quantise_rows,
# gate, gate_backward, weights) take one block barrier a row instead of two (BlockMax, rows.cuh),
# and quantise_rows and gate_backward no longer keep their experts' walk in local memory (ptxas -v
# with the build's flags: 112 and 96 bytes of stack frame with spills on main, 8 and 0 here).
# The FP8 experts' GPU tests of this tree (their kernels bit for bit against the reference); the row
# kernels alone, main's and this tree's alternated twice; then the one-GPU recipe 100 steps each:
# nccl bf16, this tree's FP8, nccl, FP8 (about 6 minutes). Merge if the tests pass and the kernels
# are faster. The SM clock and power are sampled through the first FP8 run.
source experiments/device_prelude.sh run64
old=$PWD/.device/old
(cd $old && PYTHONPATH=/tmp/site:$old MAX_JOBS=8 python3 -m moe_comm build --arch 90 --out /tmp/b_old > $o/build_old.log 2>&1) &
build_old=$!
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu.log 2>&1
rc=$?; stamp "fp8 experts gpu exit $rc"; grep -E "passed|failed|Error" $o/fp8_experts_gpu.log | tail -4
if [ $rc -ne 0 ]; then pack; exit 1; fi
wait $build_old; stamp "old build exit $?"
only="quantise_rows gate gate_backward weights_13 weights_2"
for n in 1 2; do
  (cd $old && PYTHONPATH=/tmp/site:$old MOE_COMM_LIBRARY=/tmp/b_old/moe_comm_cuda.so timeout 60 python3 \
    experiments/fp8_row_kernels.py --only $only --out $o/row_kernels_main_$n.json > $o/row_kernels_main_$n.log 2>&1)
  stamp "main's row kernels ($n) exit $?"; grep -E "quantise|gate|weights" $o/row_kernels_main_$n.log | cut -c1-80
  timeout 60 python3 experiments/fp8_row_kernels.py --only $only --out $o/row_kernels_$n.json > $o/row_kernels_$n.log 2>&1
  stamp "row kernels ($n) exit $?"; grep -E "quantise|gate|weights" $o/row_kernels_$n.log | cut -c1-80
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
