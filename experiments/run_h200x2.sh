#!/usr/bin/env bash
# Train the 2xH200 recipes with one backend and keep every log and metrics file.
#
#   experiments/run_h200x2.sh OUT_DIR [BACKEND] [STEPS] [RECIPE ...]
#
#   OUT_DIR   where results go: OUT_DIR/<recipe>__<backend>/{check.txt,train.log,command.txt,
#             exit_code, the TorchTitan dump folder (metrics JSONL, W&B offline run)}, plus
#             OUT_DIR/summary.tsv (one line per run: recipe, backend, exit code, last step line)
#   BACKEND   nccl (default) | nvshmem | deepep
#   STEPS     training steps per run (default 30)
#   EXTRA_OVERRIDES (environment) more TorchTitan overrides for every run, e.g. profiling
#   RECIPE    default: the three 2xH200 recipes (671B-shaped layers bf16, the same in float8
#             rowwise, 16B)
#
# Run from the repository root on the 2xH200 machine (torch 2.11+cu130, no network). The
# lead's set-up puts torchtitan and friends on PYTHONPATH (/tmp/site); this script adds the
# repository itself. A failed run is recorded and the next one starts.
set -uo pipefail

OUT=${1:?usage: experiments/run_h200x2.sh OUT_DIR [BACKEND] [STEPS] [RECIPE ...]}
BACKEND=${2:-nccl}
STEPS=${3:-30}
shift $(( $# < 3 ? $# : 3 ))
RECIPES=("$@")
if [ ${#RECIPES[@]} -eq 0 ]; then
  RECIPES=(
    recipes/deepseek_v3_671b_layers_h200x2.toml
    recipes/deepseek_v3_671b_layers_h200x2_float8.toml
    recipes/deepseek_v3_16b_h200x2.toml
  )
fi

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# Every GPU run keeps NVLink SHARP / multicast off (moe_comm.launch sets them too).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
export WANDB_MODE=${WANDB_MODE:-offline}
PY=${PYTHON:-python3}

WANDB_FLAG=()
if ! "$PY" -c "import wandb" 2>/dev/null; then
  echo "wandb is not importable: W&B logging off for these runs (carry the wandb wheel to turn it on)"
  WANDB_FLAG=(--metrics.no-enable-wandb)
fi

mkdir -p "$OUT"
SUMMARY="$OUT/summary.tsv"
[ -f "$SUMMARY" ] || printf 'recipe\tbackend\texit_code\tlast_step\n' > "$SUMMARY"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.csv" 2>&1 || true
"$PY" -c "import torch, torchtitan; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'torchtitan', torchtitan.__version__)" > "$OUT/versions.txt" 2>&1 || true

for RECIPE in "${RECIPES[@]}"; do
  NAME=$(basename "$RECIPE" .toml)__$BACKEND
  RUN="$OUT/$NAME"
  mkdir -p "$RUN"
  CMD=("$PY" -m moe_comm train "$RECIPE" --
       --moe_comm.backend "$BACKEND" --training.steps "$STEPS" --job.dump_folder "$RUN/dump"
       "${WANDB_FLAG[@]}" ${EXTRA_OVERRIDES:-})
  echo "=== $NAME: ${CMD[*]}"
  printf '%q ' "${CMD[@]}" > "$RUN/command.txt"; echo >> "$RUN/command.txt"
  "$PY" -m moe_comm check "$RECIPE" --moe_comm.backend "$BACKEND" > "$RUN/check.txt" 2>&1
  WANDB_RUN_GROUP=${WANDB_RUN_GROUP:-h200x2} "${CMD[@]}" > "$RUN/train.log" 2>&1
  RC=$?
  echo "$RC" > "$RUN/exit_code"
  LAST=$(grep -a " - INFO - step " "$RUN/train.log" | tail -1 | sed "s/.*- INFO - //")
  printf '%s\t%s\t%s\t%s\n' "$(basename "$RECIPE" .toml)" "$BACKEND" "$RC" "$LAST" >> "$SUMMARY"
  echo "    exit $RC; $LAST"
done
cat "$SUMMARY"
