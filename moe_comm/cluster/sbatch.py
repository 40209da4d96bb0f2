"""Render slurm/train.sbatch for one recipe: fill its @PLACEHOLDERS@, nothing else.

The template holds all the shell logic (a user can read it as a plain job script); this module
only decides values: the #SBATCH directives from the recipe's [cluster] section, paths made
absolute (the job runs from Slurm's spool copy, not from here), and every value shell-quoted.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from moe_comm.config import Cluster
from moe_comm.errors import RecipeError
from moe_comm.recipe import env_file_path

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "slurm" / "train.sbatch"
LOG_DIR = REPO / "slurm" / "logs"
"""Slurm opens --output before the script runs and fails the job if the folder is missing, so
logs go to a folder that exists in every checkout (tracked, its contents ignored)."""
_PLACEHOLDER = re.compile(r"@[A-Z_]+@")


@dataclass
class JobSpec:
    """Everything the template needs, resolved: what `submit` would run."""

    recipe: Path
    cluster: Cluster
    job_name: str
    """[cluster] job_name, or the run's name from its identity (moe_comm.metrics.naming)."""
    backend: str  # [moe_comm] backend, overrides applied
    dump_folder: str = "./outputs"
    """The recipe's [job] dump_folder (or --job.dump_folder): the base. The job dumps into
    {dump_folder}/{job_name}, so two runs of one recipe never share checkpoints or metrics while
    a requeue (or a resubmit of the same run) finds its own."""
    overrides: list[str] = field(default_factory=list)
    """Overrides passed through to `moe_comm train` (canonical, as moe_comm.recipe parsed them)."""
    submit_command: str = ""

    @property
    def dump_dir(self) -> Path:
        base = Path(self.dump_folder)
        base = base if base.is_absolute() else REPO / base
        return base / self.job_name

    @property
    def log_file(self) -> Path:
        return LOG_DIR / f"{self.job_name}-%j.out"


def _venv(cluster: Cluster) -> str:
    """The venv the job activates: the recipe's, else the one running submit, else none."""
    if cluster.container_image:
        return ""
    if cluster.venv:
        return cluster.venv
    if sys.prefix != sys.base_prefix:
        return sys.prefix
    raise RecipeError(
        "[cluster] venv is empty and submit is not running inside a venv: set [cluster] venv = "
        "\"/path/to/venv/on/the/jail\" or [cluster] container_image, or run submit from the venv"
    )


def directives(spec: JobSpec) -> list[str]:
    c = spec.cluster
    lines = [
        f"--job-name={spec.job_name}",
        f"--nodes={c.nodes}",
        "--ntasks-per-node=1",
        "--exclusive",
        f"--time={c.time}",
        f"--output={spec.log_file}",
        "--open-mode=append",
    ]
    if c.request_gpus:
        lines.insert(3, f"--gpus-per-node={c.gpus_per_node}")
    if c.partition:
        lines.append(f"--partition={c.partition}")
    if c.account:
        lines.append(f"--account={c.account}")
    if c.requeue:
        lines.append("--requeue")
    lines += c.sbatch_args  # checked by moe_comm.recipe
    return [f"#SBATCH {line}" for line in lines]


def train_args(spec: JobSpec) -> list[str]:
    """Overrides for `moe_comm train`: the job's dump folder, checkpointing for requeue, the user's."""
    args = ["--job.dump_folder", str(spec.dump_dir)]
    if spec.cluster.requeue:
        args.append("--checkpoint.enable")
    return args + list(spec.overrides)


def container_args(spec: JobSpec) -> list[str]:
    c = spec.cluster
    if not c.container_image:
        return []
    mounts = c.container_mounts or f"{REPO}:{REPO}"
    return [f"--container-image={c.container_image}", f"--container-mounts={mounts}", f"--container-workdir={REPO}"]


def render(spec: JobSpec) -> str:
    """The job script as text; raises RecipeError naming the field to fix."""
    q = shlex.quote
    values = {
        "@SBATCH_DIRECTIVES@": "\n".join(directives(spec)),
        "@SUBMIT_COMMAND@": spec.submit_command or f"python -m moe_comm submit {q(str(spec.recipe))}",
        "@LOG_FILE_PATTERN@": str(spec.log_file),
        "@REPO@": q(str(REPO)),
        "@RECIPE@": q(str(spec.recipe.resolve())),
        "@DUMP_DIR@": q(str(spec.dump_dir)),
        "@ENV_FILE@": q(str(env_file_path(spec.cluster))),
        "@VENV@": q(_venv(spec.cluster)),
        "@PROCS_PER_NODE@": str(spec.cluster.gpus_per_node),
        "@TRAIN_ARGS@": " ".join(q(a) for a in train_args(spec)),
        "@SRUN_CONTAINER_ARGS@": " ".join(q(a) for a in container_args(spec)),
        "@BACKEND@": q(spec.backend),
    }
    text = TEMPLATE.read_text()
    for key, value in values.items():
        text = text.replace(key, value)
    left = _PLACEHOLDER.findall(text)
    if left:
        raise AssertionError(f"slurm/train.sbatch has placeholders render() does not fill: {left}")
    return text
