#!/usr/bin/env bash
# Issue 27 on four H200s (kind nvidia-h200-x4): build, preflight, then the runs of
# experiments/h200x4_runs.py (EP 4 through every backend; PP 2 x EP 2 with two schedules, two
# microbatch counts, overlap none and chunked), each group one fp8_dispatch_training invocation
# with its comparison, curves, raw metrics and step profile; then the profiles summarised.
#
#   experiments/run_h200x4.sh OUT [DEEPEP_SOURCE]
#
# OUT           results folder (copy it to results/h200x4/ afterwards)
# DEEPEP_SOURCE a DeepEP v1.2.1 folder or `git archive --prefix=DeepEP/ v1.2.1` .tar.gz (machines
#               without network); without it the deepep run fails, recorded, and the rest goes on
# BUDGET_S      (environment) seconds this call may spend, default 540 (a 10-minute command limit):
#               runs that would end past it are left for the next call, which resumes
# Needs the real text of assets/make_real.py in assets/real (fp8_dispatch_training's default).
# Every step keeps NVLink multicast off (the device machines' rule).
set -uo pipefail
out=${1:?usage: experiments/run_h200x4.sh OUT [DEEPEP_SOURCE]}
deepep=${2:-}
start=$(date +%s)
deadline=$(( start + ${BUDGET_S:-540} ))
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1
py=${PYTHON:-python3}

if [ -z "${MOE_COMM_LIBRARY:-}" ]; then
  $py -m moe_comm build --arch 90 --out /tmp/moe_comm_build > "$out/build.log" 2>&1 || { tail -50 "$out/build.log"; exit 1; }
  export MOE_COMM_LIBRARY=/tmp/moe_comm_build/moe_comm_cuda.so
fi
if ! $py -c "import deep_ep" 2>/dev/null && [ -n "$deepep" ]; then
  $py -m moe_comm build-deepep --source "$deepep" > "$out/deepep_build.log" 2>&1 || tail -20 "$out/deepep_build.log"
fi
[ -f "$out/preflight.txt" ] || timeout 120 $py -m torch.distributed.run --standalone --nproc_per_node 4 \
  -m moe_comm preflight recipes/deepseek_v3_671b_layers_h200x4.toml > "$out/preflight.txt" 2>&1
nvidia-smi topo -m > "$out/topology.txt" 2>&1 || true

$py experiments/h200x4_runs.py commands "$out" | while read -r line; do
  left=$(( deadline - $(date +%s) ))
  [ "$left" -gt 60 ] || { echo "budget spent: the next call resumes from here"; break; }
  eval "${line/ -- / --resume --budget-s $left -- }" 2>&1 | grep -v Warning
done

mkdir -p "$out/profiles"
for trace in $(find "$out/runs" -name 'rank0_trace.json' 2>/dev/null); do
  run=$(basename "$(dirname "$(dirname "$(dirname "$trace")")")")
  $py experiments/profile_summary.py "$trace" "$out/profiles/$run.json" > /dev/null 2>&1 || true
done
echo "done in $(( $(date +%s) - start )) s"
