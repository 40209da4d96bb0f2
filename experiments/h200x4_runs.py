"""Issue 27's runs on four H200s (kind nvidia-h200-x4), and the plan's prediction of each, written
before any of them runs.

    python experiments/h200x4_runs.py predict --out results/h200x4/predictions.json   # CPU, now
    python experiments/h200x4_runs.py commands OUT                                     # what runs there

The set (recipes/deepseek_v3_671b_layers_h200x4.toml, 671B-shaped layers, 8 experts per rank at
EP 4, the same seed and real text for every run):
- "ep4": EP 4 over FSDP 4, backends nccl, nvshmem, nvshmem with FP8 dispatch and deepep: loss
  curves side by side, tok/s, MFU, a step profile;
- "pp2_*": PP 2 x EP 2 (FSDP 2), 1F1B (2 stages of 4 layers) and Interleaved1F1B (4 stages of 2,
  2 per rank), with 2 and 4 microbatches of 1 x 4096, each with overlap none and chunked, on
  nvshmem: step time against the plan's, the bubble and the exposed MoE communication from the
  profile.
Each group is one experiments/fp8_dispatch_training.py invocation (its `--runs` entries differ
in backend, dispatch dtype and overlap; the layout's overrides follow `--`), so the comparison,
curves and raw metrics land in OUT/<group>.json, OUT/<group>/ and OUT/runs/<group>/ as for the
one-GPU runs. `commands` prints them for experiments/run_h200x4.sh.
"""

import argparse
import datetime
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RECIPE = "recipes/deepseek_v3_671b_layers_h200x4.toml"
STEPS = 60  # per run: 5 warm-up steps, a profiled step at 50, medians over the rest
PROFILE = ["--profiling.enable_profiling", "--profiling.profile_freq", "50"]


@dataclass(frozen=True)
class Group:
    """One fp8_dispatch_training invocation: its runs (BACKEND:DTYPE[:OVERLAP]) on one layout."""

    name: str
    runs: tuple[str, ...]
    layout: tuple[str, ...] = ()  # TorchTitan overrides on the recipe

    def command(self, out: str, steps: int = STEPS) -> list[str]:
        return ["python", "experiments/fp8_dispatch_training.py", "--recipe", RECIPE, "--runs", *self.runs,
                "--steps", str(steps), "--last", "10", "--out", out, "--name", self.name, "--no-wandb",
                "--", *self.layout, *PROFILE]


def _pp2(schedule: str, layers_per_stage: int, microbatches: int) -> Group:
    return Group(f"pp2_{schedule.lower()}_m{microbatches}", ("nvshmem:bf16:none", "nvshmem:bf16:chunked"), (
        "--parallelism.pipeline_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
        "--parallelism.pipeline_parallel_schedule", schedule,
        "--parallelism.pipeline_parallel_layers_per_stage", str(layers_per_stage),
        "--parallelism.pipeline_parallel_microbatch_size", "1", "--training.local_batch_size", str(microbatches)))


GROUPS = [
    Group("ep4", ("nvshmem:bf16:none", "nvshmem:fp8:none", "nccl:bf16:none", "deepep:bf16:none",
                  "nvshmem:bf16:chunked")),
    _pp2("1F1B", 4, 2), _pp2("1F1B", 4, 4), _pp2("Interleaved1F1B", 2, 2), _pp2("Interleaved1F1B", 2, 4),
]


def _shape_overrides(group: Group, entry: str) -> list[str]:
    """The run's overrides but its backend: the layout, the dispatch dtype and the overlap."""
    _, dtype, *rest = entry.split(":")
    return [*group.layout, "--moe_comm.dispatch_dtype", dtype] + (["--moe_comm.overlap", rest[0]] if rest else [])


def predict(out: Path) -> dict:
    """The step model's figures for every run of GROUPS, as `check` and `plan` compute them."""
    from moe_comm import recipe
    from moe_comm.predict import calibration, scale_model

    cal = calibration.calibrate()
    cluster = scale_model.cluster_for("H200", 1, 4, cal)
    rows = []
    for g in GROUPS:
        for entry in g.runs:
            # the workload does not depend on the backend; loading with deepep here would ask for
            # DeepEP on this machine, so the recipe is read with its own backend and the model
            # prices the run's
            shape = _shape_overrides(g, entry)
            overrides = shape + ["--moe_comm.backend", entry.split(":")[0]]
            r = recipe.load(RECIPE, shape, device="cuda", check_paths=False)
            w = scale_model.workload_from_recipe(r)
            p = scale_model.predict(entry.split(":")[0], w, cluster, cal, "fp8" if ":fp8" in entry else "bf16")
            rows.append({"group": g.name, "run": entry, "overrides": overrides,
                         "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu, "step_ms": p.step_ms, "mfu": p.mfu,
                         "bubble_ms": p.terms_ms["pp bubble"], "moe_comm_ms": p.moe_comm_ms,
                         "moe_comm_exposed_ms": p.terms_ms["moe comm"],
                         "moe_comm_hidden_ms": p.overlapped_ms["moe comm"],
                         "chunked_weight_work_ms": p.terms_ms["chunked weight work"],
                         "check_command": "python -m moe_comm check " + RECIPE + " -- " + shlex.join(overrides)})
    doc = {"made_by": "python experiments/h200x4_runs.py predict --out " + str(out),
           "date": datetime.date.today().isoformat(), "machine": "CPU (the step model; nothing ran on a GPU)",
           "what": "PREDICTIONS of the step model (moe_comm/predict) for issue 27's runs on 1 x 4 H200, written "
                   "before they run; the measured figures join results/model_inputs/scale_model_validation.json",
           "recipe": RECIPE, "steps": STEPS, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)
    pr = sub.add_parser("predict", help="write the plan's prediction of every run")
    pr.add_argument("--out", type=Path, default=REPO / "results" / "h200x4" / "predictions.json")
    c = sub.add_parser("commands", help="print the runs' commands, one group per line")
    c.add_argument("out", help="where the runs write (the device's output folder)")
    c.add_argument("--steps", type=int, default=STEPS)
    args = p.parse_args(argv)
    if args.verb == "predict":
        doc = predict(args.out)
        for r in doc["rows"]:
            print(f"{r['group']:<26} {r['run']:<22} {r['tokens_per_s_per_gpu']:>8,.0f} tok/s/GPU  step "
                  f"{r['step_ms']:7.1f} ms  bubble {r['bubble_ms']:6.1f}  MoE comm exposed {r['moe_comm_exposed_ms']:5.1f}"
                  f" of {r['moe_comm_ms']:5.1f} ms")
        return 0
    for g in GROUPS:
        print(shlex.join(g.command(args.out, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
