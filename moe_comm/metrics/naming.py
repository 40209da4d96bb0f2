"""Who a run is: its identity, and the names derived from it everywhere it shows up.

A run's identity is the recipe plus everything that changes its results: the backend and the
options that change what it does (its class's IDENTITY_OPTIONS: SM budget, dispatch dtype,
virtual nodes), the overlap, the nodes and ranks, the parallel degrees, the batch, the parameter dtype, the converters. From it:
  - the Slurm job name and dump folder (`submit`: {dump_folder}/{name}), so two experiments
    from one recipe never share checkpoints or metrics, while a requeue finds its own;
  - the W&B group (the setting: everything but the backend, so backends line up side by side)
    and run name (the whole identity), and under Slurm a run id from the job, so a requeued
    job continues the same W&B run;
  - `identity.json` in the dump folder: a run refuses a folder written by another identity.
TorchTitan's WandBLogger reads project, group, name and id from WANDB_* variables; we only fill
the ones the user left unset, so an explicit WANDB_RUN_NAME (e.g. from mfu_sweep.py) wins.
"""

import dataclasses
import hashlib
import json
import netrc
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from moe_comm.config import MoEComm

DEFAULT_PROJECT = "moe-comm"
IDENTITY_FILE = "identity.json"


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
    options.pop("log_expert_counts")
    return options


def run_identity(job_config, nodes: int, procs_per_node: int) -> dict[str, Any]:
    """Everything that makes two runs of a recipe comparable, or not: see the module doc."""
    from moe_comm.backends import backend_class  # here: `dashboard` imports this module without torch

    config = moe_comm_config(job_config)
    p, t = job_config.parallelism, job_config.training
    # the options that change what this backend does (its class says which)
    backend: dict[str, Any] = {"backend": config.backend, **backend_class(config.backend).identity_options(config)}
    if config.overlap != "none":  # absent when off, so runs from before the field keep their identity
        backend["overlap"] = config.overlap
    for field in ("expert_dtype", "combine_grad_dtype"):  # the same: absent at their default, bf16
        if getattr(config, field) != "bf16":
            backend[field] = getattr(config, field)
    world = nodes * procs_per_node
    others = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree
    dp_shard = p.data_parallel_shard_degree if p.data_parallel_shard_degree > 0 else world // max(others, 1)
    return {
        "recipe": recipe_name(job_config),
        "flavor": job_config.model.flavor,
        **backend,
        "nodes": nodes,
        "procs_per_node": procs_per_node,
        "dp_replicate": p.data_parallel_replicate_degree,
        "dp_shard": dp_shard,
        "cp": p.context_parallel_degree,
        "tp": p.tensor_parallel_degree,
        "pp": p.pipeline_parallel_degree,
        "ep": p.expert_parallel_degree,
        "local_batch_size": t.local_batch_size,
        "seq_len": t.seq_len,
        "param_dtype": t.mixed_precision_param,
        "converters": list(job_config.model.converters),
        "activation_checkpoint": job_config.activation_checkpoint.mode,
    }


def _backend_tag(identity: dict[str, Any]) -> str:
    tag = identity["backend"]
    if "num_sms" in identity:
        tag += f"-sm{identity['num_sms']}"
    if identity.get("dispatch_dtype", "bf16") != "bf16":
        tag += f"-{identity['dispatch_dtype']}"
    if identity.get("virtual_node_size"):
        tag += f"-vn{identity['virtual_node_size']}"
    if identity.get("network_sms"):
        tag += f"-net{identity['network_sms']}"
    if identity.get("overlap"):
        tag += f"-{identity['overlap']}"
    if identity.get("expert_dtype"):
        tag += f"-experts{identity['expert_dtype']}"
    if identity.get("combine_grad_dtype"):
        tag += f"-cgrad{identity['combine_grad_dtype']}"
    return tag


