"""The one console line per logged step, on CPU and GPU alike.

    step 3/5  1.91 s/step  eta 0:04  loss 6.2380  gnorm 7.46  tok/s 268  mfu n/a  mem n/a  dispatch 47.5ms combine 28.3ms (4.0% of step)
    step  40/100  0.73 s/step  eta 0:44  loss 3.5244  gnorm 0.41  tok/s 22,620  mfu 43.7% of 989 TFLOPS bf16  mem 134.6GiB (96%)  dispatch 4.1ms combine 3.2ms (1.0% of step)

It replaces TorchTitan's step line and the comm line this package used to print after it:
the loss, gradient norm, tokens/s and memory are TorchTitan's own numbers; the MFU is the one
moe_comm.metrics.peaks defines (named with its peak and dtype, so a float8 run's figure reads
as what it is); dispatch/combine are this rank's MoE comm (forward + backward, all its MoE
layers) and the share of the step the compute stream spent inside them, or under an overlap
waiting for them, with the share of the comm time hidden beside it (and "emulated link" when a
benchmark ran the comm over one: moe_comm.kernels.emulated_link). Under pipeline
parallelism the line names the rank's pipeline rank (`pp1 of 8`): the comm is that rank's
stages', the loss the last stage's.
"""

import math
from dataclasses import dataclass

from torchtitan.tools.utils import NoColor

from moe_comm.metrics.peaks import Peak


def format_duration(seconds: float) -> str:
    """H:MM:SS, or M:SS under an hour."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


@dataclass
class StepLine:
    step: int
    total_steps: int
    seconds_per_step: float  # wall time per step since the previous log line
    eta_s: float | None  # None before a steady rate is known (the first logged step)
    loss: float
    grad_norm: float
    tokens_per_s: float  # per GPU (TorchTitan's throughput(tps))
    mfu_pct: float  # against `peak`
    peak: Peak
    mem_gib: float | None  # max reserved; None where the device reports none (CPU)
    mem_pct: float | None
    dispatch_ms: float | None  # None when the comm was not measured (then comm_note says why)
    combine_ms: float | None
    comm_pct: float | None
    comm_note: str = ""
    hidden_pct: float | None = None  # under an overlap: share of the comm time hidden
    pp_stage: tuple[int, int] | None = None  # (this rank's pipeline rank, pipeline degree)
    first_step: str = ""  # one-time work inside this step (torch.compile, backend start-up)
    emulated_link: bool = False  # the comm ran over an emulated network link (a benchmark's)

    def format(self, color=NoColor()) -> str:
        c = color
        width = len(str(self.total_steps))
        parts = [f"{c.red}step {self.step:>{width}}/{self.total_steps}{c.reset}"]
        if self.pp_stage:
            parts.append(f"pp{self.pp_stage[0]} of {self.pp_stage[1]}")
        parts.append(f"{self.seconds_per_step:.2f} s/step")
        parts.append("eta " + (format_duration(self.eta_s) if self.eta_s is not None else "--"))
        parts.append(f"{c.green}loss {self.loss:.4f}{c.reset}")
        parts.append(f"gnorm {self.grad_norm:.2f}")
        parts.append(f"{c.blue}tok/s {self.tokens_per_s:,.0f}{c.reset}")
        if self.peak.known and not math.isnan(self.mfu_pct):
            mfu = f"{self.mfu_pct:.1f}% of {self.peak.tflops:g} TFLOPS {self.peak.dtype}"
        else:
            mfu = "n/a"
        parts.append(f"{c.magenta}mfu {mfu}{c.reset}")
        mem = "n/a" if self.mem_gib is None else f"{self.mem_gib:.1f}GiB ({self.mem_pct:.0f}%)"
        parts.append(f"{c.turquoise}mem {mem}{c.reset}")
        if self.dispatch_ms is None:
            parts.append(f"{c.cyan}comm n/a ({self.comm_note}){c.reset}")
        else:
            hidden = "" if self.hidden_pct is None else f", {self.hidden_pct:.0f}% hidden"
            hidden += ", emulated link" if self.emulated_link else ""
            parts.append(
                f"{c.cyan}dispatch {self.dispatch_ms:.1f}ms combine {self.combine_ms:.1f}ms "
                f"({self.comm_pct:.1f}% of step{hidden}){c.reset}"
            )
        line = "  ".join(parts)
        if self.first_step:
            line += f"  (first step: {self.first_step})"
        return line
