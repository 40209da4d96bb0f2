"""Load a recipe (a TorchTitan TOML job config plus our [moe_comm] and [cluster] sections) and
validate it before any process starts.

Every problem is a `RecipeError` that names the field and the fix: unknown sections or keys
(checked against TorchTitan's JobConfig merged with moe_comm.config.JobConfig, the same merge
TorchTitan does), layouts that cannot work (the degrees not multiplying to the world size, EP
not dividing the experts or the ranks it borrows), missing tokenizer/dataset files, and bad
backend options.
"""

import difflib
import os
import sys
from dataclasses import dataclass, fields, is_dataclass

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from moe_comm.config import BACKENDS
from moe_comm.estimate import Layout

OUR_CONFIG_MODULE = "moe_comm.config"
OUR_IMPORT_MODULE = "moe_comm.titan"
OUR_MODEL_NAME = "deepseek_v3_moe_comm"
MODEL_NAMES = (OUR_MODEL_NAME, "deepseek_v3_titan", "deepseek_v3")
CONVERTERS = (
    "quantize.linear.float8",
    "quantize.grouped_mm.float8",
    "quantize.linear.mx",
    "quantize.grouped_mm.mx",
)


class RecipeError(ValueError):
    """A recipe problem, with the field and the fix in the message."""


@dataclass
class Recipe:
    path: str
    toml: dict  # the file as written
    config: object  # TorchTitan's JobConfig (merged with ours), overrides applied
    layout: Layout
    device: str  # "cuda" or "cpu"


def merged_job_config_cls():
    """TorchTitan's JobConfig with our sections merged in, as TorchTitan's ConfigManager does."""
    from torchtitan.config import ConfigManager, JobConfig

    from moe_comm import config as ours

    return ConfigManager._merge_configs(JobConfig, ours.JobConfig)


_SCALARS = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
}


def _check_keys(cls, data: dict, where: str) -> None:
    valid = {f.name: f for f in fields(cls)}
    for key, value in data.items():
        name = f"[{where}] {key}" if where else f"[{key}]"
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            section = f"[{where}]" if where else "a top-level section"
            raise RecipeError(
                f"{name} is not a field of {section}; {hint}valid: {', '.join(sorted(valid))}"
            )
        f_type = valid[key].type
        if is_dataclass(f_type):
            if not isinstance(value, dict):
                raise RecipeError(f"{name} must be a table ([{where + '.' if where else ''}{key}])")
            _check_keys(f_type, value, f"{where}.{key}" if where else key)
        elif isinstance(value, dict):
            raise RecipeError(f"{name} is a value, not a table: write `{key} = ...` under [{where}]")
        elif f_type in _SCALARS and not _SCALARS[f_type](value):
            raise RecipeError(f"{name} = {value!r} must be of type {f_type.__name__}")


def _parse_job_config(path: str, overrides: list[str]):
    from torchtitan.config import ConfigManager

    try:
        return ConfigManager().parse_args(["--job.config_file", path, *overrides])
    except SystemExit as e:  # tyro exits on a bad CLI override
        raise RecipeError(
            f"bad override in {' '.join(overrides)!r}: use --section.key value with a field of "
            "the recipe's sections (python -m torchtitan.train --help lists them)"
        ) from e
    except ValueError as e:
        raise RecipeError(str(e)) from e


def _flavor_args(config):
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    from moe_comm.titan import flavors

    flavors.register()
    if config.model.flavor not in deepseekv3_args:
        raise RecipeError(
            f"[model] flavor = {config.model.flavor!r} is not a DeepSeek-V3 flavor; "
            f"choose one of {sorted(deepseekv3_args)}"
        )
    return deepseekv3_args[config.model.flavor]


