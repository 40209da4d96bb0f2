"""Recipe parsing and every bad-input error `moe_comm.recipe.load` raises (before any process
starts); each error must name the field and say the fix."""

import os
from pathlib import Path

import pytest

from moe_comm import recipe

REPO = Path(__file__).resolve().parents[1]
DEBUG = (REPO / "recipes" / "debug_cpu.toml").read_text()
GPU_RECIPES = sorted(p.name for p in (REPO / "recipes").glob("*.toml") if "cpu" not in p.name)


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)  # recipes name paths relative to the repository root


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "r.toml"
    path.write_text(text)
    return str(path)


def _edit(old: str, new: str) -> str:
    assert old in DEBUG, old
    return DEBUG.replace(old, new)


def test_debug_recipe_resolves():
    r = recipe.load("recipes/debug_cpu.toml", device="cpu")
    lay = r.layout
    assert (lay.world, lay.dp_shard, lay.ep, lay.pp, lay.tp) == (2, 2, 2, 1, 1)
    assert r.config.moe_comm.backend == "nccl"
    assert r.config.model.name == "deepseek_v3_moe_comm"


def test_overrides_apply():
    r = recipe.load("recipes/debug_cpu.toml", ["--training.steps", "3", "--moe_comm.num_sms", "8"], device="cpu")
    assert r.config.training.steps == 3 and r.config.moe_comm.num_sms == 8


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipes_resolve(name):
    r = recipe.load(f"recipes/{name}", device="cuda", check_paths=False)
    assert r.layout.world == r.config.cluster.nodes * r.config.cluster.gpus_per_node
    assert r.config.model.name == "deepseek_v3_moe_comm"


def test_flagship_layout():
    lay = recipe.load("recipes/deepseek_v3_671b_b200.toml", device="cuda", check_paths=False).layout
    assert (lay.world, lay.dp_shard, lay.pp, lay.ep, lay.efsdp) == (256, 32, 8, 32, 1)


def test_nproc_override_changes_world():
    r = recipe.load("recipes/debug_cpu.toml", device="cpu", nproc_per_node=4)
    assert (r.layout.world, r.layout.dp_shard) == (4, 4)


