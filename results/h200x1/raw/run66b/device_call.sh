#!/usr/bin/env bash
# Device call of session 25 (2026-12-05), on main with the branch row-kernels merged (the tree run 65
# and 66 ran, eb1d9fa): FP8 dispatch's GPU cases (`-k fp8`, bit for bit against the reference that
# multiplies by the scale's reciprocal too) at every layout run 64 left out, two at a time under MPS.
# Run as one command line, not from this file; its logs' names held commas, so the device tool did not
# bring them back: what it printed is in output.log. Carry [".whl"].
source experiments/device_prelude.sh run66b
for group in 2,4,2x1,4x1 8,2x4,4x2; do
  MOE_COMM_GPU_LAYOUTS=$group MOE_COMM_GPU_TEST_CONCURRENCY=2 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider \
    -k fp8 tests/test_nvshmem_gpu.py > $OUT/nvshmem_gpu_fp8_$group.log 2>&1
  stamp "nvshmem gpu fp8 cases $group exit $?"; grep -E "FAIL|passed|failed" $OUT/nvshmem_gpu_fp8_$group.log | tail -4
done
