#!/usr/bin/env bash
# Device call 2 of the fourteenth session (2026-12-03): the FP8 experts' row kernels (quantise_rows,
# gate, gate_backward) in blocks sized to the row (64 threads for inter 2048, as the weights kernel
# since run 35), the walking kernels' grid one wave of resident blocks, the per-expert shared
# arrays laid out vector-split. Build; the FP8 kernels' GPU tests (stop on a failure); the layer
# bench's experts parts; the FP8 parts again with the experts' segments padded to 128 rows
# (fp8_experts.ROW_ALIGN = 128, set in this call's copy of the tree only); the one-GPU recipe with
# FP8 experts + FP8 dispatch profiled at step 15; nccl bf16, nvshmem bf16, nvshmem FP8, 100 steps.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o/profile
start=$(date +%s); stamp() { echo "[s14call2 $(( $(date +%s) - start )) s] $*"; }
pack() { rm -rf $o/runs/*/checkpoint $o/profile/*/checkpoint $o/profile/*/profile_trace; tar czf $OUT/s14call2.tgz -C $o . ; stamp packed; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"; tail -1 $o/build.log
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py -s > $o/fp8_experts_gpu.log 2>&1
rc=$?; stamp "fp8 experts gpu exit $rc"; grep -E "relative L2|passed|failed|Error|assert" $o/fp8_experts_gpu.log | tail -14
if [ $rc -ne 0 ]; then pack; exit 1; fi
python3 - $o/layer_bench.json <<'PY'
import json, sys
doc = json.load(open("results/model_inputs/layer_bench_h200x1.json"))
redo = ("experts.bf16.balanced", "experts.bf16.node_limited", "experts.moe_comm_fp8")
doc["parts"] = [p for p in doc["parts"] if not (p["case"] == "flagship" and p["name"].startswith(redo))]
json.dump(doc, open(sys.argv[1], "w"), indent=1)
PY
bench() {  # out json; the FP8 parts (and bf16's where the json lacks them) at the flagship's rows
  timeout 200 python3 experiments/layer_bench.py run --resume --out $1 --cases flagship \
    --parts experts.bf16.balanced experts.bf16.node_limited experts.moe_comm_fp8 --budget-s 180 --iters 64 --warmup 32 > ${1%.json}.log 2>&1
  stamp "layer bench $1 exit $?"
  python3 experiments/layer_bench.py report $1 > ${1%.json}.md 2>&1
  grep -E "FP8 experts \(FP8 wgrad" ${1%.json}.md
  python3 - $1 <<'PY'
import json, sys
for p in json.load(open(sys.argv[1]))["parts"]:
    if p["case"] == "flagship" and p["name"] in ("experts.moe_comm_fp8.balanced", "experts.moe_comm_fp8.node_limited"):
        print(p["name"], {k: round(v, 3) for k, v in p["breakdown"]["steps_ms"].items()})
PY
}
bench $o/layer_bench.json
python3 - $o/layer_bench.json $o/layer_bench_align128.json <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
doc["parts"] = [p for p in doc["parts"] if not (p["case"] == "flagship" and p["name"].startswith("experts.moe_comm_fp8"))]
json.dump(doc, open(sys.argv[2], "w"), indent=1)
PY
sed -i 's/^ROW_ALIGN = 16$/ROW_ALIGN = 128/' moe_comm/fp8_experts.py; grep -n "^ROW_ALIGN" moe_comm/fp8_experts.py
bench $o/layer_bench_align128.json
git checkout -q moe_comm/fp8_experts.py 2>/dev/null || sed -i 's/^ROW_ALIGN = 128$/ROW_ALIGN = 16/' moe_comm/fp8_experts.py
grep -n "^ROW_ALIGN" moe_comm/fp8_experts.py
fp8="--moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8"
timeout 150 python3 -m moe_comm train recipes/deepseek_v3_671b_h200x1.toml --training.steps 20 --metrics.log_freq 1 \
  --metrics.no-enable-wandb --job.dump_folder $o/profile/nvshmem_fp8 --profiling.enable_profiling --profiling.profile_freq 15 \
  $fp8 > $o/train_profile_fp8.log 2>&1
stamp "profiled fp8 exit $?"
python3 experiments/profile_summary.py $o/profile/nvshmem_fp8/profile_trace/iteration_15/rank0_trace.json $o/profile_fp8.json > /dev/null 2>&1
python3 - $o/profile_fp8.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("span", round(d["span_ms"], 1), "idle", round(d["gpu_idle_share"], 4), d["kernel_time_share"])
for k, v in d["top_kernels_ms"].items():
    if "moe_comm" in k: print(f"{v:8.2f}  {k[:90]}")
PY
rm -rf $o/profile/*/profile_trace
run() {  # name, then train overrides
  local name=$1; shift
  timeout 170 python3 -m moe_comm train recipes/deepseek_v3_671b_h200x1.toml --training.steps 100 --metrics.log_freq 1 \
    --metrics.no-enable-wandb --job.dump_folder $o/runs/$name "$@" > $o/train_$name.log 2>&1
  stamp "$name exit $?"; grep -E "done|FAILED|Error" $o/train_$name.log | cut -c1-200 | tail -2
}
run nccl_bf16 --moe_comm.backend nccl
run nvshmem_bf16
run nvshmem_fp8 $fp8
python3 experiments/one_gpu_table.py $o > $o/table.md 2>&1; cat $o/table.md
pack
