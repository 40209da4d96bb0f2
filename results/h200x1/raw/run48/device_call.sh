#!/usr/bin/env bash
# Device call 3 of the sixteenth session (2026-12-03): GPU idle with nvshmem bf16 against nccl, same
# call (experiments/host_profile.py, the batches loaded by the recipe's dataloader worker); then the
# nvshmem cases at the 2- and 4-PE layouts with ROW_ALIGN 128 (owed since run 40).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s16call3 $(( $(date +%s) - start )) s] $*"; }
pack() { rm -f $o/hp/runs/*/trace.json.gz; rm -rf $o/hp/runs/*/checkpoint; tar czf $OUT/s16call3.tgz -C $o . ; stamp packed; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
timeout 150 python3 experiments/host_profile.py --out $o/hp --steps 16 --timeout 70 --runs nvshmem nccl > $o/host_profile.log 2>&1
stamp "host profile exit $?"; head -8 $o/hp/host_profile.md 2>/dev/null | tail -4
pack
MOE_COMM_GPU_LAYOUTS=2,4,4x1 MOE_COMM_GPU_TEST_CONCURRENCY=2 timeout 230 python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/test_nvshmem_gpu.py > $o/nvshmem_gpu.log 2>&1
stamp "nvshmem gpu exit $?"; tail -3 $o/nvshmem_gpu.log
pack
