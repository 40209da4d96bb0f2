#!/usr/bin/env bash
# Device call 1 of the thirteenth session (2026-12-03): the FP8 experts' weights read once (a row
# kernel, no column amax) and dgrad's right operands the forward's codes transposed byte for byte,
# with the forward's row scales folded into dy and dh13. Build; the FP8 kernels' GPU tests; the
# layer bench's experts parts (bf16, FP8 per call, FP8 cached over 32 microbatches).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s13call1 $(( $(date +%s) - start )) s] $*"; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"; tail -2 $o/build.log
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py -s > $o/fp8_experts_gpu.log 2>&1
stamp "fp8 experts gpu exit $?"; grep -E "relative L2|passed|failed|Error|error" $o/fp8_experts_gpu.log | tail -12
python3 - $o/layer_bench.json <<'PY'
import json, sys
doc = json.load(open("results/model_inputs/layer_bench_h200x1.json"))
redo = ("experts.bf16.balanced", "experts.bf16.node_limited", "experts.moe_comm_fp8")
doc["parts"] = [p for p in doc["parts"] if not (p["case"] == "flagship" and p["name"].startswith(redo))]
json.dump(doc, open(sys.argv[1], "w"), indent=1)
PY
timeout 200 python3 experiments/layer_bench.py run --resume --out $o/layer_bench.json --cases flagship \
  --parts experts.bf16.balanced experts.bf16.node_limited experts.moe_comm_fp8 --budget-s 180 --iters 64 --warmup 32 > $o/layer_bench.log 2>&1
stamp "layer bench exit $?"; grep "experts" $o/layer_bench.log | tail -8
python3 experiments/layer_bench.py report $o/layer_bench.json > $o/layer_bench.md 2>&1
grep -E "FP8 experts \(FP8 wgrad" $o/layer_bench.md
cp $o/*.log $o/*.md $o/*.json $OUT/ ; stamp packed
