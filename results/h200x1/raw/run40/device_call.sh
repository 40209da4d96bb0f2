#!/usr/bin/env bash
# Device call 3 of the fourteenth session (2026-12-03): fp8_experts.ROW_ALIGN = 128 shipped (run 39
# measured it in a copy of the tree). Build; the nvshmem cases at 1 PE and 2x2 virtual nodes (the
# FP8 experts' layout padded to ROW_ALIGN); the layer bench's experts parts; nccl bf16, nvshmem
# bf16, nvshmem FP8 experts + FP8 dispatch, the one-GPU recipe 100 steps each.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s); stamp() { echo "[s14call3 $(( $(date +%s) - start )) s] $*"; }
pack() { rm -rf $o/runs/*/checkpoint; tar czf $OUT/s14call3.tgz -C $o . ; stamp packed; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"; tail -1 $o/build.log
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
MOE_COMM_GPU_LAYOUTS=1,2x2 MOE_COMM_GPU_TEST_CONCURRENCY=2 timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/test_nvshmem_gpu.py > $o/nvshmem_gpu_1_2x2.log 2>&1
stamp "nvshmem gpu exit $?"; grep -E "FAIL|passed|failed" $o/nvshmem_gpu_1_2x2.log | tail -4
python3 - $o/layer_bench.json <<'PY'
import json, sys
doc = json.load(open("results/model_inputs/layer_bench_h200x1.json"))
redo = ("experts.bf16.balanced", "experts.bf16.node_limited", "experts.moe_comm_fp8")
doc["parts"] = [p for p in doc["parts"] if not (p["case"] == "flagship" and p["name"].startswith(redo))]
json.dump(doc, open(sys.argv[1], "w"), indent=1)
PY
timeout 80 python3 experiments/layer_bench.py run --resume --out $o/layer_bench.json --cases flagship \
  --parts experts.bf16.balanced experts.bf16.node_limited experts.moe_comm_fp8 --budget-s 70 --iters 64 --warmup 32 > $o/layer_bench.log 2>&1
stamp "layer bench exit $?"
python3 experiments/layer_bench.py report $o/layer_bench.json > $o/layer_bench.md 2>&1
grep -E "FP8 experts \(FP8 wgrad" $o/layer_bench.md
run() {  # name, then train overrides
  local name=$1; shift
  timeout 85 python3 -m moe_comm train recipes/deepseek_v3_671b_h200x1.toml --training.steps 100 --metrics.log_freq 1 \
    --metrics.no-enable-wandb --job.dump_folder $o/runs/$name "$@" > $o/train_$name.log 2>&1
  stamp "$name exit $?"; grep -E "done|FAILED|Error" $o/train_$name.log | cut -c1-200 | tail -2
}
run nccl_bf16 --moe_comm.backend nccl
run nvshmem_bf16
run nvshmem_fp8 --moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
