"""`python -m moe_comm submit RECIPE.toml [--nodes N] [--dry-run] [--cluster.FIELD V] [overrides]`

Validates the recipe for the job it describes (moe_comm.recipe: the [cluster] section, the
layout over its nodes, the backend's limits, the platform environment), renders
slurm/train.sbatch and hands it to sbatch (or prints it with --dry-run). Every override,
`--cluster.FIELD V` included, is parsed by moe_comm.recipe and passed on to `moe_comm train`.

Each run gets its own identity (moe_comm.metrics.naming): the job name is [cluster] job_name or
the run's name (recipe, backend and its options, nodes, batch...), and the job dumps into
{job.dump_folder}/{job name}, so switching `--moe_comm.backend` never resumes another
backend's checkpoint or appends to its metrics, while a requeue or a resubmit of the same run
resumes its own.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from moe_comm import claim, recipe
from moe_comm.cluster.sbatch import LOG_DIR, JobSpec, render
from moe_comm.errors import RecipeError
from moe_comm.metrics import naming


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, help="Slurm nodes (short for --cluster.nodes N)")
    parser.add_argument("--dry-run", action="store_true", help="print the job script instead of submitting it")
    parser.add_argument("--wait", action="store_true", help="sbatch --wait: return when the job ends, with its exit code")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipes/NAME.toml")
    _options(parser)
    parser.add_argument(
        "rest", nargs=argparse.REMAINDER,
        help="--cluster.FIELD VALUE overrides the recipe's [cluster] section; any other "
        "--section.key VALUE is a TorchTitan override passed to `moe_comm train`, e.g. --training.steps 3",
    )


def _without(overrides: list[str], key: str) -> tuple[list[str], bool]:
    """Canonical overrides minus `--key VALUE` (the job sets it itself); whether it was there."""
    out, found, i = [], False, 0
    while i < len(overrides):
        if overrides[i] == key:
            found, i = True, i + 2
        else:
            out.append(overrides[i])
            i += 1
    return out, found


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
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _options(own)
    opts, rest = own.parse_known_args(list(args.rest or []))
    nodes = opts.nodes if opts.nodes is not None else args.nodes
    if nodes is not None:
        rest += ["--cluster.nodes", str(nodes)]
    args.dry_run = args.dry_run or opts.dry_run
    args.wait = args.wait or opts.wait
    # The paths (tokenizer, dataset, dump folder: moe_comm.files, as `check` sees them) stop a
    # real submit; a --dry-run may render anywhere (on a Soperator login node the jail is the
    # workers' filesystem, a laptop has none of it), so it lists them after the script instead.
    r = recipe.load(args.recipe, rest, allow_blockers=args.dry_run)
    args.blockers = r.blockers
    config, cluster = r.config, r.config.cluster
    for note in r.notes:
        print(f"submit: note: {note}", file=sys.stderr)
    for warning in r.warnings:
        print(f"submit: warning: {warning}", file=sys.stderr)
    warning = requeue_warning(config, cluster)
    if warning:
        print(warning, file=sys.stderr)
    identity = naming.run_identity(config, r.layout.nodes, r.layout.procs_per_node)
    # The dump folder is the base: the job owns {base}/{job name}, found again by a requeue.
    overrides, _ = _without(r.overrides, "--job.dump_folder")
    spec = JobSpec(
        recipe=Path(args.recipe),
        cluster=cluster,
        job_name=cluster.job_name or naming.run_name(identity),
        backend=config.moe_comm.backend,  # overrides applied: the env file keys NVSHMEM on it
        dump_folder=config.job.dump_folder,
        overrides=overrides,
        submit_command=shlex.join(["python", "-m", "moe_comm", "submit", args.recipe, *r.overrides]),
    )
    naming.claim_dump_folder(str(spec.dump_dir), identity, write=False)
    holder = claim.holder_of(str(spec.dump_dir))
    if holder is not None:
        after = (f"; to queue this one behind it: --cluster.sbatch_args --dependency=afterany:{holder.slurm_job}"
                 if holder.slurm_job else "")
        print(f"submit: warning: {spec.dump_dir} is in use by {holder.describe()}: this job is refused when it "
              f"starts unless that run has ended{after}", file=sys.stderr)
    return spec


def main(args: argparse.Namespace) -> int:
    try:
        spec = build_spec(args)
        script = render(spec)
    except RecipeError as e:
        print(f"submit: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        sys.stdout.write(script)
        if args.blockers:
            print(f"submit: launch blockers ({len(args.blockers)}): `submit` refuses this job from this machine "
                  "until each is fixed (where the paths are the cluster's, submit from its login node):",
                  file=sys.stderr)
            for blocker in args.blockers:
                print(f"submit:   - {blocker}", file=sys.stderr)
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
