#!/usr/bin/env bash
# Device call 2 of the sixteenth session (2026-12-03): the one-GPU recipe now loads its batches in a
# dataloader worker ([training.dataloader] num_workers 1, prefetch_factor 2; run 46 measured it).
# Where the FP8 step's remaining time goes: experiments/host_profile.py on nvshmem with FP8 experts
# + FP8 dispatch and on nccl, same call (GPU idle share, what the host did while the GPU waited).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s16call2 $(( $(date +%s) - start )) s] $*"; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
timeout 230 python3 experiments/host_profile.py --out $o/hp --steps 16 --timeout 110 --runs \
  nvshmem-fp8=nvshmem,--moe_comm.expert_dtype=fp8,--moe_comm.dispatch_dtype=fp8 nccl > $o/host_profile.log 2>&1
stamp "host profile exit $?"; cat $o/hp/host_profile.md 2>/dev/null | head -40
for r in nvshmem-fp8 nccl; do cp $o/hp/runs/$r/trace.json.gz $OUT/trace_$r.json.gz 2>/dev/null; done
rm -f $o/hp/runs/*/trace.json.gz; rm -rf $o/hp/runs/*/checkpoint
tar czf $OUT/s16call2.tgz -C $o . ; stamp packed
