"""The TorchTitan 0.2.2 fields its trainer divides by, takes a remainder by, asserts on, counts
with or looks up by name (and ignores when the name is wrong), checked before launch.

TorchTitan reads these only when it gets to them: `--checkpoint.interval 0` passes its parser,
trains step 1 and then kills every rank with a ZeroDivisionError in `step % interval`. Each
rule below names the line of TorchTitan that would fail (torchtitan/...), so a rule can be
dropped when TorchTitan checks it itself. Fields of a feature that is off (checkpointing,
profiling, validation) are checked only when it is on, as TorchTitan reads them only then.
"""

import difflib

from moe_comm.errors import RecipeError
from moe_comm.layout import Layout

# What TorchTitan 0.2.2 compiles under [compile] enable, by the names [compile] components takes
COMPILE_COMPONENTS = ("model", "loss")
# The optimizers TorchTitan 0.2.2 builds, by [optimizer] name (components/optimizer.py)
OPTIMIZERS = ("Adam", "AdamW")


def _at_least(section: str, name: str, value: int, low: int, why: str) -> None:
    if value < low:
        raise RecipeError(f"[{section}] {name} = {value} must be >= {low} ({why})")


def accumulation_steps(training, dp_replicate: int, dp_shard: int) -> int:
    """TorchTitan's gradient-accumulation steps per optimizer step (train.py): [training]
    global_batch_size over the local batch times the batch's data-parallel degree; 1 where
    global_batch_size is -1 (one local batch per rank and step)."""
    batch = training.local_batch_size * dp_replicate * dp_shard
    return max(1, training.global_batch_size // batch) if training.global_batch_size > 0 else 1


def check(config, layout: Layout) -> None:
    """Raise RecipeError naming the field and the fix for a value TorchTitan cannot run."""
    t, m, c, lr, p = config.training, config.metrics, config.checkpoint, config.lr_scheduler, config.parallelism
    # components/metrics.py should_log: step % log_freq
    _at_least("metrics", "log_freq", m.log_freq, 1, "TorchTitan logs every step % log_freq == 0")
    # tools/utils.py GarbageCollection: asserts gc_freq > 0, then step % gc_freq
    _at_least("training", "gc_freq", t.gc_freq, 1, "TorchTitan collects garbage every step % gc_freq == 0")
    # train.py: global batch = local batch x data-parallel ranks x gradient accumulation steps
    batch = t.local_batch_size * layout.dp_replicate * layout.dp_shard
    if t.global_batch_size != -1 and (t.global_batch_size < 1 or t.global_batch_size % batch):
        raise RecipeError(
            f"[training] global_batch_size = {t.global_batch_size} must be -1 (local_batch_size x "
            f"data-parallel ranks = {batch}) or a positive multiple of {batch}, the batch of one "
            "gradient accumulation step"
        )
    _at_least("training.dataloader", "num_workers", t.dataloader.num_workers, 0, "0 loads in the rank itself")

    # components/lr_scheduler.py linear_warmup_stable_decay
    _at_least("lr_scheduler", "warmup_steps", lr.warmup_steps, 0, "0 means no warmup")
    if lr.decay_ratio is not None and not 0 <= lr.decay_ratio <= 1:
        raise RecipeError(
            f"[lr_scheduler] decay_ratio = {lr.decay_ratio} must be between 0 and 1 (the share of the "
            "steps spent decaying), or left unset to decay over every step after warmup"
        )
    if not 0 <= lr.min_lr_factor <= 1:
        raise RecipeError(f"[lr_scheduler] min_lr_factor = {lr.min_lr_factor} must be between 0 and 1 (a share of [optimizer] lr)")
    if lr.total_steps is not None and lr.total_steps < t.steps:
        raise RecipeError(
            f"[lr_scheduler] total_steps = {lr.total_steps} is below [training] steps = {t.steps}: past "
            "it the decay runs beyond its end and the learning rate leaves [min_lr_factor, 1] "
            "(negative for linear decay); raise it or leave it unset"
        )

    # distributed/pipeline_parallel.py: local batch % microbatch, then local batch // microbatch
    if layout.pp > 1:
        # distributed/pipeline_parallel.py: get_schedule_class(name) raises for a name torch lacks
        from torch.distributed.pipelining.schedules import get_schedule_class

        try:
            get_schedule_class(p.pipeline_parallel_schedule)
        except ValueError as e:
            raise RecipeError(f"[parallelism] pipeline_parallel_schedule = {p.pipeline_parallel_schedule!r}: {e}") from None
        mb = p.pipeline_parallel_microbatch_size
        _at_least("parallelism", "pipeline_parallel_microbatch_size", mb, 1, "rows of the local batch per pipeline microbatch")
        if t.local_batch_size % mb:
            raise RecipeError(
                f"[training] local_batch_size = {t.local_batch_size} must be a multiple of [parallelism] "
                f"pipeline_parallel_microbatch_size = {mb} (TorchTitan splits the batch into microbatches)"
            )
        _check_microbatches(p.pipeline_parallel_schedule, layout.pp, t.local_batch_size, mb)

    # train.py sets the process groups' timeouts to these (timedelta(seconds=...)); 0 fails at once
    _at_least("comm", "init_timeout_seconds", config.comm.init_timeout_seconds, 1, "the first collectives' timeout")
    _at_least("comm", "train_timeout_seconds", config.comm.train_timeout_seconds, 1, "every collective's timeout after step 1")

    # distributed/activation_checkpoint.py: "op", or int(option) layers per checkpoint
    ac = config.activation_checkpoint
    if ac.mode == "selective" and ac.selective_ac_option != "op" and not ac.selective_ac_option.isdigit():
        raise RecipeError(
            f"[activation_checkpoint] selective_ac_option = {ac.selective_ac_option!r} must be \"op\" "
            "(per-operator) or a whole number N (every N-th layer), e.g. \"2\""
        )

    if c.enable:
        # components/checkpoint.py _should_save: step % interval
        _at_least("checkpoint", "interval", c.interval, 1, "TorchTitan saves every step % interval == 0")
        # components/checkpoint.py: keep_latest_k == 1 raises; > 0 keeps that many
        if c.keep_latest_k < 0 or c.keep_latest_k == 1:
            raise RecipeError(
                f"[checkpoint] keep_latest_k = {c.keep_latest_k} must be 0 (keep every checkpoint) or >= 2 "
                "(TorchTitan keeps one more than the one being written)"
            )
        _at_least("checkpoint", "load_step", c.load_step, -1, "-1 means the newest checkpoint")
        if c.last_save_in_hf and not c.last_save_model_only:
            raise RecipeError(
                "[checkpoint] last_save_in_hf = true needs last_save_model_only = true (HF safetensors hold "
                "the model only)"
            )
        if c.initial_load_in_hf and not c.initial_load_model_only:
            raise RecipeError(
                "[checkpoint] initial_load_in_hf = true needs initial_load_model_only = true (HF safetensors "
                "hold the model only)"
            )

    # components/optimizer.py build_optimizers: NotImplementedError for another name, and for a
    # step in the backward under expert or pipeline parallelism
    o = config.optimizer
    if o.name not in OPTIMIZERS:
        close = [n for n in OPTIMIZERS if n.lower() == o.name.lower()] or difflib.get_close_matches(
            o.name, OPTIMIZERS, n=1, cutoff=0.5)
        raise RecipeError(
            f"[optimizer] name = {o.name!r} must be {' or '.join(repr(n) for n in OPTIMIZERS)} (the optimizers "
            f"TorchTitan builds){f'; did you mean {close[0]!r}?' if close else ''}"
        )
    if o.early_step_in_backward and (layout.ep > 1 or layout.pp > 1):
        raise RecipeError(
            f"[optimizer] early_step_in_backward = true needs expert_parallel_degree and pipeline_parallel_degree "
            f"1 (TorchTitan steps in the backward only without them; here EP {layout.ep}, PP {layout.pp}): set it false"
        )

    # models/*/infra/parallelize.py `"model" in components`, components/loss.py `"loss" in components`:
    # any other name compiles nothing, silently
    if config.compile.enable:
        unknown = [name for name in config.compile.components if name not in COMPILE_COMPONENTS]
        if unknown or not config.compile.components:
            raise RecipeError(
                f"[compile] components = {list(config.compile.components)} must name what TorchTitan compiles: "
                f"{' and/or '.join(repr(n) for n in COMPILE_COMPONENTS)} (it compiles nothing for "
                f"{unknown or 'an empty list'}); or set [compile] enable = false"
            )
        # torch.compile(..., backend=...) in apply_compile and build_cross_entropy_loss: an unknown
        # name raises there, on every rank, after the job has started
        from torch._dynamo.backends.registry import lookup_backend
        from torch._dynamo.exc import InvalidBackend

        try:
            lookup_backend(config.compile.backend)
        except InvalidBackend:
            raise RecipeError(
                f"[compile] backend = {config.compile.backend!r} is not a torch.compile backend: \"inductor\" "
                "(TorchTitan's default) generates kernels; \"aot_eager\" traces without generating them "
                "(torch._dynamo.list_backends() lists the rest)"
            ) from None

    prof = config.profiling
    if prof.enable_profiling or prof.enable_memory_snapshot:
        # tools/profiling.py: step % profile_freq, and wait = freq - (warmup + active) >= 0
        _at_least("profiling", "profile_freq", prof.profile_freq, 1, "TorchTitan profiles every step % profile_freq == 0")
    if prof.enable_profiling:
        _at_least("profiling", "profiler_active", prof.profiler_active, 1, "steps recorded per trace")
        _at_least("profiling", "profiler_warmup", prof.profiler_warmup, 0, "steps before each trace")
        if prof.profiler_warmup + prof.profiler_active > prof.profile_freq:
            raise RecipeError(
                f"[profiling] profile_freq = {prof.profile_freq} must be >= profiler_warmup + profiler_active "
                f"= {prof.profiler_warmup + prof.profiler_active} (TorchTitan asserts it)"
            )

    v = config.validation
    if v.enable:
        # components/validate.py should_validate: step % freq; loss / steps run
        _at_least("validation", "freq", v.freq, 1, "TorchTitan validates every step % freq == 0")
        # (steps: TorchTitan's own Validation.__post_init__ asserts steps > 0 or -1, see recipe._job_config)
        _at_least("validation", "local_batch_size", v.local_batch_size, 1, "rows per validation batch")
        _at_least("validation", "seq_len", v.seq_len, 1, "tokens per validation row")


def torch_refuses(schedule: str, pp: int, microbatches: int) -> str:
    """Why torch.distributed.pipelining refuses this many microbatches per step when it builds the
    schedule (Schedule1F1B and ScheduleDualPipeV: fewer than their stages; the interleaved
    schedules: a count their rounds do not divide), or "" where it takes them. The recipe check
    and the schedule model (moe_comm.predict.schedule) both ask it."""
    name, m = schedule.lower(), microbatches
    least = {"1f1b": pp, "dualpipev": 2 * pp}.get(name, 0)  # the stages: pp, and 2 per rank in a V
    if m < least:
        return f"needs at least {least} microbatches per step, one per stage (torch refuses {m})"
    rounds = max(1, m // pp)
    if name in ("interleaved1f1b", "interleavedzerobubble") and m % rounds:
        return (f"runs the microbatches in rounds of pp = {pp}, so their count must be a multiple of the "
                f"{rounds} rounds (torch refuses {m})")
    return ""


def _check_microbatches(schedule: str, pp: int, local_batch: int, mb: int) -> None:
    """The microbatch counts torch's schedules refuse (torch_refuses), in the recipe's fields, with
    the nearest larger local batch it takes."""
    m = local_batch // mb
    refused = torch_refuses(schedule, pp, m)
    if not refused:
        return
    fit = next(n for n in range(m + 1, 2 * m + 2 * pp + 1) if not torch_refuses(schedule, pp, n))
    raise RecipeError(
        f"[parallelism] pipeline_parallel_schedule = {schedule!r} {refused}, and [training] local_batch_size = "
        f"{local_batch} / [parallelism] pipeline_parallel_microbatch_size = {mb} gives {m}: set local_batch_size "
        f"to {fit * mb}"
    )