BAD = [
    # (description, edit, words the message must contain)
    ("unknown key", ("lr = 8e-4", "lr = 8e-4\nlearning_rate = 1"), ["[optimizer] learning_rate", "valid:"]),
    ("typo gets a suggestion", ("\nsteps = 5", "\nstepz = 5"), ["[training] stepz", "did you mean 'steps'"]),
    ("unknown section", ("[debug]", "[debugg]\n[debug]"), ["[debugg]", "did you mean 'debug'"]),
    ("unknown moe_comm key", ('backend = "nccl"', 'backend = "nccl"\nsms = 4'), ["[moe_comm] sms"]),
    ("bad backend", ('backend = "nccl"', 'backend = "mpi"'), ["[moe_comm] backend", "'mpi'"]),
    ("gpu backend on cpu", ('backend = "nccl"', 'backend = "nvshmem"'), ["[moe_comm] backend", "needs CUDA", "nccl"]),
    ("num_sms out of range", ('backend = "nccl"', 'backend = "nccl"\nnum_sms = 0'), ["[moe_comm] num_sms"]),
    ("capacity factor below 1", ('backend = "nccl"', 'backend = "nccl"\nrecv_capacity_factor = 0.5'), ["[moe_comm] recv_capacity_factor"]),
    ("max tokens below the batch", ('backend = "nccl"', 'backend = "nccl"\nmax_tokens_per_rank = 100'), ["[moe_comm] max_tokens_per_rank", "256"]),
    ("negative max tokens", ('backend = "nccl"', 'backend = "nccl"\nmax_tokens_per_rank = -1'), ["[moe_comm] max_tokens_per_rank"]),
    ("EP not dividing experts", ("expert_parallel_degree = 2", "expert_parallel_degree = 3"), ["expert_parallel_degree = 3"]),
    ("EP not dividing the world", ("gpus_per_node = 2 ", "gpus_per_node = 3 "), ["expert_parallel_degree = 2", "must divide"]),
    ("world size mismatch", ("data_parallel_shard_degree = -1", "data_parallel_shard_degree = 4"), ["world size is 2", "data_parallel_shard_degree"]),
    ("world not divisible", ("pipeline_parallel_degree = 1", "pipeline_parallel_degree = 4"), ["world size 2", "not divisible"]),
    ("missing tokenizer", ('hf_assets_path = "./assets/tiny"', 'hf_assets_path = "./assets/nothere"'), ["[model] hf_assets_path", "absolute path"]),
    ("tokenizer folder without tokenizer", ('hf_assets_path = "./assets/tiny"', 'hf_assets_path = "./recipes"'), ["[model] hf_assets_path", "tokenizer.json"]),
    ("missing dataset", ('dataset_path = "./assets/tiny/c4_tiny"', 'dataset_path = "./assets/tiny/none"'), ["[training] dataset_path"]),
    ("unknown dataset", ('dataset = "c4_test"', 'dataset = "pile"'), ["[training] dataset", "'pile'"]),
    ("dataset in another case", ('dataset = "c4_test"', 'dataset = "C4_test"'), ["[training] dataset", "write 'c4_test'"]),
    ("unknown validation dataset", ("[debug]", '[validation]\nenable = true\ndataset = "pile"\n\n[debug]'),
     ["[validation] dataset", "'pile'", "c4_validation"]),
    ("unknown flavor", ('flavor = "debugmodel"', 'flavor = "1T"'), ["[model] flavor", "671B_layers"]),
    ("flex flavor on cpu", ('flavor = "debugmodel"', 'flavor = "debugmodel_flex_attn"'), ["[model] flavor", "CPU"]),
    ("unknown model", ('name = "deepseek_v3_moe_comm"', 'name = "llama3"'), ["[model] name", "deepseek_v3_moe_comm"]),
    ("converters on cpu", ('flavor = "debugmodel"', 'flavor = "debugmodel"\nconverters = ["quantize.linear.float8"]'), ["[model] converters"]),
    ("unknown converter", ('flavor = "debugmodel"', 'flavor = "debugmodel"\nconverters = ["float9"]'), ["[model] converters", "float9"]),
    ("missing custom_config_module", ('custom_config_module = "moe_comm.config"', ""), ["[job] custom_config_module", "moe_comm.config"]),
    ("missing custom_import", ('custom_import = "moe_comm.titan"', ""), ["[experimental] custom_import", "moe_comm.titan"]),
    ("titan deepep switch", ("expert_parallel_degree = 2", 'expert_parallel_degree = 2\nexpert_parallel_comm_backend = "deepep"'), ["expert_parallel_comm_backend", "[moe_comm] backend"]),
    ("TP with EP", ("data_parallel_shard_degree = -1\ntensor_parallel_degree = 1", "data_parallel_shard_degree = 1\ntensor_parallel_degree = 2"), ["tensor_parallel_degree", "expert_parallel_degree"]),
    ("wrong type", ("\nsteps = 5", '\nsteps = "ten"'), ["[training] steps", "int"]),
    ("section that is not a table", ("[checkpoint]\nenable = false", "[checkpoint]\nenable = false\n[checkpoint.folder]"), ["[checkpoint] folder"]),
]


@pytest.mark.parametrize("what,edit,words", BAD, ids=[b[0] for b in BAD])
def test_bad_recipe(tmp_path, what, edit, words):
    path = _write(tmp_path, _edit(*edit))
    with pytest.raises(recipe.RecipeError) as e:
        recipe.load(path, device="cpu")
    for word in words:
        assert word in str(e.value), f"{what}: {word!r} not in {str(e.value)!r}"


def test_tokenizer_beyond_the_flavors_vocab(tmp_path):
    """debugmodel embeds 2,048 ids; a larger tokenizer (assets/real's has 32,768) would fail in the
    first embedding lookup of the first step, so the recipe is refused before launch."""
    import json

    tok = tmp_path / "tok"
    tok.mkdir()
    vocab = {f"t{i}": i for i in range(2047)}
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": [{"id": 2047}]}))
    from moe_comm import files

    assert files.tokenizer_vocab_size(str(tok)) == 2048
    recipe.load("recipes/debug_cpu.toml", ["--model.hf_assets_path", str(tok)], device="cpu")  # exactly fits
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}, "added_tokens": [{"id": 2048}]}))
    with pytest.raises(recipe.RecipeError) as e:
        recipe.load("recipes/debug_cpu.toml", ["--model.hf_assets_path", str(tok)], device="cpu")
    for word in ("[model] hf_assets_path", "2048", "[model] flavor = 'debugmodel'", "vocab_size 2048"):
        assert word in str(e.value), str(e.value)


