"""Load a recipe (a TorchTitan TOML job config plus our [moe_comm] and [cluster] sections) and
validate it before any process starts.

Every problem is a `RecipeError` that names the field and the fix: unknown sections or keys
(checked against TorchTitan's JobConfig merged with moe_comm.config.JobConfig, the same merge
TorchTitan does), values of the wrong type, bad command-line overrides, layouts that cannot
work (moe_comm.layout's rules: the degrees not multiplying to the world size, EP not dividing
the ranks it borrows), TorchTitan fields it would divide by zero or assert on
(moe_comm.titan_fields), bad [cluster] values, and whatever the chosen backend cannot run (its
class's `check_run`, asked with the moe_comm.layout.RunPlan of what is known before launch).
What the run needs on this machine's disk (the tokenizer, the dataset's records, a writable
dump folder: moe_comm.files) are launch blockers: raised together, or kept for `check` to list
after its plan.

`check`, `submit` and `train` all call `load`; the model build asks the same layout rules and
`check_run` again with what the ranks see.

Overrides (`--section.key value`) are parsed here, once, against the same merged JobConfig:
one error per bad override (the override, the expected type, the nearest valid key). What
goes on to TorchTitan's own parser in the ranks is their canonical spelling (`Recipe.overrides`).
"""

import difflib
import os
import re
import subprocess
import sys
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from moe_comm import files, titan_fields
from moe_comm.config import MoEComm
from moe_comm.errors import LaunchBlockers, RecipeError
from moe_comm.layout import check_layout, flavor_args, Layout, OUR_MODEL_NAME, resolve_layout, run_plan

REPO = Path(__file__).resolve().parents[1]
OUR_CONFIG_MODULE = "moe_comm.config"
OUR_IMPORT_MODULE = "moe_comm.titan"
MODEL_NAMES = (OUR_MODEL_NAME, "deepseek_v3_titan", "deepseek_v3")
CONVERTERS = (
    "quantize.linear.float8",
    "quantize.grouped_mm.float8",
    "quantize.linear.mx",
    "quantize.grouped_mm.mx",
)
_TIME = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$|^\d+$")
_JOB_NAME = re.compile(r"^[A-Za-z0-9_.-]*$")  # it becomes a file and folder name

__all__ = ["Recipe", "RecipeError", "LaunchBlockers", "load", "split_cli_overrides", "main_error"]


@dataclass
class Recipe:
    path: str
    toml: dict  # the file as written
    config: object  # TorchTitan's JobConfig (merged with ours), overrides applied
    layout: Layout
    device: str  # "cuda" or "cpu"
    overrides: list[str] = field(default_factory=list)  # canonical, for TorchTitan in the ranks
    plan: object = None  # the layout.RunPlan the backend was checked with
    notes: list[str] = field(default_factory=list)  # what could not be checked before launch
    warnings: list[str] = field(default_factory=list)  # what runs, but likely not as meant
    blockers: list[str] = field(default_factory=list)  # what stops a launch (load(allow_blockers=True))


def merged_job_config_cls():
    """TorchTitan's JobConfig with our sections merged in, as TorchTitan's ConfigManager does."""
    from torchtitan.config import ConfigManager, JobConfig

    from moe_comm import config as ours

    return ConfigManager._merge_configs(JobConfig, ours.JobConfig)


# ---- values: one set of rules for TOML values and command-line overrides ----------------------

def _type_name(t) -> str:
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or None" if type(None) in args else "")
    if origin is list:
        inner = args[0] if args else str
        if typing.get_origin(inner) is list:
            return "lists of strings (one comma-separated list per value)"
        return "a list of strings (comma-separated on the command line)"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(t, str(t))


