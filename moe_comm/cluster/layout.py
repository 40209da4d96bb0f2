"""Read a recipe's [cluster] section and check it against the recipe's parallel layout.

Why here and not only in TorchTitan: TorchTitan asserts the layout after every node has
started and rendezvoused, which on a 32-node job means a queue wait and a cryptic
AssertionError per rank. Checking before sbatch turns that into one clear message.
"""

from __future__ import annotations

import dataclasses
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
import typing
from pathlib import Path

from moe_comm.config import Cluster

# TorchTitan 0.2.2 defaults for [parallelism] (torchtitan/config/job_config.py).
_DEGREE_DEFAULTS = {
    "data_parallel_replicate_degree": 1,
    "data_parallel_shard_degree": -1,
    "context_parallel_degree": 1,
    "tensor_parallel_degree": 1,
    "pipeline_parallel_degree": 1,
    "expert_parallel_degree": 1,
    "expert_tensor_parallel_degree": 1,
}
# The degrees whose product is the world size; data_parallel_shard_degree = -1 takes the rest.
_WORLD_DEGREES = (
    "data_parallel_replicate_degree",
    "data_parallel_shard_degree",
    "context_parallel_degree",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
)


class RecipeError(ValueError):
    """A recipe or command-line value that cannot be submitted; the message names the fix."""


def load_recipe(path: str | Path) -> dict:
    """The recipe as a plain dict. Kept tiny so it can be swapped for moe_comm.recipe's loader."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe {path} does not exist: pass the path of a recipes/*.toml file")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"recipe {path} is not valid TOML: {e}") from e


def _coerce(name: str, typ, value):
    """Convert a TOML or command-line value to the Cluster field's type, or say what is wrong."""
    origin = typing.get_origin(typ)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
    elif typ is str:
        if isinstance(value, str):
            return value
    elif origin is list:
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        if isinstance(value, str):
            return [v for v in value.split(",") if v]
    kind = {bool: "true or false", int: "a whole number", str: "a string"}.get(typ, "a list of strings")
    raise RecipeError(f"[cluster] {name} = {value!r}: it must be {kind}; fix it in the recipe or the override")


def cluster_from_recipe(recipe: dict, overrides: dict[str, object] | None = None) -> Cluster:
    """The recipe's [cluster] section with command-line overrides applied, type-checked."""
    section = dict(recipe.get("cluster", {}))
    section.update(overrides or {})
    hints = typing.get_type_hints(Cluster)
    known = {f.name for f in dataclasses.fields(Cluster)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise RecipeError(
            f"[cluster] has unknown field(s) {unknown}; known fields: {sorted(known)} "
            "(see moe_comm/config.py: Cluster)"
        )
    values = {k: _coerce(k, hints[k], v) for k, v in section.items()}
    cluster = Cluster(**values)
    if cluster.nodes < 1:
        raise RecipeError(f"[cluster] nodes = {cluster.nodes}: set it to 1 or more")
    if cluster.gpus_per_node < 1:
        raise RecipeError(f"[cluster] gpus_per_node = {cluster.gpus_per_node}: set it to 1 or more (processes per node)")
    if cluster.venv and cluster.container_image:
        raise RecipeError("[cluster] sets both venv and container_image: keep one (the image brings its own Python)")
    return cluster


def degrees(recipe: dict) -> dict[str, int]:
    """The recipe's parallel degrees, TorchTitan's defaults filled in."""
    section = recipe.get("parallelism", {})
    out = {}
    for name, default in _DEGREE_DEFAULTS.items():
        value = section.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or (value < 1 and not (name == "data_parallel_shard_degree" and value == -1)):
            raise RecipeError(f"[parallelism] {name} = {value!r}: use an integer >= 1 (-1 only for data_parallel_shard_degree)")
        out[name] = value
    return out


def check_world_size(recipe: dict, cluster: Cluster) -> int:
    """World size = nodes * gpus_per_node; raise unless the recipe's layout fits it exactly."""
    d = degrees(recipe)
    world = cluster.nodes * cluster.gpus_per_node
    have = f"[cluster] nodes = {cluster.nodes} x gpus_per_node = {cluster.gpus_per_node} = {world} processes"
    fixed = {k: v for k, v in d.items() if k in _WORLD_DEGREES and v != -1}
    fixed_product = 1
    for v in fixed.values():
        fixed_product *= v
    terms = " x ".join(f"{k} = {v}" for k, v in fixed.items() if v != 1) or "1"
    if d["data_parallel_shard_degree"] == -1:
        if world % fixed_product:
            need = -(-world // fixed_product) * fixed_product
            raise RecipeError(
                f"{have}, but the recipe's [parallelism] needs a multiple of {fixed_product} ({terms}; "
                f"data_parallel_shard_degree = -1 takes the rest). Fix: choose nodes so that "
                f"nodes x gpus_per_node is a multiple of {fixed_product} (e.g. {need} processes), "
                "with --nodes N or [cluster] nodes."
            )
        dp_shard = world // fixed_product
    else:
        if world != fixed_product:
            hint = (
                f"set [cluster] nodes = {fixed_product // cluster.gpus_per_node} (or --nodes {fixed_product // cluster.gpus_per_node})"
                if fixed_product % cluster.gpus_per_node == 0
                else "change [cluster] gpus_per_node or the degrees"
            )
            raise RecipeError(
                f"{have}, but the recipe's [parallelism] degrees multiply to {fixed_product} ({terms}). "
                f"Fix: {hint}, or set data_parallel_shard_degree = -1 to fill the nodes."
            )
        dp_shard = d["data_parallel_shard_degree"]
    ep, etp = d["expert_parallel_degree"], d["expert_tensor_parallel_degree"]
    ep_span = dp_shard * d["context_parallel_degree"] * d["tensor_parallel_degree"]
    if ep_span % (ep * etp):
        raise RecipeError(
            f"{have} gives data_parallel_shard_degree = {dp_shard}, and expert_parallel_degree = {ep} "
            f"x expert_tensor_parallel_degree = {etp} must divide data_parallel_shard x context_parallel "
            f"x tensor_parallel = {ep_span}. Fix: change --nodes/[cluster] nodes or [parallelism] expert_parallel_degree."
        )
    return world
