#!/usr/bin/env bash
# Device call 2 of the fifteenth session (2026-12-03): the weight gradients widened to fp32 by our
# kernel (fp8.widen) instead of autograd's cast, which run 41's trace showed at 1.48 ms per
# gradient. Build; the FP8 experts' GPU tests (widen bit for bit included); the FP8 kernels alone at
# the one-GPU recipe's layer (experiments/fp8_row_kernels.py) with the experts' segments padded to
# 128 and to 16 rows; Nsight Compute on quantise_rows and gate_backward (why they move ~1 TB/s);
# the one-GPU recipe with FP8 experts + FP8 dispatch, 30 steps.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s15call2 $(( $(date +%s) - start )) s] $*"; }
pack() { rm -rf $o/runs/*/checkpoint; tar czf $OUT/s15call2.tgz -C $o . ; stamp packed; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"; tail -1 $o/build.log
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu.log 2>&1
stamp "fp8 experts gpu exit $?"; grep -E "passed|failed|Error" $o/fp8_experts_gpu.log | tail -4
timeout 60 python3 experiments/fp8_row_kernels.py --out $o/kernels_align128.json > $o/kernels_align128.log 2>&1
stamp "kernels align 128 exit $?"; cat $o/kernels_align128.log
timeout 60 python3 experiments/fp8_row_kernels.py --align 16 --only quantise_rows gate gate_backward group_columns_dy \
  --out $o/kernels_align16.json > $o/kernels_align16.log 2>&1
stamp "kernels align 16 exit $?"; cat $o/kernels_align16.log
timeout 150 ncu --clock-control none -k regex:'gate_backward|quantise_rows' --section SpeedOfLight --section Occupancy \
  --section WarpStateStats --section SchedulerStats --section LaunchStats python3 experiments/fp8_row_kernels.py --iters 1 \
  --only quantise_rows gate_backward > $o/ncu.log 2>&1
stamp "ncu exit $?"; grep -E "Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Block Limit|Stall|Warp Cycles Per Issued|Issued Warp|No Eligible|Registers Per|==PROF==|==ERROR==" $o/ncu.log | head -60
timeout 75 python3 -m moe_comm train recipes/deepseek_v3_671b_h200x1.toml --training.steps 30 --metrics.log_freq 1 \
  --metrics.no-enable-wandb --job.dump_folder $o/runs/nvshmem_fp8 --moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8 \
  > $o/train_nvshmem_fp8.log 2>&1
stamp "nvshmem_fp8 exit $?"; grep -E "done|FAILED|Error" $o/train_nvshmem_fp8.log | cut -c1-200 | tail -2
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
