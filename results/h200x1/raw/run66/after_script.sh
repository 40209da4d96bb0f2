#!/usr/bin/env bash
# Run 66's command line after device_call.sh (session 25): the whole nvshmem GPU suite at every layout,
# under a 300 s limit. It ran out of time (exit 124) with nothing in nvshmem_gpu_all.log: each test
# waits for its layouts' launches, so pytest -q had not printed a test yet. Run 66b then ran the FP8
# cases at the layouts run 64 had left out.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=/tmp/site:$PWD \
  MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so MOE_COMM_INIT_TIMEOUT=120
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_nvshmem_gpu.py > $OUT/nvshmem_gpu_all.log 2>&1
echo "nvshmem gpu all exit $?"
