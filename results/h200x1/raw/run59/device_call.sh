#!/usr/bin/env bash
# Device call 4 of the eighteenth session (2026-12-04), the session's last device minutes: where
# the FP8 step's GPU time and idle go with the weights made right after each optimizer step
# (run 58's tree): one profiled run of nvshmem FP8 experts + FP8 dispatch, three steps profiled.
# The trace is kept (renamed so that pack keeps it) to see the weights' kernels on the cache's
# stream against the step's idle.
source experiments/device_prelude.sh s18call4
timeout 100 python3 experiments/host_profile.py --out $o/hp --steps 18 --profile-steps 14 15 16 --timeout 80 \
  --runs nvshmem-fp8=nvshmem,--moe_comm.expert_dtype=fp8,--moe_comm.dispatch_dtype=fp8 > $o/host_profile.log 2>&1
stamp "host profile exit $?"; head -8 $o/hp/host_profile.md 2>/dev/null | tail -4
for t in $(find $o -name 'trace*.json.gz'); do cp $t $o/fp8_profiled_steps.json.gz; done
pack
