"""`python -m moe_comm submit RECIPE.toml [--nodes N] [--dry-run] [--cluster.FIELD V] [overrides]`

Checks the recipe's [cluster] section against its parallel layout, renders slurm/train.sbatch
and hands it to sbatch (or prints it with --dry-run). Everything that is not a submit option
is a TorchTitan override (e.g. `--training.steps 3`) passed through to `moe_comm train`.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from moe_comm.cluster.layout import RecipeError, check_world_size, cluster_from_recipe, load_recipe
from moe_comm.cluster.sbatch import LOG_DIR, JobSpec, render


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, help="Slurm nodes (short for --cluster.nodes N)")
    parser.add_argument("--dry-run", action="store_true", help="print the job script instead of submitting it")
    parser.add_argument("--wait", action="store_true", help="sbatch --wait: return when the job ends, with its exit code")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipes/NAME.toml")
    _options(parser)
    parser.add_argument(
        "rest", nargs=argparse.REMAINDER,
        help="--cluster.FIELD VALUE overrides the recipe's [cluster] section; anything else is a "
        "TorchTitan override passed to `moe_comm train`, e.g. --training.steps 3",
    )


def split_rest(rest: list[str]) -> tuple[argparse.Namespace, dict[str, str], list[str]]:
    """Pull submit options and --cluster.* pairs out of the arguments after the recipe."""
    own = argparse.ArgumentParser(add_help=False)
    _options(own)
    opts, others = own.parse_known_args(rest)
    cluster: dict[str, str] = {}
    overrides: list[str] = []
    i = 0
    while i < len(others):
        arg = others[i]
        if arg.startswith("--cluster."):
            key, eq, value = arg[len("--cluster."):].partition("=")
            if not eq:
                if i + 1 >= len(others):
                    raise RecipeError(f"{arg} needs a value, e.g. {arg} 2")
                value = others[i + 1]
                i += 1
            cluster[key] = value
        else:
            overrides.append(arg)
        i += 1
    return opts, cluster, overrides


def pop_override(overrides: list[str], name: str) -> str | None:
    """Remove `--name V` / `--name=V` from overrides and return V (the last one wins)."""
    value = None
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        if arg == name and i + 1 < len(overrides):
            value = overrides[i + 1]
            del overrides[i : i + 2]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
            del overrides[i]
        else:
            i += 1
    return value


def validate_recipe(path: Path, overrides: list[str], cluster, check_paths: bool):
    """The full recipe validation (moe_comm.recipe), for the job's world and device, before sbatch.

    Paths (tokenizer, dataset) are checked only when really submitting: on a Soperator login node
    the jail is the workers' filesystem, while a --dry-run may render anywhere."""
    from moe_comm import recipe as recipe_module

    try:
        return recipe_module.load(
            str(path), list(overrides), nnodes=cluster.nodes, nproc_per_node=cluster.gpus_per_node,
            device="cuda" if cluster.request_gpus else "cpu", check_paths=check_paths,
        ).config
    except recipe_module.RecipeError as e:
        raise RecipeError(str(e)) from e


def requeue_warning(config, cluster) -> str:
    """A requeued job resumes from the last interval checkpoint; none before the end means step 0."""
    interval, steps = config.checkpoint.interval, config.training.steps
    if cluster.requeue and interval >= steps:
        return (
            f"submit: warning: [checkpoint] interval = {interval} >= [training] steps = {steps}, so a "
            "requeued job finds no checkpoint and restarts from step 0; set [checkpoint] interval "
            "(or --checkpoint.interval N) below the steps"
        )
    return ""


def build_spec(args: argparse.Namespace) -> JobSpec:
    opts, cluster_overrides, overrides = split_rest(list(args.rest or []))
    # The dump folder decides where checkpoints and provenance go, so the job owns it: an
    # override on the command line moves the base folder rather than racing the job's own.
    dump_folder_override = pop_override(overrides, "--job.dump_folder")
    nodes = opts.nodes if opts.nodes is not None else args.nodes
    if nodes is not None:
        cluster_overrides["nodes"] = nodes
    args.dry_run = args.dry_run or opts.dry_run
    args.wait = args.wait or opts.wait
    recipe_path = Path(args.recipe)
    recipe = load_recipe(recipe_path)
    cluster = cluster_from_recipe(recipe, cluster_overrides)
    check_world_size(recipe, cluster)
    config = validate_recipe(recipe_path, overrides, cluster, check_paths=not args.dry_run)
    warning = requeue_warning(config, cluster)
    if warning:
        print(warning, file=sys.stderr)
    argv = ["python", "-m", "moe_comm", "submit", args.recipe]
    argv += [f"--cluster.{k}={v}" for k, v in cluster_overrides.items()]
    argv += (["--job.dump_folder", dump_folder_override] if dump_folder_override else []) + overrides
    return JobSpec(
        recipe=recipe_path,
        cluster=cluster,
        backend=config.moe_comm.backend,  # overrides applied: the env file keys NVSHMEM on it
        dump_folder=dump_folder_override or config.job.dump_folder,
        overrides=overrides,
        submit_command=" ".join(shlex.quote(a) for a in argv),
    )


def main(args: argparse.Namespace) -> int:
    try:
        spec = build_spec(args)
        script = render(spec)
    except RecipeError as e:
        print(f"submit: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        sys.stdout.write(script)
        return 0
    if shutil.which("sbatch") is None:
        print("submit: sbatch is not on PATH: run this on a Slurm login node, or use --dry-run", file=sys.stderr)
        return 2
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    cmd = ["sbatch", "--parsable"] + (["--wait"] if args.wait else [])
    proc = subprocess.run(cmd, input=script, text=True, capture_output=True)
    job_id = proc.stdout.strip().split(";")[0]
    if proc.returncode != 0 and not job_id:
        print(f"submit: sbatch failed ({proc.returncode}): {proc.stderr.strip()}", file=sys.stderr)
        return proc.returncode or 1
    print(f"submitted job {job_id}: log {str(spec.log_file).replace('%j', job_id)}, dump folder {spec.dump_dir}")
    if proc.stderr.strip():
        print(proc.stderr.strip(), file=sys.stderr)
    return proc.returncode
