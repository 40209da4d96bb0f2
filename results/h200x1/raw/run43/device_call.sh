#!/usr/bin/env bash
# Device call 3 of the fifteenth session (2026-12-03). Run 42 found quantise_rows and
# gate_backward 37-39% slower with the experts' segments padded to 128 rows than to 16 (the same
# kernels, 3% more rows), and Nsight Compute found them issuing 0.3-0.4 instructions a cycle,
# stalled on shared memory with 10-24 warps per SM. Three builds, same call:
#   before: the session's first tree (5fd836c, carried as .device/before: csrc, moe_comm, recipes,
#           experiments);
#   after:  this tree: zero rows (the padding) quantised by dividing by 1 (the same codes), the
#           floor's scale a folded constant, the weight gradients widened by fp8.widen, and the row
#           kernels at 2 vectors a thread in blocks of up to 512 (kRowVecs 2, kRowThreads 512);
#   after4: this tree with the row kernels as before, 4 vectors a thread, blocks of up to 256
#           (experts.h edited in this call's copy only).
# The FP8 experts' GPU tests on after and after4; the kernels alone (experiments/fp8_row_kernels.py)
# of each, the padding zero (and random, before); the one-GPU recipe with FP8 experts + FP8
# dispatch, 30 steps, before, after and after4.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s15call3 $(( $(date +%s) - start )) s] $*"; }
pack() { rm -rf $o/runs/*/checkpoint; tar czf $OUT/s15call3.tgz -C $o . ; stamp packed; }
before=/tmp/before_tree; rm -rf $before; cp -r .device/before $before
cp experiments/fp8_row_kernels.py $before/experiments/
a4=/tmp/after4_tree; rm -rf $a4; mkdir -p $a4; cp -r csrc moe_comm recipes assets experiments tests pyproject.toml $a4/
sed -i 's/^constexpr int kRowThreads = 512;/constexpr int kRowThreads = 256;/; s/^constexpr int kRowVecs = 2;/constexpr int kRowVecs = 4;/' $a4/csrc/experts/experts.h
grep -n "^constexpr int kRow" $a4/csrc/experts/experts.h
build() { (cd $1 && PYTHONPATH=/tmp/site:$1 MAX_JOBS=6 python3 -m moe_comm build --arch 90 --out $2 > $o/build_$3.log 2>&1; echo "build $3 exit $?"); }
build $before /tmp/b0 before & build $a4 /tmp/b4 after4 & build $PWD /tmp/b after; wait; stamp "builds done"
run_in() { local tree=$1 lib=$2; shift 2; (cd $tree && PYTHONPATH=/tmp/site:$tree MOE_COMM_LIBRARY=$lib "$@"); }
after() { run_in $PWD /tmp/b/moe_comm_cuda.so "$@"; }
after4() { run_in $a4 /tmp/b4/moe_comm_cuda.so "$@"; }
bef() { run_in $before /tmp/b0/moe_comm_cuda.so "$@"; }
after timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu.log 2>&1
stamp "fp8 experts gpu (after) exit $?"; grep -E "passed|failed|Error" $o/fp8_experts_gpu.log | tail -4
after4 timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu_after4.log 2>&1
stamp "fp8 experts gpu (after4) exit $?"; grep -E "passed|failed|Error" $o/fp8_experts_gpu_after4.log | tail -4
k="quantise_rows gate gate_backward weights_13 weights_2"
for v in bef after4 after; do
  $v timeout 40 python3 experiments/fp8_row_kernels.py --only $k widen torch_float_cast --out $o/kernels_$v.json > $o/kernels_$v.log 2>&1
  stamp "kernels $v"; cat $o/kernels_$v.log
done
bef timeout 40 python3 experiments/fp8_row_kernels.py --only $k --pad random --out $o/kernels_bef_random.json > $o/kernels_bef_random.log 2>&1
stamp "kernels bef, random padding"; cat $o/kernels_bef_random.log
after timeout 40 python3 experiments/fp8_row_kernels.py --out $o/kernels_after_all.json > $o/kernels_after_all.log 2>&1
stamp "kernels after, all"; cat $o/kernels_after_all.log
fp8="--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8"
train() {  # name, then the runner
  local name=$1 runner=$2
  $runner timeout 75 python3 -m moe_comm train recipes/deepseek_v3_671b_h200x1.toml --training.steps 30 --metrics.log_freq 1 \
    --metrics.no-enable-wandb --job.dump_folder $o/runs/$name $fp8 > $o/train_$name.log 2>&1
  stamp "$name exit $?"; grep -E "done|FAILED|Error" $o/train_$name.log | cut -c1-200 | tail -2
}
train fp8_before bef
train fp8_after after
train fp8_after4 after4
after python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
