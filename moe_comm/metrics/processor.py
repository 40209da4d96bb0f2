"""TorchTitan's MetricsProcessor plus the MoE comm breakdown, the right MFU peak, a JSONL file
and one console line per step.

It extends, not replaces, TorchTitan's processor: TorchTitan still computes loss, tokens/s,
TFLOPS, MFU and memory and sends them to its loggers; we pass our numbers in as its
`extra_metrics`, set the peak MFU divides by, add a JSONL logger next to W&B/TensorBoard, and
build the console's step line (moe_comm.metrics.step_line) from TorchTitan's metrics and ours.
TorchTitan's own step line still goes to the rank's log file (moe_comm.console). Under
pipeline parallelism the stages share their loss and comm (moe_comm.metrics.pipeline).

"Comm not hidden" (moe_comm/comm_exposed(%)) = time the compute stream spends inside dispatch
and combine (no overlap) or waiting for them (under [moe_comm] overlap or DualPipeV's EP
overlap), forward and backward, all MoE layers (moe_comm/comm_exposed_ms), over the wall time of
a step (moe_comm/step_ms); under an overlap moe_comm/comm_hidden(%) is the share of the comm
time (moe_comm/comm_ms) the compute stream did not wait for. See moe_comm.metrics.instrumented
for how both are measured.
"""

import json
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torchtitan.tools.utils as titan_utils
from torchtitan.components.metrics import (
    _get_metrics_rank,
    BaseLogger,
    LoggerContainer,
    MetricsProcessor,
)
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import Color, NoColor

from moe_comm import console, titan_fields
from moe_comm.backends import backend_class
from moe_comm.kernels import call_graphs, emulated_link
from moe_comm.metrics import history, keys, naming
from moe_comm.metrics.expert_counts import ExpertCountLog
from moe_comm.metrics.instrumented import instrumented_backends, summarize
from moe_comm.metrics.peaks import Peak, resolve_peak
from moe_comm.metrics.pipeline import PipelineStages
from moe_comm.metrics.step_line import format_duration, StepLine

JSONL_NAME = keys.JSONL_NAME


