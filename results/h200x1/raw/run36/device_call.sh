#!/usr/bin/env bash
# Device call 3 of the thirteenth session (2026-12-03): the weight gradients' operands in one pass
# (dy's and [h | dh1 | dh3]'s (expert, channel) amax taken by the kernels that write them; x's
# codes transposed as they are, its row scales folded into dh13's bf16 copy), and the folded
# weight scales kept in shared memory per expert. Build; the FP8 kernels' GPU tests; the layer
# bench's experts parts; the one-GPU recipe with FP8 experts + FP8 dispatch profiled at step 15.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o/profile
start=$(date +%s); stamp() { echo "[s13call3 $(( $(date +%s) - start )) s] $*"; }
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
timeout 150 python3 -m moe_comm train recipes/deepseek_v3_671b_h200x1.toml --training.steps 20 --metrics.log_freq 1 \
  --metrics.no-enable-wandb --job.dump_folder $o/profile/nvshmem_fp8 --profiling.enable_profiling --profiling.profile_freq 15 \
  --moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8 > $o/train_profile_fp8.log 2>&1
stamp "profiled fp8 exit $?"; grep -E "done|Error" $o/train_profile_fp8.log | tail -2 | cut -c1-200
python3 experiments/profile_summary.py $o/profile/nvshmem_fp8/profile_trace/iteration_15/rank0_trace.json $o/profile_fp8.json > /dev/null 2>&1
python3 - $o/profile_fp8.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("span", round(d["span_ms"], 1), "idle", round(d["gpu_idle_share"], 4), d["kernel_time_share"])
for k, v in d["top_kernels_ms"].items():
    if "moe_comm" in k: print(f"{v:8.2f}  {k[:90]}")
PY
rm -rf $o/profile/*/profile_trace $o/profile/*/checkpoint; tar czf $OUT/s13call3.tgz -C $o . ; stamp packed
