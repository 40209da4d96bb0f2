#!/usr/bin/env bash
# Device call 6 of the seventeenth session (2026-12-04): the nvshmem layouts not yet run with
# ROW_ALIGN 128 after runs 48-54 - 2x1 virtual nodes, the two error layouts and the two dead-pair
# preflights - the first call through experiments/device_prelude.sh.
source experiments/device_prelude.sh s17call6
MOE_COMM_GPU_LAYOUTS=2x1,2_errors,2x2_errors,2_dead_pair,2x2_dead_pair MOE_COMM_GPU_TEST_CONCURRENCY=2 \
  MOE_COMM_GPU_REPORTS=$o/reports timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/test_nvshmem_gpu.py > $o/nvshmem_gpu.log 2>&1
stamp "nvshmem gpu exit $?"; tail -3 $o/nvshmem_gpu.log
pack