def test_tp_without_divisible_seq(tmp_path):
    text = _edit("expert_parallel_degree = 2", "expert_parallel_degree = 1")
    text = text.replace("data_parallel_shard_degree = -1\ntensor_parallel_degree = 1", "data_parallel_shard_degree = 1\ntensor_parallel_degree = 2")
    text = text.replace("seq_len = 128", "seq_len = 127")
    with pytest.raises(recipe.RecipeError, match=r"\[training\] seq_len = 127"):
        recipe.load(_write(tmp_path, text), device="cpu")


def test_deepep_with_grouped_mm_converter():
    with pytest.raises(recipe.RecipeError, match=r"backend = \"deepep\" does not pad"):
        recipe.load(
            "recipes/deepseek_v3_671b_b200_mxfp8.toml",
            ["--moe_comm.backend", "deepep", "--moe_comm.dispatch_dtype", "bf16", "--moe_comm.combine_grad_dtype", "bf16",
             "--cluster.container_image", "img"],
            device="cuda", check_paths=False,
        )


def test_missing_file():
    with pytest.raises(recipe.RecipeError, match="does not exist"):
        recipe.load("recipes/nope.toml", device="cpu")


def test_invalid_toml(tmp_path):
    with pytest.raises(recipe.RecipeError, match="not valid TOML"):
        recipe.load(_write(tmp_path, DEBUG + "\n[job\n"), device="cpu")


BAD_OVERRIDES = [
    (["--training.stepz", "3"], ["override --training.stepz", "did you mean --training.steps?", "valid in [training]"]),
    (["--trainig.steps", "3"], ["no section [trainig]", "did you mean --training.steps?"]),
    (["--training.steps", "ten"], ["override --training.steps ten", "expected an integer"]),
    (["--optimizer.lr", "fast"], ["override --optimizer.lr fast", "expected a number"]),
    (["--moe_comm.backend", "deepeep"], ["override --moe_comm.backend deepeep", "'nccl', 'nvshmem', 'deepep'", "did you mean 'deepep'?"]),
    (["--checkpoint.enable", "maybe"], ["override --checkpoint.enable maybe", "true or false"]),
    (["--training.steps"], ["override --training.steps needs a value (an integer)"]),
    (["training.steps", "3"], ["'training.steps' is not an override"]),
    (["--training.no-steps"], ["only true/false fields have a no- form"]),
]


@pytest.mark.parametrize("overrides,words", BAD_OVERRIDES, ids=[" ".join(b[0]) for b in BAD_OVERRIDES])
def test_bad_override_names_it_and_the_expected_type(overrides, words):
    with pytest.raises(recipe.RecipeError) as e:
        recipe.load("recipes/debug_cpu.toml", overrides, device="cpu")
    for word in words:
        assert word in str(e.value), f"{word!r} not in {str(e.value)!r}"