def _setting_tag(identity: dict[str, Any]) -> str:
    parts = [f"{identity['nodes']}x{identity['procs_per_node']}", f"ep{identity['ep']}"]
    parts += [f"{k}{identity[k]}" for k in ("pp", "tp", "cp", "dp_replicate") if identity[k] != 1]
    parts.append(f"b{identity['local_batch_size']}x{identity['seq_len']}")
    if identity["param_dtype"] != "bfloat16":
        parts.append({"float32": "fp32"}.get(identity["param_dtype"], identity["param_dtype"]))
    parts += [c.split(".")[1] + "-" + c.split(".")[-1] for c in identity["converters"] if "." in c]
    return "-".join(parts)


def run_group(identity: dict[str, Any]) -> str:
    """The setting the run measures: the same for every backend, so backends are compared in it."""
    return f"{identity['recipe']}-{_setting_tag(identity)}"


def run_name(identity: dict[str, Any]) -> str:
    """The whole identity in one file- and job-name-safe word, e.g.
    "deepseek_v3_671b_b200-nvshmem-sm20-32x8-ep32-pp8-b1x4096"."""
    name = f"{identity['recipe']}-{_backend_tag(identity)}-{_setting_tag(identity)}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


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


def wandb_logged_in() -> bool:
    """Whether wandb will find credentials: WANDB_API_KEY, an identity token file, or the entry
    `wandb login` writes into ~/.netrc (or $NETRC) for the W&B host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        auth = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


def wandb_run_id(name: str, superseded: bool = False) -> str | None:
    """Under Slurm, the W&B run id of this job: the same for every restart of a requeued job,
    different for every other job; a restart that superseded logged steps (moe_comm.metrics.
    history: W&B would drop them) gets its own, "-r{restart}". None outside Slurm (W&B picks a
    fresh id for every start)."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    cluster = re.sub(r"[^A-Za-z0-9_-]", "_", os.environ.get("SLURM_CLUSTER_NAME", "slurm"))[:20]
    segment = f"-r{os.environ.get('SLURM_RESTART_COUNT', '0')}" if superseded else ""
    return f"{cluster}-{job}-{hashlib.sha1(name.encode()).hexdigest()[:8]}{segment}"


def set_wandb_env_defaults(job_config, nodes: int, procs_per_node: int, superseded: bool = False) -> None:
    """Fill WANDB_MODE/PROJECT/RUN_GROUP/RUN_NAME (and RUN_ID/RESUME under Slurm) where unset;
    offline only when wandb would find no credentials. `superseded`: this start moved logged
    steps aside (see wandb_run_id)."""
    if not wandb_logged_in():
        os.environ.setdefault("WANDB_MODE", "offline")
    identity = run_identity(job_config, nodes, procs_per_node)
    name = run_name(identity)
    os.environ.setdefault("WANDB_PROJECT", DEFAULT_PROJECT)
    os.environ.setdefault("WANDB_RUN_GROUP", run_group(identity))
    os.environ.setdefault("WANDB_RUN_NAME", name)
    run_id = wandb_run_id(name, superseded)
    if run_id:
        os.environ.setdefault("WANDB_RUN_ID", run_id)
        os.environ.setdefault("WANDB_RESUME", "allow")


def claim_dump_folder(folder: str, identity: dict[str, Any], write: bool = True) -> None:
    """Write identity.json into the run's dump folder (unless `write` is False: only check), or
    refuse (RecipeError) a folder that holds another run: resuming its checkpoint or appending
    to its metrics would mix two runs."""
    from moe_comm.errors import RecipeError

    path = Path(folder) / IDENTITY_FILE
    if path.is_file():
        try:
            theirs = json.loads(path.read_text())
        except (OSError, ValueError):
            theirs = None
        if theirs == identity:
            return
        if theirs is not None:
            diff = ", ".join(
                f"{k} {theirs.get(k)!r} -> {identity.get(k)!r}"
                for k in dict.fromkeys([*theirs, *identity]) if theirs.get(k) != identity.get(k)
            )
            raise RecipeError(
                f"[job] dump_folder = {folder!r} holds another run ({diff}); resuming its checkpoint "
                "or appending to its metrics would mix the two. Give this run its own folder "
                "(--job.dump_folder DIR; `submit` derives one per run), or remove the folder"
            )
    if not write:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(identity, indent=1) + "\n")
    os.replace(tmp, path)  # atomic: every node of a job may write the same content at once
