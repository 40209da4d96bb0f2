#!/usr/bin/env bash
# Device call 4 of the thirteenth session (2026-12-03): as call 3 (run 36), with the row kernels'
# grid one wave of resident blocks (each walks one contiguous share of the rows). Build; the FP8
# kernels' GPU tests; the layer bench's experts parts; then the one-GPU recipe on real text
# (assets/real), 300 steps, same seed: nvshmem bf16 (the reference), nvshmem with FP8 experts +
# FP8 dispatch, nccl bf16.
# Outcome: the machine was taken back during this call; no output came back (results/h200x1/README.md,
# thirteenth session), and the tree it ran (cb2ab85) was reverted to run 36's kernels by 83413c0.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s13call4 $(( $(date +%s) - start )) s] $*"; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"; tail -1 $o/build.log
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py -s > $o/fp8_experts_gpu.log 2>&1
stamp "fp8 experts gpu exit $?"; grep -E "relative L2|passed|failed|Error|assert" $o/fp8_experts_gpu.log | tail -14
python3 - $o/layer_bench.json <<'PY'
import json, sys
doc = json.load(open("results/model_inputs/layer_bench_h200x1.json"))
redo = ("experts.bf16.balanced", "experts.bf16.node_limited", "experts.moe_comm_fp8")
doc["parts"] = [p for p in doc["parts"] if not (p["case"] == "flagship" and p["name"].startswith(redo))]
json.dump(doc, open(sys.argv[1], "w"), indent=1)
PY
timeout 200 python3 experiments/layer_bench.py run --resume --out $o/layer_bench.json --cases flagship \
  --parts experts.bf16.balanced experts.bf16.node_limited experts.moe_comm_fp8 --budget-s 180 --iters 64 --warmup 32 > $o/layer_bench.log 2>&1
stamp "layer bench exit $?"
python3 experiments/layer_bench.py report $o/layer_bench.json > $o/layer_bench.md 2>&1
grep -E "FP8 experts \(FP8 wgrad" $o/layer_bench.md
python3 - $o/layer_bench.json <<'PY'
import json, sys
for p in json.load(open(sys.argv[1]))["parts"]:
    if p["case"] == "flagship" and p["name"] == "experts.moe_comm_fp8.balanced":
        print({k: round(v, 3) for k, v in p["breakdown"]["steps_ms"].items()})
PY
timeout 470 python3 experiments/fp8_dispatch_training.py --recipe recipes/deepseek_v3_671b_h200x1.toml --steps 300 \
  --name fp8_experts_300steps --runs nvshmem:bf16 nvshmem:fp8:expert_dtype=fp8 nccl:bf16 --out $o --no-wandb \
  --budget-s 450 > $o/fp8_experts_300steps.log 2>&1
stamp "300-step runs exit $?"; tail -5 $o/fp8_experts_300steps.log | cut -c1-250
grep -h "done at step" $o/runs/fp8_experts_300steps/*/train.log 2>/dev/null | cut -c1-200
rm -rf $o/runs/*/*/checkpoint; tar czf $OUT/s13call4.tgz -C $o . ; stamp packed