def resolve_layout(config, nnodes: int | None, nproc_per_node: int | None, device: str) -> Layout:
    """The process count and parallel degrees, checked the way TorchTitan's ParallelDims will."""
    p = config.parallelism
    nodes = nnodes if nnodes is not None else config.cluster.nodes
    per_node = nproc_per_node if nproc_per_node is not None else config.cluster.gpus_per_node
    if nodes < 1:
        raise RecipeError(f"[cluster] nodes = {nodes} must be >= 1")
    if per_node < 1:
        raise RecipeError(f"[cluster] gpus_per_node = {per_node} must be >= 1")
    world = nodes * per_node
    for name in (
        "data_parallel_replicate_degree",
        "context_parallel_degree",
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "expert_parallel_degree",
        "expert_tensor_parallel_degree",
    ):
        if getattr(p, name) < 1:
            raise RecipeError(f"[parallelism] {name} = {getattr(p, name)} must be >= 1")
    dp_rep, cp, tp, pp = (
        p.data_parallel_replicate_degree,
        p.context_parallel_degree,
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
    )
    dp_shard = p.data_parallel_shard_degree
    others = dp_rep * cp * tp * pp
    if dp_shard == -1:
        if world % others != 0:
            raise RecipeError(
                f"world size {world} ({nodes} node(s) x {per_node} per node, [cluster]) is not "
                f"divisible by dp_replicate x cp x tp x pp = {others}; change [parallelism] or [cluster]"
            )
        dp_shard = world // others
    elif dp_shard < 1:
        raise RecipeError(f"[parallelism] data_parallel_shard_degree = {dp_shard} must be -1 or >= 1")
    if dp_rep * dp_shard * cp * tp * pp != world:
        raise RecipeError(
            f"layout dp_replicate {dp_rep} x dp_shard {dp_shard} x cp {cp} x tp {tp} x pp {pp} = "
            f"{dp_rep * dp_shard * cp * tp * pp} processes, but the world size is {world} "
            f"([cluster] nodes {nodes} x gpus_per_node {per_node}); make them agree, e.g. "
            "data_parallel_shard_degree = -1"
        )
    ep, etp = p.expert_parallel_degree, p.expert_tensor_parallel_degree
    if ep > 1 and etp not in (1, tp):
        raise RecipeError(
            f"[parallelism] expert_tensor_parallel_degree = {etp} must be 1 or equal to "
            f"tensor_parallel_degree ({tp}) when expert_parallel_degree > 1"
        )
    borrowable = dp_shard * cp * tp
    if ep > 1 and borrowable % (ep * etp) != 0:
        raise RecipeError(
            f"[parallelism] expert_parallel_degree = {ep} (x etp {etp}) must divide "
            f"dp_shard x cp x tp = {borrowable}, the ranks EP borrows from"
        )
    return Layout(world, nodes, per_node, dp_rep, dp_shard, cp, tp, pp, ep, etp)


def _check_paths(config) -> None:
    from torchtitan.hf_datasets.text_datasets import DATASETS

    assets = config.model.hf_assets_path
    fetch = f"python -m moe_comm assets {config.job.config_file or 'RECIPE.toml'}"
    if not os.path.isdir(assets):
        raise RecipeError(
            f"[model] hf_assets_path = {assets!r} is not a directory (relative to {os.getcwd()}); "
            f"`{fetch}` fetches the tokenizer there, or run from the repository root or give an "
            "absolute path to the tokenizer folder"
        )
    tokenizer_files = ("tokenizer.json", "vocab.json", "vocab.txt")
    if not any(os.path.isfile(os.path.join(assets, f)) for f in tokenizer_files):
        raise RecipeError(
            f"[model] hf_assets_path = {assets!r} has no tokenizer.json (or vocab.json/vocab.txt); "
            f"`{fetch}` fetches it from the hub, or point it at a Hugging Face tokenizer folder "
            "(for the tiny one: python assets/make_tiny.py)"
        )
    t = config.training
    if t.dataset not in DATASETS:
        raise RecipeError(
            f"[training] dataset = {t.dataset!r} is not a TorchTitan dataset; "
            f"choose one of {sorted(DATASETS)}"
        )
    # a local path (./x, /x) must exist; anything else is a HuggingFace dataset id
    if t.dataset_path and t.dataset_path.startswith((".", "/")) and not os.path.exists(t.dataset_path):
        raise RecipeError(
            f"[training] dataset_path = {t.dataset_path!r} does not exist (relative to "
            f"{os.getcwd()}); `{fetch}` stages it when [assets] dataset_repo names it, or run from "
            "the repository root or give an absolute path"
        )


def _check_backend(config, layout: Layout, device: str) -> None:
    mc = config.moe_comm
    if mc.backend not in BACKENDS:
        raise RecipeError(f"[moe_comm] backend = {mc.backend!r}: choose one of {list(BACKENDS)}")
    if mc.backend != "nccl" and device != "cuda":
        raise RecipeError(
            f"[moe_comm] backend = {mc.backend!r} needs CUDA GPUs; on CPU use backend = \"nccl\""
        )
    if not 1 <= mc.num_sms <= 132:
        raise RecipeError(
            f"[moe_comm] num_sms = {mc.num_sms} must be between 1 and 132 (an H200 has 132 SMs; "
            "20 leaves most for compute)"
        )
    if mc.max_tokens_per_rank < 0:
        raise RecipeError(
            f"[moe_comm] max_tokens_per_rank = {mc.max_tokens_per_rank} must be >= 0 "
            "(0 means local_batch_size x seq_len)"
        )
    tokens = config.training.local_batch_size * config.training.seq_len
    if 0 < mc.max_tokens_per_rank < tokens // (layout.cp * layout.tp):
        raise RecipeError(
            f"[moe_comm] max_tokens_per_rank = {mc.max_tokens_per_rank} is below the "
            f"{tokens // (layout.cp * layout.tp)} tokens a rank routes per step "
            "(local_batch_size x seq_len); raise it or set 0"
        )
    if mc.recv_capacity_factor != 0 and mc.recv_capacity_factor < 1.0:
        raise RecipeError(
            f"[moe_comm] recv_capacity_factor = {mc.recv_capacity_factor} must be 0 (exact worst "
            "case) or >= 1.0 (a multiple of the balanced load)"
        )
    grouped = [c for c in config.model.converters if c.startswith("quantize.grouped_mm")]
    if mc.backend == "deepep" and grouped:
        raise RecipeError(
            f"[moe_comm] backend = \"deepep\" does not pad expert segments, which [model] "
            f"converters {grouped} need; use backend \"nccl\" or \"nvshmem\", or drop them"
        )
    if config.parallelism.expert_parallel_comm_backend != "standard":
        raise RecipeError(
            "[parallelism] expert_parallel_comm_backend must stay \"standard\"; choose the "
            f"backend with [moe_comm] backend (e.g. backend = \"deepep\")"
        )
    if layout.ep > 1 and layout.tp > 1:
        raise RecipeError(
            "[parallelism] tensor_parallel_degree > 1 with expert_parallel_degree > 1 is not "
            "supported by the moe_comm EP hook; use FSDP and PP with EP"
        )


