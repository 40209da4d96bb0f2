#!/usr/bin/env bash
# Device call 3 of the seventeenth session (2026-12-04): the nvshmem cases at the 8-PE layouts (8 on
# one node, 2x4 and 4x2 virtual nodes), owed since run 40 with ROW_ALIGN 128, again: run 51 packed two
# 8-PE launches side by side and their 16 processes ran the GPU out of memory; the packing now
# counts 12 GiB a rank (tests/test_nvshmem_gpu.py), so they run one after another.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s17call3 $(( $(date +%s) - start )) s] $*"; }
pack() { tar czf $OUT/s17call3.tgz -C $o . ; stamp packed; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
MOE_COMM_GPU_LAYOUTS=8,2x4,4x2 MOE_COMM_GPU_TEST_CONCURRENCY=2 MOE_COMM_GPU_REPORTS=$o/reports timeout 490 \
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_nvshmem_gpu.py > $o/nvshmem_gpu.log 2>&1
stamp "nvshmem gpu exit $?"; tail -3 $o/nvshmem_gpu.log
pack
