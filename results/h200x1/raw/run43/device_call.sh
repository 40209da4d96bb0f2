#!/usr/bin/env bash
# Device call 3 of the fifteenth session (2026-12-03). Run 42 found quantise_rows and
# gate_backward 37-39% slower with the experts' segments padded to 128 rows than to 16 (the same
# kernels, 3% more rows), and Nsight Compute found them issuing 0.3-0.4 instructions a cycle,
# stalled on shared memory. Here, "before" is the session's first tree (5fd836c, carried as
# .device/before: csrc, moe_comm, recipes, experiments) and "after" this tree: zero rows (the
# padding) quantised by dividing by 1 (same codes), the floor's scale a folded constant, and the
# widening of the weight gradients 4 loads deep. Both builds; the FP8 experts' GPU tests (after);
# the kernels alone (experiments/fp8_row_kernels.py) before and after, padding zero or random;
# instructions executed per kernel (ncu) before, padding zero and random; the one-GPU recipe with
# FP8 experts + FP8 dispatch, 30 steps, before and after.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s15call3 $(( $(date +%s) - start )) s] $*"; }
pack() { rm -rf $o/runs/*/checkpoint; tar czf $OUT/s15call3.tgz -C $o . ; stamp packed; }
before=/tmp/before_tree; rm -rf $before; cp -r .device/before $before; cp -r assets $before/ 2>/dev/null
cp experiments/fp8_row_kernels.py experiments/one_gpu_table.py $before/experiments/
(cd $before && PYTHONPATH=/tmp/site:$before MAX_JOBS=8 python3 -m moe_comm build --arch 90 --out /tmp/b0 > $o/build_before.log 2>&1) &
PYTHONPATH=/tmp/site:$PWD MAX_JOBS=8 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"
wait; stamp "builds done"; tail -1 $o/build.log $o/build_before.log
after() { PYTHONPATH=/tmp/site:$PWD MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so "$@"; }
bef() { (cd $before && PYTHONPATH=/tmp/site:$before MOE_COMM_LIBRARY=/tmp/b0/moe_comm_cuda.so "$@"); }
after timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu.log 2>&1
stamp "fp8 experts gpu exit $?"; grep -E "passed|failed|Error" $o/fp8_experts_gpu.log | tail -4
k="quantise_rows gate gate_backward weights_13 weights_2"
bef timeout 40 python3 experiments/fp8_row_kernels.py --only $k --out $o/before_zero.json > $o/before_zero.log 2>&1
stamp "before, zero padding"; cat $o/before_zero.log
bef timeout 40 python3 experiments/fp8_row_kernels.py --only $k --pad random --out $o/before_random.json > $o/before_random.log 2>&1
stamp "before, random padding"; cat $o/before_random.log
after timeout 60 python3 experiments/fp8_row_kernels.py --out $o/after_zero.json > $o/after_zero.log 2>&1
stamp "after, zero padding"; cat $o/after_zero.log
after timeout 40 python3 experiments/fp8_row_kernels.py --only $k --align 16 --out $o/after_align16.json > $o/after_align16.log 2>&1
stamp "after, padded to 16"; cat $o/after_align16.log
for pad in zero random; do
  bef timeout 60 ncu --clock-control none -k regex:'gate_backward|quantise_rows' --metrics \
    smsp__inst_executed.sum,gpu__time_duration.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,dram__bytes.sum \
    python3 experiments/fp8_row_kernels.py --iters 1 --only quantise_rows gate_backward --pad $pad > $o/ncu_before_$pad.log 2>&1
  stamp "ncu before $pad exit $?"; grep -E "_kernel|inst_executed|duration|wavefronts|dram__bytes" $o/ncu_before_$pad.log | head -16
done
fp8="--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8"
train() {  # name, then the runner
  local name=$1; shift
  "$@" timeout 75 python3 -m moe_comm train recipes/deepseek_v3_671b_h200x1.toml --training.steps 30 --metrics.log_freq 1 \
    --metrics.no-enable-wandb --job.dump_folder $o/runs/$name $fp8 > $o/train_$name.log 2>&1
  stamp "$name exit $?"; grep -E "done|FAILED|Error" $o/train_$name.log | cut -c1-200 | tail -2
}
train fp8_before bef
train fp8_after after
train fp8_before2 bef
after python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
