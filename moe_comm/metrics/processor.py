"""TorchTitan's MetricsProcessor plus the MoE comm breakdown, the right MFU peak and a JSONL file.

It extends, not replaces, TorchTitan's processor: TorchTitan still computes loss, tokens/s,
TFLOPS, MFU and memory and sends them to its loggers; we pass our numbers in as its
`extra_metrics`, set the peak MFU divides by, add a JSONL logger next to W&B/TensorBoard, and
print a second console line with the comm breakdown right after TorchTitan's.

"Comm not hidden" (moe_comm/comm_exposed(%)) = time the compute stream spends inside dispatch
and combine, forward and backward, all MoE layers (moe_comm/comm_ms), over the wall time of a
step (moe_comm/step_ms). See moe_comm.metrics.instrumented for how the intervals are measured.
"""

import json
import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.metrics import (
    _get_metrics_rank,
    BaseLogger,
    LoggerContainer,
    MetricsProcessor,
)
from torchtitan.tools.logging import logger

from moe_comm.metrics import keys, naming
from moe_comm.metrics.instrumented import instrumented_backends, SENDS_ONCE_PER_RANK, summarize
from moe_comm.metrics.peaks import resolve_peak

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
        # appended, so a requeued job that resumes from a checkpoint keeps the first attempt's
        # steps (readers keep the last record of a step); flushed per line for crashed runs
        self._file = open(path, "a")
        logger.info(f"Per-step metrics (JSONL): {path}")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, "time": time.time(), **self.static_fields}
        record.update({k: _jsonable(v) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class MoECommMetricsProcessor(MetricsProcessor):
    def __init__(self, job_config, parallel_dims, tag: str | None = None):
        self.moe_comm = naming.moe_comm_config(job_config)
        if job_config.metrics.enable_wandb:
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", parallel_dims.world_size))
            naming.set_wandb_env_defaults(job_config, parallel_dims.world_size // per_node, per_node)
        super().__init__(job_config, parallel_dims, tag)

        self.peak = resolve_peak(
            self.device_memory_monitor.device_name,
            job_config.model.converters,
            self.moe_comm.peak_tflops,
        )
        self.gpu_peak_flops = self.peak.flops
        if self.peak.warning:
            logger.warning(f"{self.color.yellow}MFU: {self.peak.warning}{self.color.reset}")
        else:
            logger.info(f"MFU against {self.peak.tflops:g} TFLOPS dense {self.peak.dtype} ({self.peak.source})")

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
            keys.SENDS_PER: "rank" if self.moe_comm.backend in SENDS_ONCE_PER_RANK else "expert",
        }
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.is_metrics_rank = rank == _get_metrics_rank(parallel_dims, job_config)
        if self.is_metrics_rank:
            if not isinstance(self.logger, LoggerContainer):
                self.logger = LoggerContainer()  # TorchTitan's no-op logger: nothing enabled
            self.jsonl_path = os.path.join(job_config.job.dump_folder, JSONL_NAME)
            self.logger.add_logger(JsonlLogger(self.jsonl_path, self.static_fields))
        self.wandb_sync_dir = self._decorate_wandb_run(job_config, parallel_dims.world_size)
        self._last_logged_step = 0

    def _decorate_wandb_run(self, job_config, world_size: int) -> str | None:
        """Tags and our static fields on the W&B run TorchTitan opened; its offline folder."""
        if not (job_config.metrics.enable_wandb and self.is_metrics_rank):
            return None
        try:
            import wandb
        except ImportError:  # TorchTitan has already logged that W&B is off for this reason
            return None
        if wandb.run is None:
            return None
        wandb.run.tags = tuple(naming.run_tags(job_config, world_size))
        wandb.run.config.update({"moe_comm_run": self.static_fields}, allow_val_change=True)
        return wandb.run.settings.sync_dir if wandb.run.settings.mode == "offline" else None

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ):
        steps = max(step - self._last_logged_step, 1)
        time_delta = time.perf_counter() - self.time_last_log
        ours = summarize(instrumented_backends(), steps)
        if ours:
            ours[keys.STEP_MS] = 1e3 * time_delta / steps
            ours[keys.COMM_EXPOSED_PCT] = 100 * ours[keys.COMM_MS] / ours[keys.STEP_MS]
            comm_s = ours[keys.COMM_MS] / 1e3
            ours[keys.COMM_BW] = ours[keys.SENT_GB] / comm_s if comm_s > 0 else math.nan
        # TorchTitan's tokens/s formula, for the second MFU against the bf16 peak; timed just
        # before TorchTitan times it (after the summary's all-reduce), so both agree closely
        tps = self.ntokens_since_last_log / (
            (time.perf_counter() - self.time_last_log) * self.parallel_dims.non_data_parallel_size
        )
        ours[keys.PEAK_TFLOPS] = self.peak.tflops
        ours[keys.MFU_BF16] = 100 * self.num_flops_per_token * tps / (self.peak.bf16_tflops * 1e12)
        super().log(
            step,
            global_avg_loss,
            global_max_loss,
            grad_norm,
            extra_metrics={**(extra_metrics or {}), **ours},
        )
        logger.info(self._console_line(step, ours))
        if self._last_logged_step == 0:
            logger.info(
                f"mfu(%) divides by {self.peak.tflops:g} TFLOPS ({self.peak.dtype}, {self.peak.source}); "
                "TorchTitan's start-up line 'Peak FLOPS used for computing MFU' is its own table "
                "and is not what is logged"
            )
        self._last_logged_step = step

    def _console_line(self, step: int, m: dict[str, Any]) -> str:
        c = self.color
        line = f"{c.red}step: {step:2}  {c.yellow}moe_comm[{self.moe_comm.backend}]"
        if keys.COMM_MS in m:
            line += (
                f"  {c.blue}dispatch: {m[keys.DISPATCH_MS]:.2f}ms"
                f"  combine: {m[keys.COMBINE_MS]:.2f}ms"
                f"  {c.cyan}comm: {m[keys.COMM_EXPOSED_PCT]:.1f}% of {m[keys.STEP_MS]:.0f}ms step"
                f"  {c.orange}imbalance rank/expert: {m[keys.IMBALANCE_RANK]:.2f}"
                f"/{m[keys.IMBALANCE_EXPERT]:.2f}"
                f"  {c.turquoise}sent: {m[keys.SENT_GB]:.3f}GB"
            )
        else:
            line += "  comm not measured (no EP, MoE comm inside torch.compile, or MOE_COMM_INSTRUMENT=0)"
        if not self.peak.known:
            line += f"  {c.magenta}mfu: n/a (unknown GPU; set [moe_comm] peak_tflops)"
        elif self.peak.dtype != "bf16":
            line += f"  {c.magenta}mfu vs {self.peak.dtype} peak; vs bf16 peak: {m[keys.MFU_BF16]:.2f}%"
        return line + c.reset

    def close(self):
        super().close()
        if self.wandb_sync_dir:
            logger.info(f"W&B run saved offline. Upload it with: wandb sync {self.wandb_sync_dir}")


def build_metrics_processor(
    job_config, parallel_dims, model_args=None, tag: str | None = None
) -> MoECommMetricsProcessor:
    """TorchTitan's `build_metrics_processor_fn` signature (torchtitan/components/metrics.py)."""
    return MoECommMetricsProcessor(job_config, parallel_dims, tag)