def _is_instance(t, value) -> bool:
    """Whether a TOML value fits the field type (what TorchTitan's dataclasses would hold)."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if t is bool:
        return isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t is str:
        return isinstance(value, str)
    if origin is typing.Literal:
        return value in args
    if origin is list:
        inner = args[0] if args else str
        return isinstance(value, list) and all(_is_instance(inner, v) for v in value)
    if args:  # a union
        return any(_is_instance(a, value) for a in args if a is not type(None)) or (
            value is None and type(None) in args
        )
    return True  # a type this module does not model: TorchTitan decides


def _from_cli(t, words: list[str]):
    """Convert the words of one override to the field type; ValueError when they do not fit."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is list and args and typing.get_origin(args[0]) is list:
        return [w.split(",") for w in words]
    (word,) = words
    if args and origin is not typing.Literal and origin is not list:  # a union, None first
        if type(None) in args and word == "None":
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _from_cli(a, words)
            except ValueError:
                pass
        raise ValueError(word)
    if t is int:
        return int(word)
    if t is float:
        return float(word)
    if t is str:
        return word
    if origin is typing.Literal:
        if word in args:
            return word
        raise ValueError(word)
    if origin is list:
        return word.split(",")  # TorchTitan's rule for list[str] (ConfigManager.register_tyro_rules)
    raise ValueError(word)


def _hint(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def _field_types(cls) -> dict:
    """A config dataclass's field types as the checks here read them. [moe_comm] backend is a
    string in moe_comm.config (so a backend registered at run time is one); its choices are the
    registry's names (moe_comm.backends), checked here like any other choice."""
    hints = typing.get_type_hints(cls)
    if cls is MoEComm:
        from moe_comm import backends

        hints["backend"] = typing.Literal[backends.names()]
    return hints


def _check_keys(cls, data: dict, where: str) -> None:
    hints = _field_types(cls)
    valid = {f.name for f in fields(cls)}
    for key, value in data.items():
        name = f"[{where}] {key}" if where else f"[{key}]"
        if key not in valid:
            section = f"[{where}]" if where else "a top-level section"
            raise RecipeError(
                f"{name} is not a field of {section}; {_hint(key, valid)}valid: {', '.join(sorted(valid))}"
            )
        f_type = hints[key]
        if is_dataclass(f_type):
            if not isinstance(value, dict):
                raise RecipeError(f"{name} must be a table ([{where + '.' if where else ''}{key}])")
            _check_keys(f_type, value, f"{where}.{key}" if where else key)
        elif isinstance(value, dict):
            raise RecipeError(f"{name} is a value, not a table: write `{key} = ...` under [{where}]")
        elif not _is_instance(f_type, value):
            hint = _hint(value, typing.get_args(f_type)) if isinstance(value, str) else ""
            raise RecipeError(f"{name} = {value!r} must be {_type_name(f_type)}; {hint}".rstrip("; "))


# ---- overrides --------------------------------------------------------------------------------

_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False}


