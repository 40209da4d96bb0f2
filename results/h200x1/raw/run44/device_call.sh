#!/usr/bin/env bash
# Device call 4 of the fifteenth session (2026-12-03), this tree: the weight gradients widened by
# fp8.widen, the rows' kernels (quantise_rows, gate, gate_backward) at 2 vectors a thread in blocks
# of up to 512, the weights' kernel at 4 as before (run 43: 2 slowed it). Build; the FP8 experts'
# GPU tests; the FP8 kernels alone at the one-GPU recipe's layer; the one-GPU recipe 100 steps
# each, same call: nccl bf16, nvshmem bf16, nvshmem FP8 experts + FP8 dispatch; then nvshmem FP8
# on the session's first tree (5fd836c, carried as .device/before) for the before/after pair.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s15call4 $(( $(date +%s) - start )) s] $*"; }
pack() { rm -rf $o/runs/*/checkpoint; tar czf $OUT/s15call4.tgz -C $o . ; stamp packed; }
before=/tmp/before_tree; rm -rf $before; cp -r .device/before $before; cp -r slurm $before/
(cd $before && PYTHONPATH=/tmp/site:$before MAX_JOBS=6 python3 -m moe_comm build --arch 90 --out /tmp/b0 > $o/build_before.log 2>&1) &
PYTHONPATH=/tmp/site:$PWD MAX_JOBS=10 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"
tail -1 $o/build.log
export PYTHONPATH=/tmp/site:$PWD MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu.log 2>&1
rc=$?; stamp "fp8 experts gpu exit $rc"; grep -E "passed|failed|Error" $o/fp8_experts_gpu.log | tail -4
if [ $rc -ne 0 ]; then pack; exit 1; fi
timeout 40 python3 experiments/fp8_row_kernels.py --out $o/kernels.json > $o/kernels.log 2>&1
stamp "kernels"; cat $o/kernels.log
fp8="--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8"
run() {  # name, then train overrides
  local name=$1; shift
  timeout 150 python3 -m moe_comm train recipes/deepseek_v3_671b_h200x1.toml --training.steps 100 --metrics.log_freq 1 \
    --metrics.no-enable-wandb --job.dump_folder $o/runs/$name "$@" > $o/train_$name.log 2>&1
  stamp "$name exit $?"; grep -E "done|FAILED|Error" $o/train_$name.log | cut -c1-200 | tail -2
}
run nccl_bf16 --moe_comm.backend nccl
run nvshmem_bf16
run nvshmem_fp8 $fp8
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
wait
(cd $before && PYTHONPATH=/tmp/site:$before MOE_COMM_LIBRARY=/tmp/b0/moe_comm_cuda.so timeout 150 python3 -m moe_comm train \
  recipes/deepseek_v3_671b_h200x1.toml --training.steps 100 --metrics.log_freq 1 --metrics.no-enable-wandb \
  --job.dump_folder $o/before/nvshmem_fp8_before $fp8 > $o/train_nvshmem_fp8_before.log 2>&1)
stamp "nvshmem_fp8_before exit $?"; grep -E "done|FAILED|Error" $o/train_nvshmem_fp8_before.log | cut -c1-200 | tail -2
pack
