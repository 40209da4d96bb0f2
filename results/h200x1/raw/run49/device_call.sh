#!/usr/bin/env bash
# Device call 4 of the sixteenth session (2026-12-03), the last ~330 device seconds: the nvshmem
# cases at 8 PEs on one node with ROW_ALIGN 128 (not run since run 17/19's kernels).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s16call4 $(( $(date +%s) - start )) s] $*"; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
MOE_COMM_GPU_LAYOUTS=8 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_nvshmem_gpu.py > $o/nvshmem_gpu.log 2>&1
stamp "nvshmem gpu exit $?"; tail -3 $o/nvshmem_gpu.log
tar czf $OUT/s16call4.tgz -C $o . ; stamp packed