@pytest.mark.parametrize("verb", ["check", "train", "submit"])
def test_one_error_per_bad_override(verb, capsys):
    """One line on stderr: no tyro box pointing at __main__.py --help, no second generic line."""
    from moe_comm.__main__ import main

    extra = ["--dry-run"] if verb != "check" else []
    assert main([verb, "recipes/debug_cpu.toml", *extra, "--training.steps", "ten"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "--training.steps ten: expected an integer" in lines[0], err
    assert "--help" not in err and "\u256d" not in err


def test_overrides_are_parsed_once_into_canonical_words():
    r = recipe.load("recipes/debug_cpu.toml", [
        "--checkpoint.enable", "false", "--metrics.no-enable_wandb", "--training.steps=3",
        "--cluster.sbatch_args", "--hold", "--parallelism.data_parallel_shard_degree", "-1",
        "--model.converters", "quantize.linear.float8,quantize.grouped_mm.float8", "--debug.seed", "None",
    ], device="cuda", check_paths=False)
    c = r.config
    assert (c.checkpoint.enable, c.metrics.enable_wandb, c.training.steps) == (False, False, 3)
    assert c.cluster.sbatch_args == ["--hold"] and c.parallelism.data_parallel_shard_degree == -1
    assert c.model.converters == ["quantize.linear.float8", "quantize.grouped_mm.float8"] and c.debug.seed is None
    assert r.overrides == [
        "--checkpoint.no-enable", "--metrics.no-enable_wandb", "--training.steps", "3",
        "--cluster.sbatch_args=--hold", "--parallelism.data_parallel_shard_degree=-1",
        "--model.converters", "quantize.linear.float8,quantize.grouped_mm.float8", "--debug.seed", "None",
    ]
    # TorchTitan's own parser (what the ranks run) reads the canonical words the same way
    from torchtitan.config import ConfigManager

    titan = ConfigManager().parse_args(["--job.config_file", "recipes/debug_cpu.toml", *r.overrides])
    for section in ("checkpoint", "metrics", "training", "cluster", "parallelism", "model", "debug"):
        assert getattr(titan, section) == getattr(c, section), section


def test_device_comes_from_the_recipe_not_its_file_name(tmp_path, capsys):
    """A copy of the CPU recipe saved as tiny_test.toml is still a CPU recipe, and a GPU recipe
    saved as my_cpu_try.toml is still a GPU one."""
    from moe_comm.__main__ import main

    (tmp_path / "tiny_test.toml").write_text(DEBUG)
    assert main(["check", str(tmp_path / "tiny_test.toml")]) == 0
    assert "backend     nccl (num_sms 20) on cpu" in capsys.readouterr().out
    (tmp_path / "my_cpu_try.toml").write_text((REPO / "recipes" / "deepseek_v3_16b_b200.toml").read_text())
    assert main(["check", str(tmp_path / "my_cpu_try.toml"), "--skip-files"]) == 0
    out = capsys.readouterr().out
    assert "on cuda" in out and "B200 178 GiB: fits" in out


def test_gpu_of_the_recipe_bounds_the_sm_budget():
    with pytest.raises(recipe.RecipeError, match="H200 has 132 SMs"):
        recipe.load("recipes/deepseek_v3_16b_h200x2.toml", ["--moe_comm.backend", "nvshmem", "--moe_comm.num_sms", "140"],
                    check_paths=False)
    r = recipe.load("recipes/deepseek_v3_16b_b200.toml", ["--moe_comm.backend", "nvshmem", "--moe_comm.num_sms", "140"],
                    check_paths=False)
    assert r.plan.gpu == "B200" and r.notes == []


def test_flagship_with_nvshmem_passes_and_needs_the_platform_network_settings():
    r = recipe.load("recipes/deepseek_v3_671b_b200.toml", ["--moe_comm.backend", "nvshmem"], check_paths=False)
    assert r.plan.ep_nodes == 4 and r.plan.launch_env["NVSHMEM_REMOTE_TRANSPORT"] == "ibrc"
    with pytest.raises(recipe.RecipeError) as e:
        recipe.load("recipes/deepseek_v3_671b_b200.toml",
                    ["--moe_comm.backend", "nvshmem", "--cluster.env_file", "slurm/env/cpu-local.sh"], check_paths=False)
    assert "[cluster] env_file = 'slurm/env/cpu-local.sh'" in str(e.value) and "NVSHMEM_HCA_LIST" in str(e.value)


def test_model_build_asks_the_same_checks():
    """titan/parallelize checks with what the ranks see: here no CUDA, so nvshmem is refused
    with the very error `check` gives, and the layout rules are moe_comm.layout.check_layout's."""
    from types import SimpleNamespace

    from torchtitan.distributed import ParallelDims

    from moe_comm.layout import flavor_args
    from moe_comm.titan.parallelize import check_before_build

    config = recipe.load("recipes/debug_cpu.toml", ["--moe_comm.backend", "nvshmem"], device="cuda", check_paths=False).config
    model = SimpleNamespace(model_args=flavor_args(config))
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, etp=1, world_size=2)
    with pytest.raises(recipe.RecipeError, match="needs CUDA GPUs and this run is on cpu"):
        check_before_build(model, dims, config)
    config.moe_comm.backend, config.training.seq_len = "nccl", 255
    with pytest.raises(recipe.RecipeError, match=r"\[training\] seq_len = 255"):
        check_before_build(model, dims, config)


def test_relative_paths_need_repo_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(recipe.RecipeError, match="repository root"):
        recipe.load(str(REPO / "recipes" / "debug_cpu.toml"), device="cpu")
