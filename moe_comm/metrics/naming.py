"""How a run is named in W&B and in its JSONL, so that backends line up side by side.

group = the recipe (runs of one recipe are compared), name = the backend and its options
(what differs between them), tags = recipe, backend, EP degree, flavor, GPU count, converters.
TorchTitan's WandBLogger reads project, group and name from WANDB_* variables; we only fill the
ones the user left unset, so an explicit WANDB_RUN_NAME (e.g. from mfu_sweep.py) wins.
"""

import dataclasses
import os
from pathlib import Path
from typing import Any

from moe_comm.config import MoEComm

DEFAULT_PROJECT = "moe-comm"


def moe_comm_config(job_config) -> MoEComm:
    """The [moe_comm] section, or its defaults when the recipe was run without our config module."""
    return getattr(job_config, "moe_comm", None) or MoEComm()


def recipe_name(job_config) -> str:
    config_file = job_config.job.config_file
    if config_file:
        return Path(config_file).stem
    return job_config.job.description.replace(" ", "_")


def backend_options(config: MoEComm) -> dict[str, Any]:
    """The [moe_comm] fields that change what the backend does (everything but its name)."""
    options = dataclasses.asdict(config)
    options.pop("backend")
    options.pop("peak_tflops")
    return options


def run_name(config: MoEComm) -> str:
    """"nccl", or "nvshmem-sm20": the SM budget is the option users vary between runs."""
    if config.backend == "nccl":
        return "nccl"
    return f"{config.backend}-sm{config.num_sms}"


def run_tags(job_config, world_size: int) -> list[str]:
    config = moe_comm_config(job_config)
    tags = [
        recipe_name(job_config),
        config.backend,
        f"ep{job_config.parallelism.expert_parallel_degree}",
        job_config.model.flavor,
        f"{world_size}gpu",
    ]
    tags += [c.split(".")[-1] + "-" + c.split(".")[1] for c in job_config.model.converters if "." in c]
    return tags


def set_wandb_env_defaults(job_config) -> None:
    """Fill WANDB_MODE/PROJECT/RUN_GROUP/RUN_NAME where unset; offline without an API key."""
    if not os.environ.get("WANDB_API_KEY"):
        os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_PROJECT", DEFAULT_PROJECT)
    os.environ.setdefault("WANDB_RUN_GROUP", recipe_name(job_config))
    os.environ.setdefault("WANDB_RUN_NAME", run_name(moe_comm_config(job_config)))
