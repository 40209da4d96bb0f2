#!/usr/bin/env bash
# Device call 2 of the ninth session (2026-12-02): the FP8 experts' WeightCache. Build; the FP8
# kernels' GPU tests (the cache's bit-for-bit case among them); the layer bench's experts parts
# (bf16, FP8 per call, FP8 with the weights cached over 32 microbatches); the one-GPU recipe with
# FP8 experts + FP8 dispatch under AC full, with the cache in its own memory pool (A, shipped) and without (B: the same
# tree with parallelize never attaching it), 20 steps each.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; mkdir -p $o/runs /tmp/tb
start=$(date +%s); stamp() { echo "[s9call2 $(( $(date +%s) - start )) s] $*"; }
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=12 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_experts_gpu.py > $o/fp8_experts_gpu.log 2>&1
stamp "fp8 experts gpu exit $?"; tail -3 $o/fp8_experts_gpu.log
python3 - $o/layer_bench.json <<'PY'
import json, sys
doc = json.load(open("results/model_inputs/layer_bench_h200x1.json"))
redo = ("experts.bf16.balanced", "experts.bf16.node_limited", "experts.moe_comm_fp8")
doc["parts"] = [p for p in doc["parts"] if not (p["case"] == "flagship" and p["name"].startswith(redo))]
json.dump(doc, open(sys.argv[1], "w"), indent=1)
PY
timeout 170 python3 experiments/layer_bench.py run --resume --out $o/layer_bench.json --cases flagship \
  --parts experts.bf16.balanced experts.bf16.node_limited experts.moe_comm_fp8 --budget-s 150 --iters 64 --warmup 32 > $o/layer_bench.log 2>&1
stamp "layer bench exit $?"; grep "experts" $o/layer_bench.log | tail -8
python3 experiments/layer_bench.py report $o/layer_bench.json > $o/layer_bench.md 2>&1
grep -A14 "expert_dtype = \"fp8\"\` against bf16" $o/layer_bench.md
tar cf - --exclude=./.whl --exclude=./.git --exclude=./.deepep . | tar xf - -C /tmp/tb
sed -i 's/    if job_config.moe_comm.expert_dtype == "fp8" and fp8_experts.caches_weights(/    if False and fp8_experts.caches_weights(/' /tmp/tb/moe_comm/titan/parallelize.py
grep -n "if False and" /tmp/tb/moe_comm/titan/parallelize.py
for v in A B; do
  root=$PWD; [ $v = B ] && root=/tmp/tb
  (cd $root && PYTHONPATH=/tmp/site:$root timeout 200 python3 -m moe_comm train recipes/deepseek_v3_671b_h200x1.toml \
     --moe_comm.expert_dtype fp8 --moe_comm.dispatch_dtype fp8 --activation_checkpoint.mode full --training.steps 20 \
     --metrics.log_freq 1 --metrics.no-enable-wandb --job.dump_folder $o/runs/fp8_acfull_$v > $o/train_$v.log 2>&1)
  stamp "train $v exit $?"; grep -E "step (1|10|20)/|done" $o/train_$v.log | cut -c1-220
done
rm -rf $o/runs/*/checkpoint; tar czf $OUT/s9call2.tgz -C $o . ; stamp packed
