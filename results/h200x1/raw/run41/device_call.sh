#!/usr/bin/env bash
# Device call 1 of the fifteenth session (2026-12-03), tree 5fd836c (ROW_ALIGN 128, put8_in_tile):
# where the one-GPU recipe's host time and GPU idle go, run by run (experiments/host_profile.py,
# never run on a GPU before: nvshmem FP8 experts + FP8 dispatch, nvshmem bf16, nccl bf16; 16 steps
# each, sync-debug at steps 9-10, torch.profiler at 12-13); then the GPU cases owed since run 40
# (the nvshmem cases at layouts 1 and 2x2 with ROW_ALIGN 128 and the emulated link's warm-up; the
# FP8 experts' kernels after put8_in_tile).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s15call1 $(( $(date +%s) - start )) s] $*"; }
pack() {
  for t in $o/hp/runs/*/trace.json.gz; do  # the FP8 run's trace comes back whole when it fits
    l=$(basename $(dirname $t)); s=$(stat -c %s $t)
    if [ "$l" = nvshmem-fp8 ] && [ $s -lt 15000000 ]; then cp $t $OUT/trace_$l.json.gz; fi
    stamp "trace $l $s bytes"; rm -f $t
  done
  rm -rf $o/hp/runs/*/checkpoint $o/hp/runs/*/profile_trace
  tar czf $OUT/s15call1.tgz -C $o . ; stamp packed
}
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"; tail -1 $o/build.log
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
timeout 330 python3 experiments/host_profile.py --out $o/hp --steps 16 --timeout 100 --runs \
  nvshmem-fp8=nvshmem,--moe_comm.expert_dtype=fp8,--moe_comm.dispatch_dtype=fp8 nvshmem nccl > $o/host_profile.log 2>&1
stamp "host profile exit $?"; tail -40 $o/hp/host_profile.md
timeout 40 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu.log 2>&1
stamp "fp8 experts gpu exit $?"; grep -E "passed|failed" $o/fp8_experts_gpu.log | tail -2
MOE_COMM_GPU_LAYOUTS=1,2x2 MOE_COMM_GPU_TEST_CONCURRENCY=2 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/test_nvshmem_gpu.py > $o/nvshmem_gpu_1_2x2.log 2>&1
stamp "nvshmem gpu 1,2x2 exit $?"; grep -E "FAIL|passed|failed" $o/nvshmem_gpu_1_2x2.log | tail -6
pack