def _jsonable(value: Any) -> Any:
    """JSON has no NaN/inf: write null, so every line parses with any JSON reader."""
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlLogger(BaseLogger):
    """One JSON object per logged step: {"step", "time", static run fields, every metric}."""

    def __init__(self, path: str, static_fields: dict[str, Any]):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self.static_fields = static_fields
        # appended to the rows up to the step the run resumes from (moe_comm.metrics.history
        # moved any later ones aside first); flushed per line for crashed runs
        self._file = open(path, "a")
        logger.info(f"Per-step metrics (JSONL): {path}")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, "time": time.time(), **self.static_fields}
        record.update({k: _jsonable(v) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class _KeepLast(BaseLogger):
    """In front of TorchTitan's loggers: keeps the metrics dict its MetricsProcessor.log just
    computed (tokens/s, MFU, memory), on every rank, for the step line. It adds the MFU against
    the bf16 peak as TorchTitan's own MFU rescaled by the two peaks, so both figures come from the
    one tokens/s (timing tokens/s a second time put them up to a percent apart under load)."""

    def __init__(self, inner: BaseLogger, peak: Peak):
        self.inner = inner
        self.bf16_per_peak = peak.tflops / peak.bf16_tflops
        self.metrics: dict[str, Any] = {}

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if keys.MFU in metrics:
            metrics = {**metrics, keys.MFU_BF16: metrics[keys.MFU] * self.bf16_per_peak}
        self.metrics = dict(metrics)
        self.inner.log(metrics, step)

    def close(self) -> None:
        self.inner.close()


class MoECommMetricsProcessor(MetricsProcessor):
    def __init__(self, job_config, parallel_dims, tag: str | None = None):
        self.moe_comm = naming.moe_comm_config(job_config)
        self.jsonl_path = os.path.join(job_config.job.dump_folder, JSONL_NAME)
        # one row per step (moe_comm.metrics.history), settled before W&B opens its run
        rank = dist.get_rank() if dist.is_initialized() else 0
        start = (history.begin(self.jsonl_path, history.start_step(job_config))
                 if rank == _get_metrics_rank(parallel_dims, job_config) else None)
        if job_config.metrics.enable_wandb:
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", parallel_dims.world_size))
            naming.set_wandb_env_defaults(job_config, parallel_dims.world_size // per_node, per_node,
                                          superseded=bool(start and start.moved))
            # W&B's own banner and end-of-run summary are some thirty console lines; the header
            # says where the run goes and the footer prints an offline run's `wandb sync`.
            os.environ.setdefault("WANDB_SILENT", "true")
        super().__init__(job_config, parallel_dims, tag)
        self.color = Color() if console.use_color() and not job_config.metrics.disable_color_printing else NoColor()
        self.on_cpu = titan_utils.device_type == "cpu"

        self.peak = resolve_peak(
            self.device_memory_monitor.device_name,
            job_config.model.converters,
            self.moe_comm.peak_tflops,
        )
        self.gpu_peak_flops = self.peak.flops
        if self.peak.warning and self.device_memory_monitor.device_name != "CPU":  # the header says it
            logger.warning(f"MFU: {self.peak.warning}")

        self.static_fields = {
            keys.RECIPE: naming.recipe_name(job_config),
            keys.BACKEND: self.moe_comm.backend,
            keys.BACKEND_OPTIONS: naming.backend_options(self.moe_comm),
            keys.DEVICE: self.device_memory_monitor.device_name,
            keys.PEAK_DTYPE: self.peak.dtype,
            keys.EP_SIZE: job_config.parallelism.expert_parallel_degree,
            keys.WORLD_SIZE: parallel_dims.world_size,
            keys.LOCAL_BATCH: job_config.training.local_batch_size,
            keys.SEQ_LEN: job_config.training.seq_len,
            keys.SENDS_PER: "rank" if backend_class(self.moe_comm.backend).sends_once_per_rank else "expert",
        }
        # a benchmark's emulated network link: the nvshmem backend runs one at EP 1 (and refuses
        # one at EP > 1); another backend ignores the setting, which the header says
        link = emulated_link.from_environ()
        self.emulated_link = link if self.moe_comm.backend == "nvshmem" else None
        self.emulated_link_ignored = link is not None and self.emulated_link is None
        if self.emulated_link is not None:
            self.static_fields[keys.EMULATED_LINK] = self.emulated_link.describe()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.metrics_rank = _get_metrics_rank(parallel_dims, job_config)
        self.is_metrics_rank = self.rank == self.metrics_rank
        if self.is_metrics_rank:
            if not isinstance(self.logger, LoggerContainer):
                self.logger = LoggerContainer()  # TorchTitan's no-op logger: nothing enabled
            self.logger.add_logger(JsonlLogger(self.jsonl_path, self.static_fields))
        self.wandb_sync_dir, wandb_url = self._decorate_wandb_run(job_config, parallel_dims.world_size)
        self.logger = _KeepLast(self.logger, self.peak)
        self.stages = PipelineStages(parallel_dims, job_config) if parallel_dims.pp_enabled else None
        self.log_path = console.open_log_file(job_config.job.dump_folder, self.rank)

        self._started = time.perf_counter()
        # TorchTitan's (train.py): each step loads this many batches, one data_loading_times entry each
        self._accumulation = titan_fields.accumulation_steps(job_config.training, parallel_dims.dp_replicate,
                                                             parallel_dims.dp_shard)
        self._first_batch = False
        self._last_logged_step: int | None = None  # None until this process logs: a resumed run starts past 0
        self._first_log: tuple[int, float] | None = None  # (step, time) of the first log line
        self._losses: list[float] = []
        self._step_seconds: list[float] = []
        # When the previous log call began: steps are timed from one call's start to the next's,
        # the same point of every step. Timed from the previous call's end (TorchTitan's
        # time_last_log), a step lost what the log call itself takes (the MoE summary, the
        # metrics' writing): 0.364 s against 0.375 s of wall time between steps in the one-GPU
        # recipe (results/h200x1/README.md, run 44).
        self._log_began: float | None = None
        self.expert_counts = None
        if self.moe_comm.log_expert_counts:  # attached when TorchTitan hands over its optimizers
            t = job_config.training
            self.expert_counts = ExpertCountLog(job_config.job.dump_folder, self.rank, {
                "world_size": parallel_dims.world_size, "ep": parallel_dims.ep,
                "tokens_per_step": t.local_batch_size * t.seq_len * self._accumulation,
                "recipe": self.static_fields[keys.RECIPE], "flavor": job_config.model.flavor})
        for line in self._header(wandb_url):
            console.show(line)
        if start and start.moved:
            console.show(f"moe_comm: {start.message(self.jsonl_path)}")
        console.watch.start("setting up the model (sharding, weight init, checkpoint load)")

    # TorchTitan assigns its OptimizersContainer here after building it (train.py), and the model
    # parts just after: the expert counts are read before each of its steps.
    @property
    def optimizers(self):
        return self.__dict__.get("_optimizers")

    @optimizers.setter
    def optimizers(self, value) -> None:
        self.__dict__["_optimizers"] = value
        if value is not None and getattr(self, "expert_counts", None) is not None:
            self.expert_counts.attach(value, lambda: self.model_parts)

    # TorchTitan's batch generator adds each batch's tokens here: the processor's only per-batch
    # signal. The first one marks where this process starts training, after model set-up and
    # checkpoint load, so the first step's time (s/step, TorchTitan's tokens/s and MFU) is the
    # step's own, also after a resume.
    @property
    def ntokens_since_last_log(self) -> int:
        return self.__dict__.get("_ntokens", 0)

    @ntokens_since_last_log.setter
    def ntokens_since_last_log(self, value: int) -> None:
        if value > 0 and not self._first_batch:
            self._first_batch = True
            self.time_last_log = time.perf_counter()
        self.__dict__["_ntokens"] = value

    def _steps_since_log(self) -> int:
        """Training steps since the previous log line (or since this process started training):
        the batches TorchTitan loaded since then over the batches of one step. Counting by step
        numbers would count a resumed run's checkpointed steps as run here (11 steps in the first
        line after resuming at step 10: 0.5 s/step against 5.5 s real)."""
        return len(self.data_loading_times) // self._accumulation

    def _decorate_wandb_run(self, job_config, world_size: int) -> tuple[str | None, str | None]:
        """Tags and our static fields on the W&B run TorchTitan opened; (its offline folder,
        its URL when online)."""
        if not (job_config.metrics.enable_wandb and self.is_metrics_rank):
            return None, None
        try:
            import wandb
        except ImportError:  # TorchTitan has already logged that W&B is off for this reason
            return None, None
        if wandb.run is None:
            return None, None
        wandb.run.tags = tuple(naming.run_tags(job_config, world_size))
        wandb.run.config.update({"moe_comm_run": self.static_fields}, allow_val_change=True)
        if wandb.run.settings.mode == "offline":
            return wandb.run.settings.sync_dir, None
        return None, wandb.run.url

    def _header(self, wandb_url: str | None) -> list[str]:
        """Two lines: what runs where, and where its numbers go."""
        pd, jc = self.parallel_dims, self.job_config
        layout = ", ".join(
            f"{name} {degree}"
            for name, degree in (("pp", pd.pp), ("dp_replicate", pd.dp_replicate), ("dp_shard", pd.dp_shard),
                                 ("cp", pd.cp), ("tp", pd.tp), ("ep", pd.ep))
            if degree > 1
        ) or "one rank"
        backend = self.moe_comm.backend
        if "num_sms" in backend_class(backend).IDENTITY_OPTIONS:  # it has an SM budget
            backend += f" ({self.moe_comm.num_sms} SMs)"
        device = self.device_memory_monitor.device_name
        run = (
            f"moe_comm: {self.static_fields[keys.RECIPE]}, backend {backend}, "
            f"{pd.world_size} x {device} ({layout}), {jc.training.steps} steps"
        )
        if self.emulated_link is not None:
            run += f"; EMULATED network: {self.emulated_link.label()}"
        elif self.emulated_link_ignored:
            run += (f"; {emulated_link.ENV} is set but backend {self.moe_comm.backend} emulates no link (only "
                    "nvshmem at EP 1 does): its comm is its own")
        if device == "CPU":
            mfu = "MFU n/a on CPU"
        elif not self.peak.known:
            mfu = f"MFU n/a: no peak known for {device!r} (set [moe_comm] peak_tflops)"
        else:
            mfu = f"MFU against {self.peak.tflops:g} TFLOPS dense {self.peak.dtype} ({self.peak.source})"
            if self.peak.dtype != "bf16":
                mfu += f"; against the bf16 peak in {keys.MFU_BF16}"
        where = f"metrics {self.jsonl_path}" + ("" if self.is_metrics_rank else f" (rank {self.metrics_rank})")
        if jc.metrics.enable_wandb:
            if not self.is_metrics_rank:
                where += f", W&B from rank {self.metrics_rank}"
            elif wandb_url:
                where += f", W&B {wandb_url}"
            elif self.wandb_sync_dir:
                where += ", W&B offline (the sync command comes at the end)"
        if self.log_path:
            where += f", full log {self.log_path}"
        return [run, f"moe_comm: {mfu}; {where}"]

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ):
        console.watch.stop()
        steps = self._steps_since_log() or max(step - (self._last_logged_step or 0), 1)
        began = time.perf_counter()
        since = self._log_began if self._log_began is not None else self.time_last_log
        step_s = (began - since) / steps
        self._log_began = began
        backends = instrumented_backends()
        mine = summarize(backends, steps)  # this rank's MoE layers (collective over its EP group)
        if mine:
            mine[keys.STEP_MS] = 1e3 * step_s
            mine[keys.COMM_EXPOSED_PCT] = 100 * mine[keys.COMM_EXPOSED_MS] / mine[keys.STEP_MS]
        ours = dict(mine)
        if self.stages:
            global_avg_loss, global_max_loss, ours = self.stages.gather(
                global_avg_loss, global_max_loss, mine, len(backends), 1e3 * step_s
            )
        ours[keys.STEP_MS] = 1e3 * step_s
        if keys.COMM_MS in ours:
            comm_s = ours[keys.COMM_MS] / 1e3
            ours[keys.COMM_BW] = ours[keys.SENT_GB] / comm_s if comm_s > 0 else math.nan
        ours[keys.PEAK_TFLOPS] = self.peak.tflops
        super().log(
            step,
            global_avg_loss,
            global_max_loss,
            grad_norm,
            extra_metrics={**(extra_metrics or {}), **ours},
        )
        console.show(self._step_line(step, global_avg_loss, grad_norm, step_s, mine).format(self.color))
        if self.expert_counts is not None:
            self.expert_counts.write(step)
        self._losses.append(global_avg_loss)
        self._step_seconds.append((step, step_s))
        self._last_logged_step = step

    def _step_line(self, step: int, loss: float, grad_norm: float, step_s: float, mine: dict) -> StepLine:
        titan = self.logger.metrics  # what TorchTitan's log just computed
        now = time.time()
        if self._first_log is None:
            self._first_log = (step, now)
            eta_s = None
        else:
            first_step, first_time = self._first_log
            eta_s = (now - first_time) / (step - first_step) * (self.job_config.training.steps - step)
        measured = keys.COMM_MS in mine
        if measured:
            note = ""
        elif os.environ.get("MOE_COMM_INSTRUMENT", "1") == "0":
            note = "MOE_COMM_INSTRUMENT=0"
        else:
            note = "no MoE layer on this rank, or MoE comm inside torch.compile"
        return StepLine(
            step=step,
            total_steps=self.job_config.training.steps,
            seconds_per_step=step_s,
            eta_s=eta_s,
            loss=loss,
            grad_norm=grad_norm,
            tokens_per_s=titan[keys.TPS],
            mfu_pct=titan[keys.MFU],
            peak=self.peak,
            mem_gib=None if self.on_cpu else titan[keys.MEM_RESERVED],
            mem_pct=None if self.on_cpu else titan["memory/max_reserved(%)"],
            dispatch_ms=mine[keys.DISPATCH_MS] if measured else None,
            combine_ms=mine[keys.COMBINE_MS] if measured else None,
            comm_pct=mine[keys.COMM_EXPOSED_PCT] if measured else None,
            hidden_pct=mine.get(keys.COMM_HIDDEN_PCT),
            comm_note=note,
            pp_stage=(self.stages.rank, self.stages.size) if self.stages else None,
            first_step=console.watch.summary() if len(self._losses) == 0 else "",
            emulated_link=self.emulated_link is not None,
        )

    def close(self):
        console.watch.stop()
        # TorchTitan closes the trainer from `finally`-like code on both paths (train.py main:
        # `except Exception: trainer.close(); raise`), so an exception being handled here is the
        # one that ends the run.
        failure = sys.exc_info()[1]
        if self.expert_counts is not None:
            self.expert_counts.close()
        super().close()
        backends = instrumented_backends()
        if backend_class(self.moe_comm.backend).call_graphs and backends:  # how its calls ran (moe_comm.kernels.call_graphs)
            layers = [b.graphs for b in backends if getattr(b, "graphs", None) is not None]
            console.show(f"moe_comm: {call_graphs.summary(layers, self.moe_comm.cuda_graphs)}")
        console.show(self._footer(failure))
        if self.wandb_sync_dir:
            console.show(f"W&B run saved offline. Upload it with: wandb sync {self.wandb_sync_dir}")

    def _rate(self) -> str:
        """'; median 0.52 s/step over steps 3-5 (after a 2-step warm-up)': the steps `report`
        takes its medians over (moe_comm.metrics.history.steady_steps), named."""
        if not self._step_seconds:
            return ""
        by_step = dict(self._step_seconds)
        window = history.steady_steps(sorted(by_step))
        seconds = [by_step[s] for s in window]
        if window[0] <= history.WARMUP_STEPS:
            return f"; {seconds[-1]:.2f} s/step: {history.window_text(window)}"
        return f"; median {statistics.median(seconds):.2f} s/step over {history.window_text(window)}"

    def _footer(self, failure: BaseException | None) -> str:
        """One line: done, stopped early, or failed, and where (see close)."""
        total = self.job_config.training.steps
        took = format_duration(time.perf_counter() - self._started)
        loss = f"; loss {self._losses[0]:.4f} -> {self._losses[-1]:.4f}" if self._losses else ""
        if self._last_logged_step is None:  # no step line yet: set-up, checkpoint load, the first step
            where = "before its first step line (set-up, checkpoint load or the first step)"
            completed = None
        else:
            batches = len(self.data_loading_times)  # since the last step line
            completed = self._last_logged_step + batches // self._accumulation
            # failing, the last step whose batches were loaded is the one that was running
            started = self._last_logged_step + -(-batches // self._accumulation)
            where = f"in step {started}/{total}" if batches else f"after step {self._last_logged_step}/{total}"
        if failure is not None:
            what = str(failure).strip().splitlines()[0] if str(failure).strip() else ""
            console.failure_shown = len(what) <= 300  # else the rank's last line says it whole
            what = what[:300]
            return (f"moe_comm: FAILED {where} after {took}: {type(failure).__name__}"
                    + (f": {what}" if what else "") + f"{loss}; the rank logs are in "
                    f"{os.path.join(self.job_config.job.dump_folder, 'logs')}")
        if completed is None:
            return (f"moe_comm: no training step ran in {took} (the checkpoint it resumed may already be at "
                    f"[training] steps = {total})")
        rate = self._rate()
        if completed < total:
            return (f"moe_comm: stopped early at step {completed}/{total} in {took} (TorchTitan ended the "
                    f"loop: see its warning above){loss}{rate}")
        return f"moe_comm: done at step {completed}/{total} in {took}{loss}{rate}"


def build_metrics_processor(
    job_config, parallel_dims, model_args=None, tag: str | None = None
) -> MoECommMetricsProcessor:
    """TorchTitan's `build_metrics_processor_fn` signature (torchtitan/components/metrics.py)."""
    return MoECommMetricsProcessor(job_config, parallel_dims, tag)
