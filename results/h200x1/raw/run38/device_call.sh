#!/usr/bin/env bash
# Device call 1 of the fourteenth session (2026-12-03): the shipped FP8 experts (83413c0, run 36's
# kernels) over 300 steps of real text (assets/real), same seed: nvshmem bf16 (the reference) and
# nvshmem with FP8 experts + FP8 dispatch. Run 37 carried the same runs and was taken back.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s14call1 $(( $(date +%s) - start )) s] $*"; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"; tail -1 $o/build.log
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
timeout 420 python3 experiments/fp8_dispatch_training.py --recipe recipes/deepseek_v3_671b_h200x1.toml --steps 300 \
  --name fp8_experts_300steps --runs nvshmem:bf16 nvshmem:fp8:expert_dtype=fp8 --out $o --no-wandb \
  --budget-s 400 > $o/fp8_experts_300steps.log 2>&1
stamp "300-step runs exit $?"; tail -5 $o/fp8_experts_300steps.log | cut -c1-250
grep -h "done at step" $o/runs/fp8_experts_300steps/*/train.log 2>/dev/null | cut -c1-200
rm -rf $o/runs/*/*/checkpoint; tar czf $OUT/s14call1.tgz -C $o . ; stamp packed
