"""An emulated network link on one GPU, to measure how much of a link's time an overlap hides
when only one GPU is lent (issue 37 item 4). A benchmark's setting, never a recipe's.

With `MOE_COMM_EMULATED_LINK` set, every dispatch and combine of the nvshmem backend at EP 1
(one rank holds every expert: nothing crosses a link) also holds its `num_sms` SMs on the stream
it runs on, for as long as its bytes would take on the emulated link
(csrc/internode/emulated_link.cu): forward and backward, on the comm stream under an overlap.
The value gives the time of a full call, one that carries `tokens` tokens (default: every call
the full time); a call with fewer tokens (a chunk of the chunked overlap) holds in proportion:

    MOE_COMM_EMULATED_LINK="dispatch_us=1450,combine_us=1450,tokens=8192"
    MOE_COMM_EMULATED_LINK="dispatch_bytes=6.2e7,combine_bytes=6.2e7,gbps=43,tokens=8192"

The second form gives a call's network bytes and the link's rate (GB/s); experiments/
emulated_link.py takes them from the scale model's transfers of the flagship rank. Dispatch-like
calls (dispatch, combine's backward) hold `dispatch`'s time, combine-like ones (combine,
dispatch's backward) `combine`'s.

Everything an emulated run produces says so: the JSONL's static field `emulated_link`, the
header and the step line (moe_comm.metrics.processor), the benchmark's results.
"""

import math
import os
from dataclasses import dataclass

import torch

from moe_comm.kernels.limits import LIMITS

ENV = "MOE_COMM_EMULATED_LINK"
# the backward of each kind moves the same rows the other way: the other kind's transfer
BACKWARD_KIND = {"dispatch": "combine", "combine": "dispatch"}


def hold_us_for_bytes(nbytes: float, gbps: float) -> float:
    """Microseconds `nbytes` take at `gbps` GB/s (1e9 bytes per second)."""
    return nbytes / (gbps * 1e3)


@dataclass(frozen=True)
class EmulatedLink:
    dispatch_us: float  # one full dispatch-like call
    combine_us: float  # one full combine-like call
    tokens: int = 0  # tokens of a full call; 0: every call holds the full time
    source: str = ""  # the setting as given

    def hold_ns(self, kind: str, tokens: int) -> int:
        """Nanoseconds a `kind` call carrying `tokens` tokens holds its SMs."""
        full_us = self.dispatch_us if kind == "dispatch" else self.combine_us
        share = min(1.0, tokens / self.tokens) if self.tokens else 1.0
        return round(full_us * share * 1e3)

    def describe(self) -> dict:
        """What the JSONL and W&B carry (the `emulated_link` static field)."""
        return {"emulated": True, "dispatch_us_per_call": self.dispatch_us, "combine_us_per_call": self.combine_us,
                "tokens_per_full_call": self.tokens, "setting": f"{ENV}={self.source}"}

    def label(self) -> str:
        per = f" per call of {self.tokens} tokens" if self.tokens else " per call"
        return f"emulated link: dispatch {self.dispatch_us:g} us, combine {self.combine_us:g} us{per}"


def parse(text: str) -> EmulatedLink:
    """`dispatch_us=..,combine_us=..[,tokens=..]` or `dispatch_bytes=..,combine_bytes=..,gbps=..[,tokens=..]`."""
    fields = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        try:
            fields[name.strip()] = float(value)
        except ValueError:
            fields[name.strip()] = math.nan
        if not eq or not math.isfinite(fields[name.strip()]) or fields[name.strip()] < 0:
            raise ValueError(f"{ENV}={text!r}: {part!r} is not NAME=NUMBER (a number >= 0)")
    usage = (f"{ENV} takes dispatch_us=..,combine_us=.. or dispatch_bytes=..,combine_bytes=..,gbps=.. "
             "(each optionally with tokens=..., the tokens of a full call)")
    times, sizes = {"dispatch_us", "combine_us"}, {"dispatch_bytes", "combine_bytes", "gbps"}
    if set(fields) - {"tokens"} == times:
        d, c = fields["dispatch_us"], fields["combine_us"]
    elif set(fields) - {"tokens"} == sizes and fields["gbps"] > 0:
        d, c = (hold_us_for_bytes(fields[k], fields["gbps"]) for k in ("dispatch_bytes", "combine_bytes"))
    else:
        raise ValueError(f"{ENV}={text!r}: {usage}")
    bound = LIMITS.max_emulated_hold_us
    if max(d, c) > bound:
        raise ValueError(f"{ENV}={text!r}: a call would hold {max(d, c):g} us; the emulated link holds at most {bound} "
                         "us per call")
    return EmulatedLink(d, c, int(fields.get("tokens", 0)), text)


def from_environ(environ=os.environ) -> EmulatedLink | None:
    text = environ.get(ENV, "")
    return parse(text) if text else None


def for_backend(ep_size: int, environ=os.environ) -> EmulatedLink | None:
    """The link an nvshmem backend emulates: None without the setting; refused where a real
    link exists (EP > 1), which an emulated one would only add to."""
    link = from_environ(environ)
    if link is not None and ep_size > 1:
        raise RuntimeError(f"{ENV} emulates the network of a one-GPU run (EP 1); this run has EP {ep_size}, whose "
                           f"links are real: unset {ENV}")
    return link


class _Hold(torch.autograd.Function):
    """Identity on a comm op's output that holds the SMs after the op, and in the backward
    before the op's backward (the backward of a dispatch is combine-like, and the other way)."""

    @staticmethod
    def forward(ctx, out, link: EmulatedLink, kind: str, tokens: int, num_sms: int):
        ctx.link, ctx.kind, ctx.tokens, ctx.num_sms = link, kind, tokens, num_sms
        torch.ops.moe_comm.emulated_link(num_sms, link.hold_ns(kind, tokens))
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        torch.ops.moe_comm.emulated_link(ctx.num_sms, ctx.link.hold_ns(BACKWARD_KIND[ctx.kind], ctx.tokens))
        return grad, None, None, None, None


def hold(out: torch.Tensor, link: EmulatedLink | None, kind: str, tokens: int, num_sms: int) -> torch.Tensor:
    """`out` (what a `kind` op just returned), with the emulated transfer after it."""
    if link is None:
        return out
    return _Hold.apply(out, link, kind, tokens, num_sms)
