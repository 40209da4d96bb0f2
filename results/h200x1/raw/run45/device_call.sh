#!/usr/bin/env bash
# Device call 5 of the fifteenth session (2026-12-03), the last 265 device seconds: the one-GPU
# recipe with FP8 experts + FP8 dispatch on this tree, profiled (experiments/host_profile.py, as
# run 41 on the session's first tree), so the FP8 kernels' time inside the training step is read
# from the same kind of trace before (run 41) and after.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s15call5 $(( $(date +%s) - start )) s] $*"; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
timeout 110 python3 experiments/host_profile.py --out $o/hp --steps 16 --timeout 100 --runs \
  nvshmem-fp8=nvshmem,--moe_comm.expert_dtype=fp8,--moe_comm.dispatch_dtype=fp8 > $o/host_profile.log 2>&1
stamp "host profile exit $?"; head -8 $o/hp/host_profile.md | tail -2
cp $o/hp/runs/nvshmem-fp8/trace.json.gz $OUT/trace_nvshmem-fp8.json.gz 2>/dev/null
rm -f $o/hp/runs/*/trace.json.gz; rm -rf $o/hp/runs/*/checkpoint
tar czf $OUT/s15call5.tgz -C $o . ; stamp packed
