"""The TorchTitan fields its trainer divides by, takes a remainder by, asserts on or looks up by
name (moe_comm.titan_fields): refused by `check`, `submit` and `train` before any process starts,
naming the field.

Before: `--checkpoint.interval 0` passed `check` and `submit --dry-run`, then every rank died
after step 1 with a ZeroDivisionError."""

from pathlib import Path

import pytest

from moe_comm import recipe

REPO = Path(__file__).resolve().parents[1]
CKPT = ["--checkpoint.enable"]

BAD = [
    (CKPT + ["--checkpoint.interval", "0"], "[checkpoint] interval = 0 must be >= 1"),
    (CKPT + ["--checkpoint.keep_latest_k", "1"], "[checkpoint] keep_latest_k = 1"),
    (CKPT + ["--checkpoint.keep_latest_k", "-3"], "[checkpoint] keep_latest_k = -3"),
    (CKPT + ["--checkpoint.load_step", "-2"], "[checkpoint] load_step = -2"),
    (CKPT + ["--checkpoint.last_save_in_hf", "--checkpoint.no-last_save_model_only"], "[checkpoint] last_save_in_hf"),
    (["--metrics.log_freq", "0"], "[metrics] log_freq = 0 must be >= 1"),
    (["--training.gc_freq", "0"], "[training] gc_freq = 0"),
    (["--training.global_batch_size", "6"], "[training] global_batch_size = 6 must be -1"),
    (["--training.global_batch_size", "0"], "[training] global_batch_size = 0"),
    (["--lr_scheduler.warmup_steps", "-1"], "[lr_scheduler] warmup_steps = -1"),
    (["--lr_scheduler.decay_ratio", "1.5"], "[lr_scheduler] decay_ratio = 1.5"),
    (["--lr_scheduler.min_lr_factor", "2"], "[lr_scheduler] min_lr_factor = 2.0"),
    (["--lr_scheduler.total_steps", "3"], "[lr_scheduler] total_steps = 3 is below [training] steps = 5"),
    (["--comm.train_timeout_seconds", "0"], "[comm] train_timeout_seconds = 0"),
    (["--comm.init_timeout_seconds", "0"], "[comm] init_timeout_seconds = 0"),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "half"],
     "[activation_checkpoint] selective_ac_option = 'half'"),
    (["--profiling.enable_profiling", "--profiling.profile_freq", "0"], "[profiling] profile_freq = 0"),
    (["--profiling.enable_profiling", "--profiling.profile_freq", "3", "--profiling.profiler_warmup", "3"],
     "[profiling] profile_freq = 3 must be >= profiler_warmup + profiler_active = 4"),
    (["--validation.enable", "--validation.freq", "0"], "[validation] freq = 0"),
    (["--validation.steps", "0"], "validation steps must be positive or -1"),  # TorchTitan's own assert
    (["--training.dataloader.num_workers", "-1"], "[training.dataloader] num_workers = -1"),
    (["--compile.enable", "--compile.components", "model,los"], "[compile] components = ['model', 'los'] must name"),
    (["--optimizer.name", "Adamw"], "[optimizer] name = 'Adamw' must be 'Adam' or 'AdamW' (the optimizers TorchTitan "
                                     "builds); did you mean 'AdamW'?"),
    (["--optimizer.early_step_in_backward"], "[optimizer] early_step_in_backward = true needs expert_parallel_degree"),
    (["--nproc-per-node", "4", "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
      "1F1b2"], "[parallelism] pipeline_parallel_schedule = '1F1b2': Unknown schedule name '1F1b2'. The valid options"),
    (["--compile.enable", "--compile.backend", "inductr"], "[compile] backend = 'inductr' is not a torch.compile backend"),
    (["--nproc-per-node", "4", "--parallelism.pipeline_parallel_degree", "2",
      "--parallelism.pipeline_parallel_microbatch_size", "3"], "pipeline_parallel_microbatch_size = 3"),
    # torch's schedules refuse these microbatch counts when they are built, on every rank
    (["--nproc-per-node", "4", "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
      "DualPipeV", "--training.local_batch_size", "2"],
     "'DualPipeV' needs at least 4 microbatches per step, one per stage (torch refuses 2), and [training] "
     "local_batch_size = 2 / [parallelism] pipeline_parallel_microbatch_size = 1 gives 2: set local_batch_size to 4"),
    (["--nproc-per-node", "8", "--parallelism.pipeline_parallel_degree", "4", "--parallelism.pipeline_parallel_schedule",
      "1F1B", "--training.local_batch_size", "3"], "'1F1B' needs at least 4 microbatches per step"),
    (["--nproc-per-node", "4", "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
      "Interleaved1F1B", "--training.local_batch_size", "5"],
     "multiple of the 2 rounds (torch refuses 5), and [training] local_batch_size = 5 / [parallelism] "
     "pipeline_parallel_microbatch_size = 1 gives 5: set local_batch_size to 6"),
]


def _split(words: list[str]) -> tuple[list[str], int | None]:
    if words[:1] == ["--nproc-per-node"]:
        return words[2:], int(words[1])
    return words, None


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_a_field_titan_divides_by_is_refused_before_launch(overrides, message):
    words, nproc = _split(overrides)
    with pytest.raises(recipe.RecipeError) as e:
        recipe.load("recipes/debug_cpu.toml", words, device="cpu", nproc_per_node=nproc)
    assert message in str(e.value)


def test_the_defaults_and_the_disabled_features_pass():
    """A field of a feature that is off is not TorchTitan's concern, so not ours either."""
    recipe.load("recipes/debug_cpu.toml", ["--checkpoint.interval", "0", "--validation.freq", "0",
                                           "--profiling.profile_freq", "0"], device="cpu")
    recipe.load("recipes/debug_cpu.toml", ["--training.global_batch_size", "8"], device="cpu")  # 2 steps of accumulation
    recipe.load("recipes/debug_cpu.toml", ["--compile.components", "los"], device="cpu")  # compile is off
    for components in ("loss", "model", "model,loss"):
        recipe.load("recipes/debug_cpu.toml", ["--compile.enable", "--compile.components", components], device="cpu")
    recipe.load("recipes/debug_cpu.toml", ["--compile.enable", "--compile.backend", "aot_eager"], device="cpu")


@pytest.mark.parametrize("verb", ["check", "submit", "train"])
def test_interval_0_is_refused_by_every_verb(verb, capsys, tmp_path):
    from moe_comm.__main__ import main

    extra = [] if verb == "check" else ["--dry-run"]
    rc = main([verb, "recipes/debug_cpu.toml", *extra, "--job.dump_folder", str(tmp_path / "d"),
               "--checkpoint.enable", "--checkpoint.interval", "0"])
    out = capsys.readouterr()
    assert rc == 2 and "[checkpoint] interval = 0 must be >= 1" in out.err, out
    assert "torch.distributed.run" not in out.out


def test_accumulation_steps_are_titans():
    """The one count of gradient-accumulation steps the metrics, the FP8 weight cache and the
    memory estimate share (TorchTitan's train.py arithmetic)."""
    from types import SimpleNamespace

    from moe_comm.titan_fields import accumulation_steps

    assert accumulation_steps(SimpleNamespace(local_batch_size=2, global_batch_size=-1), 1, 4) == 1
    assert accumulation_steps(SimpleNamespace(local_batch_size=2, global_batch_size=16), 1, 4) == 2
    assert accumulation_steps(SimpleNamespace(local_batch_size=2, global_batch_size=48), 2, 3) == 4
