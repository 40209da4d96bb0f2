#!/usr/bin/env bash
# Device call 1 of the seventeenth session (2026-12-04): the nvshmem cases at 2 PEs and 2x2 virtual
# nodes, which now include DualPipeV's overlap with the chunked one outside its pairs
# (overlap_microbatch_layer_matches_plain: a chunked forward outside the pair, its backward in the
# pair beside the other microbatch's forward, two threads, real streams); then GPU idle with nvshmem
# bf16 against nccl over six profiled steps each (run 48 profiled two, and its end-of-step Python
# moved by 2-14 ms from run to run).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s17call1 $(( $(date +%s) - start )) s] $*"; }
pack() { rm -f $o/hp/runs/*/trace.json.gz; rm -rf $o/hp/runs/*/checkpoint; tar czf $OUT/s17call1.tgz -C $o . ; stamp packed; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
MOE_COMM_GPU_LAYOUTS=2,2x2 MOE_COMM_GPU_TEST_CONCURRENCY=2 MOE_COMM_GPU_REPORTS=$o/reports timeout 200 \
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_nvshmem_gpu.py > $o/nvshmem_gpu.log 2>&1
stamp "nvshmem gpu exit $?"; tail -3 $o/nvshmem_gpu.log
pack
timeout 200 python3 experiments/host_profile.py --out $o/hp --steps 22 --profile-steps 14 15 16 17 18 19 --timeout 95 \
  --runs nvshmem nccl > $o/host_profile.log 2>&1
stamp "host profile exit $?"; head -8 $o/hp/host_profile.md 2>/dev/null | tail -4
pack
