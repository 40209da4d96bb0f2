#!/usr/bin/env bash
# The one-GPU measurements of issue 34 items 1 and 3 and issue 35 item 3, in one go (one H200):
#   attention: the layer bench's attention parts for the flagship and Nebius shapes - SDPA, and
#              FlexAttention and variable-length attention block-causal at one document, 512-token
#              documents and the data's document lengths - all measured afresh in this run into a
#              copy of results/model_inputs/layer_bench_h200x1.json (its other parts kept), then the varlen-vs-flex
#              GPU test at the flagship shape;
#   syncs:     host synchronisations per dispatch and combine of each backend
#              (experiments/host_syncs.py: nccl and nvshmem at EP 1, deepep and nvshmem at 2 PEs
#              under MPS, nccl at EP 2 on CPU).
# csrc/ and DeepEP v1.2.1 build in the background (CPU) while the GPU measures attention.
# Usage: experiments/measure_gpu.sh OUT_DIR [DEEPEP_SOURCE] [attention|syncs|all]
# Writes OUT_DIR/{layer_bench.json,layer_bench.md,layer_bench.log,varlen_gpu.log,host_syncs.json,
# host_syncs.md,host_syncs.log,build.log,deepep_build.log}. NVLink multicast stays off (the device
# machines' rule).
set -uo pipefail
out=${1:?usage: measure_gpu.sh OUT_DIR [DEEPEP_SOURCE] [attention|syncs|all]}
deepep=${2:-}
what=${3:-all}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MOE_COMM_INIT_TIMEOUT=${MOE_COMM_INIT_TIMEOUT:-120}
py=${PYTHON:-python3}
start=$(date +%s)
stamp() { echo "[measure_gpu $(( $(date +%s) - start )) s] $*"; }

builds=()
if [ "$what" != attention ]; then
  if [ -z "${MOE_COMM_LIBRARY:-}" ]; then
    MAX_JOBS=8 $py -m moe_comm build --arch 90 --out /tmp/moe_comm_build > "$out/build.log" 2>&1 &
    builds+=($!)
    export MOE_COMM_LIBRARY=/tmp/moe_comm_build/moe_comm_cuda.so
  fi
  if ! $py -c "import deep_ep" 2>/dev/null; then
    MAX_JOBS=8 $py -m moe_comm build-deepep ${deepep:+--source "$deepep"} > "$out/deepep_build.log" 2>&1 &
    builds+=($!)
  fi
fi

if [ "$what" != syncs ]; then
  # every attention part measured in this run (flex and varlen side by side), the rest kept
  $py - "$out/layer_bench.json" <<'EOF'
import json, sys
doc = json.load(open("results/model_inputs/layer_bench_h200x1.json"))
doc["parts"] = [p for p in doc["parts"] if not p["name"].startswith("attention.")]
json.dump(doc, open(sys.argv[1], "w"), indent=1)
EOF
  stamp "layer bench: attention parts"
  timeout 330 $py experiments/layer_bench.py run --resume --out "$out/layer_bench.json" --parts attention \
    --budget-s 270 > "$out/layer_bench.log" 2>&1
  stamp "layer bench exit $?"
  $py experiments/layer_bench.py report "$out/layer_bench.json" > "$out/layer_bench.md" 2>&1
  grep -A12 "Block-causal attention kernels alone" "$out/layer_bench.md"
  stamp "varlen GPU test"
  timeout 180 $py -m pytest -m gpu -q -s -p no:cacheprovider tests/test_varlen_gpu.py > "$out/varlen_gpu.log" 2>&1
  stamp "varlen GPU test exit $?"
  tail -25 "$out/varlen_gpu.log"
fi

if [ "$what" != attention ]; then
  for pid in ${builds[@]+"${builds[@]}"}; do wait "$pid" || { stamp "a build failed"; tail -20 "$out/build.log" "$out/deepep_build.log"; }; done
  stamp "host syncs"
  timeout 300 $py experiments/host_syncs.py run --out "$out/host_syncs.json" \
    --cases nccl_ep1 nvshmem_ep1 deepep_2pe nvshmem_2pe nccl_ep2_cpu > "$out/host_syncs.log" 2>&1
  stamp "host syncs exit $?"
  $py experiments/host_syncs.py report "$out/host_syncs.json" > "$out/host_syncs.md" 2>&1
  cat "$out/host_syncs.md"
fi
stamp done
