#!/usr/bin/env bash
# What every device call on the lent one-GPU machine starts with, sourced by a call's committed
# script (results/h200x1/raw/runN/device_call.sh):  source experiments/device_prelude.sh NAME
# - NVLink multicast off (the lent machines' rule; it can take a shared host down);
# - the wheels the image lacks, carried in .whl (TorchTitan 0.2.2 and its dependencies), into
#   /tmp/site, on PYTHONPATH before the repository;
# - csrc/ built for SM 9.0 into /tmp/b (MOE_COMM_LIBRARY points there), its log in $o/build.log;
# - $o (/tmp/o, empty) for what the call writes, `stamp MSG` (seconds since the start, named
#   NAME), and `pack` (a tarball of $o into $OUT/NAME.tgz, which the device tool brings back;
#   large traces and checkpoints left out); `train NAME [overrides...]`, `bench_again OUT PART...` and
#   `fp8_experts_bench OUT` (below).
# Earlier calls' scripts (runs 46-54) carry these lines themselves, as they ran.
name=${1:?usage: source experiments/device_prelude.sh NAME}
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export MOE_COMM_INIT_TIMEOUT=120
o=/tmp/o; rm -rf $o; mkdir -p $o
start=$(date +%s)
stamp() { echo "[$name $(( $(date +%s) - start )) s] $*"; }
pack() {
  find $o -name 'trace*.json.gz' -delete; find $o -type d -name checkpoint -prune -exec rm -rf {} +
  tar czf "$OUT/$name.tgz" -C $o . ; stamp packed
}
export PYTHONPATH=/tmp/site:$PWD
MAX_JOBS=16 python3 -m moe_comm build --arch 90 --out /tmp/b > $o/build.log 2>&1; stamp "build exit $?"
export MOE_COMM_LIBRARY=/tmp/b/moe_comm_cuda.so
# `train NAME [overrides...]`: the one-GPU recipe for TRAIN_STEPS (100) steps into $o/runs/NAME, its
# log $o/train_NAME.log; TRAIN_TREE and TRAIN_LIBRARY run another tree's copy and build (a
# before/after pair in one call; default this tree and /tmp/b). Runs 44-58 wrote this loop inline.
train() {
  local name=$1; shift
  local tree=${TRAIN_TREE:-$PWD} lib=${TRAIN_LIBRARY:-$MOE_COMM_LIBRARY}
  (cd "$tree" && PYTHONPATH=/tmp/site:$tree MOE_COMM_LIBRARY=$lib timeout "${TRAIN_TIMEOUT:-120}" python3 -m moe_comm \
    train recipes/deepseek_v3_671b_h200x1.toml --training.steps "${TRAIN_STEPS:-100}" --metrics.log_freq 1 \
    --metrics.no-enable-wandb --job.dump_folder "$o/runs/$name" "$@" > "$o/train_$name.log" 2>&1)
  stamp "$name exit $?"; grep -E "done|FAILED|Error" "$o/train_$name.log" | cut -c1-200 | tail -2
}
# `bench_again OUT PART...`: the layer bench's flagship parts named (name prefixes) measured again
# into OUT: a copy of OUT where it exists (an earlier bench_again of this call), else of
# results/model_inputs/layer_bench_h200x1.json, less those parts (--resume keeps the rest); its log
# appended beside OUT (.log) and its report rewritten (.md).
bench_again() {
  local out=$1; shift
  local from=results/model_inputs/layer_bench_h200x1.json
  [ -f "$out" ] && from=$out
  python3 - "$from" "$out" "$@" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
redo = tuple(sys.argv[3:])
doc["parts"] = [p for p in doc["parts"] if not (p["case"] == "flagship" and p["name"].startswith(redo))]
json.dump(doc, open(sys.argv[2], "w"), indent=1)
PY
  timeout 200 python3 experiments/layer_bench.py run --resume --out "$out" --cases flagship \
    --parts "$@" --budget-s 180 --iters 64 --warmup 32 >> "${out%.json}.log" 2>&1
  stamp "layer bench $* exit $?"
  python3 experiments/layer_bench.py report "$out" > "${out%.json}.md" 2>&1
}
# `fp8_experts_bench OUT`: the layer bench's bf16 and FP8 experts parts at the flagship rank's rows
# again (bench_again), the FP8 parts' lines and step breakdown printed. Runs 29-39 wrote these
# steps inline.
fp8_experts_bench() {
  local out=$1
  bench_again "$out" experts.bf16.balanced experts.bf16.node_limited experts.moe_comm_fp8
  grep -E "FP8 experts \(FP8 wgrad" "${out%.json}.md"
  python3 - "$out" <<'PY'
import json, sys
for p in json.load(open(sys.argv[1]))["parts"]:
    if p["case"] == "flagship" and p["name"] in ("experts.moe_comm_fp8.balanced", "experts.moe_comm_fp8.node_limited"):
        print(p["name"], {k: round(v, 3) for k, v in p["breakdown"]["steps_ms"].items()})
PY
}