def _leaf_fields(cls, prefix: str = "") -> dict[str, object]:
    """'section.key' -> field type, for every leaf field of the merged JobConfig."""
    out = {}
    hints = _field_types(cls)
    for f in fields(cls):
        t = hints[f.name]
        if is_dataclass(t):
            out.update(_leaf_fields(t, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = t
    return out


def parse_overrides(tokens: list[str], cls) -> tuple[dict[str, object], list[str]]:
    """`--section.key value` words -> ({'section.key': value}, canonical words for TorchTitan).

    Booleans are flags as in TorchTitan (`--checkpoint.enable`, `--checkpoint.no-enable`) and
    also take an explicit true/false. Lists are comma-separated, as TorchTitan parses them.
    Every other field takes the next word as its value, even one that starts with "--" (e.g.
    `--cluster.sbatch_args --hold`)."""
    leaves = _leaf_fields(cls)
    values: dict[str, object] = {}
    canonical: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or token == "--":
            raise RecipeError(f"{token!r} is not an override: write --section.key value (e.g. --training.steps 10)")
        spelled, eq, inline = token[2:].partition("=")
        key = spelled.replace("-", "_")
        section, _, last = key.rpartition(".")
        negated = key not in leaves and last.startswith("no_") and f"{section}.{last[3:]}" in leaves
        if negated:
            key = f"{section}.{last[3:]}"
        if key not in leaves:
            close = difflib.get_close_matches(key, list(leaves), n=1)
            hint = f"did you mean --{close[0]}? " if close else ""
            siblings = sorted(k.rpartition(".")[2] for k in leaves if k.rpartition(".")[0] == section)
            if siblings:
                what, where = f"[{section}] has no field {last!r}", f"valid in [{section}]: {', '.join(siblings)}"
            else:
                what, where = f"no section [{section}]" if section else "not --section.key", "overrides are --section.key value"
            raise RecipeError(f"override --{spelled}: {what}; {hint}{where}")
        t = leaves[key]
        i += 1
        if t is bool:
            if eq or (i < len(tokens) and not tokens[i].startswith("--")):
                word = inline if eq else tokens[i]
                i += 0 if eq else 1
                if word.lower() not in _BOOL_WORDS:
                    raise RecipeError(f"override --{spelled} {word}: expected true or false (or the flag alone)")
                value = _BOOL_WORDS[word.lower()] != negated
            else:
                value = not negated
            section, _, name = key.rpartition(".")
            canonical.append(f"--{key}" if value else f"--{section}.no-{name}")
        else:
            if negated:
                raise RecipeError(f"override --{spelled}: only true/false fields have a no- form")
            if eq:
                words = [inline]
            elif typing.get_origin(t) is list and typing.get_args(t) and typing.get_origin(typing.get_args(t)[0]) is list:
                words = []
                while i < len(tokens) and not tokens[i].startswith("--"):
                    words.append(tokens[i])
                    i += 1
            elif i < len(tokens):
                words = [tokens[i]]
                i += 1
            else:
                words = []
            if not words:
                raise RecipeError(f"override --{spelled} needs a value ({_type_name(t)}), e.g. --{spelled} VALUE")
            try:
                value = _from_cli(t, words)
            except ValueError:
                shown = " ".join(words)
                choices = typing.get_args(t) if typing.get_origin(t) is typing.Literal else ()
                raise RecipeError(
                    f"override --{spelled} {shown}: expected {_type_name(t)}; {_hint(shown, choices)}".rstrip("; ")
                ) from None
            if len(words) == 1 and words[0].startswith("-"):  # "--hold", "-1": glued, or argparse
                canonical.append(f"--{key}={words[0]}")        # would take it for an option
            else:
                canonical += [f"--{key}", *words]
        values[key] = value
    return values, canonical


def _apply(data: dict, values: dict[str, object]) -> dict:
    """The TOML data with override values put in place (a copy; the file's own dict is kept)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for key, value in values.items():
        *sections, name = key.split(".")
        node = out
        for s in sections:
            child = node.get(s)
            node[s] = child = dict(child) if isinstance(child, dict) else {}
            node = child
        node[name] = value
    return out


def _job_config(path: str, raw: dict, values: dict[str, object]):
    """TorchTitan's JobConfig from the TOML data and the overrides, the way its ConfigManager
    builds one from a file (its own dict-to-dataclass conversion)."""
    from torchtitan.config import ConfigManager

    data = _apply(raw, values)
    data.setdefault("job", {})["config_file"] = path
    try:
        return ConfigManager()._dict_to_dataclass(merged_job_config_cls(), data)
    except (TypeError, ValueError) as e:
        raise RecipeError(str(e)) from e
    except AssertionError as e:  # a TorchTitan dataclass's __post_init__ (e.g. [validation] steps)
        raise RecipeError(f"TorchTitan refuses the recipe: {e}") from e


# ---- the checks -------------------------------------------------------------------------------

def no_effect_warnings(raw: dict, values: dict[str, object], plan) -> list[str]:
    """One warning per [moe_comm] option the recipe (or an override) sets that the chosen
    backend does not read for this run (its class's `ignored_options`), naming the backends
    that would."""
    from moe_comm.backends import backend_class, names

    o = plan.options
    ignored = backend_class(o.backend).ignored_options(plan)
    warnings = []
    for option, why in ignored.items():
        if option not in raw.get("moe_comm", {}) and f"moe_comm.{option}" not in values:
            continue
        readers = [b for b in names() if option not in backend_class(b).ignored_options(plan)]
        who = f"; {' and '.join(readers)} read{'s' if len(readers) == 1 else ''} it" if readers else ""
        warnings.append(f"[moe_comm] {option} = {getattr(o, option)!r} has no effect here: {why}{who}")
    return warnings


def env_file_path(cluster) -> Path:
    path = Path(cluster.env_file)
    return path if path.is_absolute() else REPO / path


def job_env(cluster, backend: str) -> dict[str, str]:
    """The environment a Slurm job's ranks start with: this one (sbatch exports it) plus what
    [cluster] env_file sets, sourced the way slurm/train.sbatch sources it. InfiniBand detection
    is pointed at nothing, so the answer does not depend on the machine that asks."""
    env = dict(os.environ, MOE_COMM_BACKEND=backend, MOE_COMM_IB_SYSFS="/nonexistent")
    try:
        out = subprocess.run(
            ["bash", "-c", 'source "$1" >/dev/null 2>&1; env -0', "env_file", str(env_file_path(cluster))],
            env=env, capture_output=True, text=True, timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RecipeError(f"[cluster] env_file = {cluster.env_file!r} could not be sourced by bash: {e}") from e
    return dict(item.split("=", 1) for item in out.split("\0") if "=" in item)


def job_python(cluster) -> str:
    """Where a Slurm job's ranks run Python, when that is not this environment ("" when it is:
    [cluster] venv empty, or this very venv)."""
    if cluster.container_image:
        return f"[cluster] container_image = {cluster.container_image!r}"
    if cluster.venv and Path(cluster.venv).resolve() != Path(sys.prefix).resolve():
        return f"[cluster] venv = {cluster.venv!r}"
    return ""


def _check_cluster(c) -> None:
    from moe_comm import gpus

    if c.gpu and gpus.lookup(c.gpu) is None:
        raise RecipeError(f"[cluster] gpu = {c.gpu!r} is not a GPU model moe_comm knows; choose one of {list(gpus.MODELS)} or leave it empty")
    if c.venv and c.container_image:
        raise RecipeError("[cluster] sets both venv and container_image: keep one (the image brings its own Python)")
    if not _TIME.match(c.time):
        raise RecipeError(f"[cluster] time = {c.time!r}: use [D-]HH:MM:SS, e.g. \"04:00:00\" or \"1-00:00:00\"")
    if not _JOB_NAME.match(c.job_name):
        raise RecipeError(f"[cluster] job_name = {c.job_name!r}: use letters, digits, '_', '.' and '-' only")
    for extra in c.sbatch_args:
        if not extra.startswith("--") or any(ch.isspace() for ch in extra):
            raise RecipeError(f"[cluster] sbatch_args item {extra!r}: write each option as one \"--name=value\" string")
    if not env_file_path(c).is_file():
        available = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "slurm" / "env").glob("*.sh"))
        raise RecipeError(f"[cluster] env_file = {c.env_file!r} does not exist; available: {available}")


def _check_dataset_name(config) -> None:
    from torchtitan.hf_datasets.text_datasets import DATASETS

    named = [("training", config.training.dataset)]
    if config.validation.enable:
        named.append(("validation", config.validation.dataset))
    for section, name in named:
        if name not in DATASETS:
            # TorchTitan would take another case (it looks the name up lower-cased); the recipe's
            # other readers of the name (its documents, `assets`) take it as TorchTitan lists it
            hint = f"; write {name.lower()!r}" if name.lower() in DATASETS else ""
            raise RecipeError(
                f"[{section}] dataset = {name!r} is not a TorchTitan dataset; choose one of {sorted(DATASETS)}{hint}"
            )


def load(
    path: str,
    overrides: list[str] | None = None,
    *,
    nnodes: int | None = None,
    nproc_per_node: int | None = None,
    device: str | None = None,
    gpu: str = "",
    here: bool = False,
    check_paths: bool = True,
    allow_blockers: bool = False,
) -> Recipe:
    """Parse and validate a recipe; raise RecipeError naming the field and the fix.

    `here=True` (train): the ranks start from this process on this machine, so the device, the
    GPU and the launch environment are this machine's. Otherwise (check, submit) the recipe is
    checked for where it will run: the device from its content ([cluster] request_gpus),
    the GPU given or its [cluster] gpu, the environment its [cluster] env_file sets, and its
    container image. Never from the file's name.

    What the run needs on disk (moe_comm.files: tokenizer, dataset records, dump folder) is
    checked unless `check_paths` is False; its problems are launch blockers, raised together
    as one LaunchBlockers unless `allow_blockers` (check: it reports them after its plan)."""
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
    cls = merged_job_config_cls()
    _check_keys(cls, raw, "")
    values, canonical = parse_overrides(list(overrides or []), cls)

    model_name = values.get("model.name", raw.get("model", {}).get("name", ""))
    if model_name not in MODEL_NAMES:
        raise RecipeError(
            f"[model] name = {model_name!r}: use \"{OUR_MODEL_NAME}\" (DeepSeek-V3 through the "
            "[moe_comm] backend)"
        )
    custom_import = values.get("experimental.custom_import", raw.get("experimental", {}).get("custom_import"))
    if model_name != "deepseek_v3" and custom_import != OUR_IMPORT_MODULE:
        raise RecipeError(
            f'[experimental] custom_import must be "{OUR_IMPORT_MODULE}": it registers the '
            f"{model_name!r} train spec (and the CPU adaptations)"
        )
    config = _job_config(path, raw, values)
    from moe_comm.backends import backend_class, names

    if config.moe_comm.backend not in names():
        raise RecipeError(f"[moe_comm] backend = {config.moe_comm.backend!r}: choose one of {list(names())}")
    _check_cluster(config.cluster)

    from moe_comm import gpus

    machine = gpus.this_machine() if here else None
    if device is None:
        device = ("cuda" if machine else "cpu") if here else ("cuda" if config.cluster.request_gpus else "cpu")
    if here and machine:
        gpu, gpu_sms = machine
    else:
        gpu, gpu_sms = gpu or config.cluster.gpu, 0
    args = flavor_args(config)
    layout = resolve_layout(config, nnodes, nproc_per_node)
    check_layout(config, layout, args, device)
    titan_fields.check(config, layout)
    for name in config.model.converters:
        if name not in CONVERTERS:
            raise RecipeError(f"[model] converters: {name!r} is not one of {list(CONVERTERS)}")
    if device == "cpu" and config.model.converters:
        raise RecipeError(
            f"[model] converters = {config.model.converters}: float8/MXFP8 need H100+/B200 GPUs; "
            "remove them on CPU"
        )

    if here:
        launch_env, source = dict(os.environ), "this process's environment"
    elif layout.nodes > 1:
        launch_env = job_env(config.cluster, config.moe_comm.backend)
        source = f"[cluster] env_file = {config.cluster.env_file!r}"
    else:
        launch_env, source = None, ""
    plan = run_plan(config, layout, args, device, gpu=gpu, gpu_sms=gpu_sms, launch_env=launch_env,
                    launch_env_source=source, python_env="" if here else job_python(config.cluster))
    notes = backend_class(config.moe_comm.backend).check_run(plan)
    _check_dataset_name(config)
    blockers, warnings = [], no_effect_warnings(raw, values, plan)
    if check_paths:
        sets_assets = "model.hf_assets_path" in values or "hf_assets_path" in raw.get("model", {})
        found = files.check(config, args.vocab_size, sets_assets)
        blockers, warnings, notes = found.blockers, warnings + found.warnings, notes + found.notes
        if blockers and not allow_blockers:
            raise LaunchBlockers(blockers)
    return Recipe(path=path, toml=raw, config=config, layout=layout, device=device,
                  overrides=canonical, plan=plan, notes=notes, warnings=warnings, blockers=blockers)


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
    # the verb's name in its usage line (argparse would name the file: "__main__.py")
    prog = f"python -m moe_comm {getattr(args, 'verb', '') or ''}".rstrip()
    ours = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)
    add_flags(ours)
    defaults = vars(ours.parse_args([]))
    parsed, unknown = ours.parse_known_args(rest)
    for key, value in vars(parsed).items():
        if value != defaults[key]:
            setattr(args, key, value)
    return unknown + tail


def main_error(e: RecipeError) -> int:
    for line in e.blockers if isinstance(e, LaunchBlockers) else [str(e)]:
        print(f"recipe error: {line}", file=sys.stderr)
    return 2
