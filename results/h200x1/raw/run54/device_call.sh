#!/usr/bin/env bash
# Device call 5 of the seventeenth session (2026-12-04): the nvshmem cases at 2x4 and 4x2 virtual
# nodes (8 PEs), the rest of what run 52 owed; after run 53 passed 8 PEs on one node with each
# case giving back what it held (tests/gpu/case_runner.py). The two launches run one after
# another (their ranks do not fit the GPU.s memory together: tests/test_nvshmem_gpu.py).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s17call5 $(( $(date +%s) - start )) s] $*"; }
pack() { tar czf $OUT/s17call5.tgz -C $o . ; stamp packed; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
MOE_COMM_GPU_LAYOUTS=2x4,4x2 MOE_COMM_GPU_TEST_CONCURRENCY=2 MOE_COMM_GPU_REPORTS=$o/reports timeout 300 \
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_nvshmem_gpu.py > $o/nvshmem_gpu.log 2>&1
stamp "nvshmem gpu exit $?"; tail -3 $o/nvshmem_gpu.log
pack