def load(
    path: str,
    overrides: list[str] | None = None,
    *,
    nnodes: int | None = None,
    nproc_per_node: int | None = None,
    device: str | None = None,
    check_paths: bool = True,
) -> Recipe:
    """Parse and validate a recipe; raise RecipeError naming the field and the fix."""
    overrides = list(overrides or [])
    if not os.path.isfile(path):
        raise RecipeError(f"recipe {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path} is not valid TOML: {e}") from e

    job = raw.get("job", {})
    if ("moe_comm" in raw or "cluster" in raw) and job.get("custom_config_module") != OUR_CONFIG_MODULE:
        raise RecipeError(
            f'[job] custom_config_module must be "{OUR_CONFIG_MODULE}" for the [moe_comm] and '
            "[cluster] sections to exist"
        )
    _check_keys(merged_job_config_cls(), raw, "")

    model_name = raw.get("model", {}).get("name", "")
    if model_name not in MODEL_NAMES:
        raise RecipeError(
            f"[model] name = {model_name!r}: use \"{OUR_MODEL_NAME}\" (DeepSeek-V3 through the "
            "[moe_comm] backend)"
        )
    if model_name != "deepseek_v3" and raw.get("experimental", {}).get("custom_import") != OUR_IMPORT_MODULE:
        raise RecipeError(
            f'[experimental] custom_import must be "{OUR_IMPORT_MODULE}": it registers the '
            f"{model_name!r} train spec (and the CPU adaptations)"
        )

    backend = raw.get("moe_comm", {}).get("backend", "nccl")
    if backend not in BACKENDS:  # before tyro, which would only warn about the Literal
        raise RecipeError(f"[moe_comm] backend = {backend!r}: choose one of {list(BACKENDS)}")
    config = _parse_job_config(path, overrides)
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    args = _flavor_args(config)
    layout = resolve_layout(config, nnodes, nproc_per_node, device)

    if layout.ep > 1 and args.moe_args.num_experts % layout.ep != 0:
        raise RecipeError(
            f"[parallelism] expert_parallel_degree = {layout.ep} does not divide the "
            f"{args.moe_args.num_experts} experts of flavor {config.model.flavor!r}; pick a divisor"
        )
    t = config.training
    if t.local_batch_size < 1 or t.seq_len < 1 or t.steps < 1:
        raise RecipeError("[training] local_batch_size, seq_len and steps must be >= 1")
    divisor = layout.tp * (2 * layout.cp if layout.cp > 1 else 1)
    if t.seq_len % divisor != 0:
        raise RecipeError(f"[training] seq_len = {t.seq_len} must be divisible by tp x 2cp = {divisor}")
    if device == "cpu" and getattr(args, "attn_type", "sdpa") != "sdpa":
        raise RecipeError(
            f"[model] flavor = {config.model.flavor!r} uses {args.attn_type} attention, whose "
            "backward does not run on CPU; use flavor = \"debugmodel\" on CPU"
        )
    for name in config.model.converters:
        if name not in CONVERTERS:
            raise RecipeError(f"[model] converters: {name!r} is not one of {list(CONVERTERS)}")
    if device == "cpu" and config.model.converters:
        raise RecipeError(
            f"[model] converters = {config.model.converters}: float8/MXFP8 need H100+/B200 GPUs; "
            "remove them on CPU"
        )
    _check_backend(config, layout, device)
    if check_paths:
        _check_paths(config)
    return Recipe(path=path, toml=raw, config=config, layout=layout, device=device)


def split_cli_overrides(args, add_flags) -> list[str]:
    """A verb's own flags may also come after the recipe, mixed with TorchTitan overrides
    (argparse puts everything after the positional into `args.overrides`): pick ours out into
    `args`, return the rest (and everything after `--`) for TorchTitan."""
    import argparse

    rest = list(args.overrides)
    tail: list[str] = []
    if "--" in rest:
        i = rest.index("--")
        rest, tail = rest[:i], rest[i + 1 :]
    ours = argparse.ArgumentParser(add_help=False)
    add_flags(ours)
    defaults = vars(ours.parse_args([]))
    parsed, unknown = ours.parse_known_args(rest)
    for key, value in vars(parsed).items():
        if value != defaults[key]:
            setattr(args, key, value)
    return unknown + tail


def main_error(e: RecipeError) -> int:
    print(f"recipe error: {e}", file=sys.stderr)
    return 2
