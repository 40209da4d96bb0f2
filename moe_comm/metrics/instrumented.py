"""Time and count a backend's dispatch/combine without adding host synchronisation.

`instrument(backend)` returns an `InstrumentedBackend`: the same interface, delegating to the
backend, that records per MoE layer

- time: a pair of CUDA events on the current stream (the one the op runs on) around each
  forward call, and a pair around each backward (dispatch's backward moves gradients like a
  combine, combine's like a dispatch), recorded by identity autograd functions on the op's
  inputs and outputs (autograd runs them on the op's stream). Events are read when the
  metrics processor logs, after TorchTitan's `.item()` has already synced; an event not yet
  complete is kept for the next log. On CPU the clock is wall time (CPU ops are synchronous).
  The interval is that stream's time inside the op, including waits on comm kernels and host
  syncs (NCCL's split-size `.tolist()`).
  Backward intervals may include other autograd nodes the engine runs in between; forward
  intervals are exact. Activation checkpointing's recompute does not call the backend (it
  replays the forward's results: moe_comm.titan.recompute), so it adds nothing here.
- exposed time: without overlap the op runs on the compute stream, so its interval is all
  exposed. Under an overlap (moe_comm.titan.overlap) the op runs on a side stream and its
  interval is the comm's own duration there; the overlap then reports each place the compute
  stream waits for it (`record_wait`: an event on the compute stream before and after the
  wait), and only those waits count as exposed. On CPU nothing runs beside anything else, so
  the overlap reports no waits and every interval stays exposed.
- routing: routed rows per expert (device tensor, for token imbalance) and rows that leave this
  rank (device tensor, for bytes), from topk_idx_TK with scatter/sum kernels, never `.item()`.
  Counted in the first forward only (not in recomputation); backward bytes equal forward bytes.
  At EP 1 no row can leave the rank, so none are counted there (no kernels for a known zero).

- start-up: the process's first dispatch is where a backend starts its runtime (NVSHMEM
  initialisation and symmetric buffers for nvshmem); its wall time is reported on step 1's
  console line (moe_comm.console.watch), and the start-up watch names it while it runs.

Set MOE_COMM_INSTRUMENT=0 to get the bare backend back (to measure this module's cost).
"""

import dataclasses
import math
import os
import time
import weakref
from collections import defaultdict
from typing import Any, Callable

import torch
import torch.distributed as dist

from moe_comm import console
from moe_comm.backends.base import DispatchResult
from moe_comm.metrics import keys, settle

# Unread intervals kept per layer (4 per step; a log line reads them all).
MAX_PENDING_INTERVALS = 4096

PHASES = ("dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd")

Stamp = torch.cuda.Event | float

_registry: list[weakref.ref] = []
_first_dispatch_done = False


def instrument(backend):
    """Wrap `backend` so its comm is timed and counted; `MOE_COMM_INSTRUMENT=0` disables it."""
    if os.environ.get("MOE_COMM_INSTRUMENT", "1") == "0":
        return backend
    wrapped = InstrumentedBackend(backend)
    _registry.append(weakref.ref(wrapped))
    return wrapped


def instrumented_backends() -> list["InstrumentedBackend"]:
    """Live instrumented backends in creation order (the same order on every rank)."""
    alive = [ref() for ref in _registry]
    _registry[:] = [weakref.ref(b) for b in alive if b is not None]
    return [b for b in alive if b is not None]


def _stamp(device: torch.device) -> Stamp:
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _ready(stamp: Stamp) -> bool:
    # Event.query() asks whether the GPU has passed the event; it never waits.
    return isinstance(stamp, float) or stamp.query()


def _elapsed_ms(start: Stamp, end: Stamp) -> float:
    if isinstance(start, float):
        return (end - start) * 1e3
    return start.elapsed_time(end)


class _OnBackward(torch.autograd.Function):
    """Identity whose backward calls `callback(device)` when the gradient passes through."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, callback: Callable[[torch.device], None]) -> torch.Tensor:
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.callback(grad.device)
        return grad, None


class _BackwardInterval:
    """One backward pass of one op: started when the output's gradient arrives, ended when the
    input's gradient leaves (autograd runs them in that order)."""

    def __init__(self, stats: "LayerCommStats", phase: str, nbytes: torch.Tensor | None):
        self.stats = stats
        self.phase = phase
        self.nbytes = nbytes
        self.start: Stamp | None = None

    def begin(self, device: torch.device) -> None:
        self.start = _stamp(device)

    def end(self, device: torch.device) -> None:
        if self.start is None:  # the output's gradient never came through this path
            return
        self.stats.add_interval(self.phase, self.start, _stamp(device))
        if self.nbytes is not None:
            self.stats.add_bytes(self.phase, self.nbytes)
        self.start = None


class LayerCommStats:
    """What one MoE layer's backend did since the last log: intervals, expert counts, bytes."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.calls = 0  # instrumented dispatches since the last log
        self.intervals: list[tuple[str, Stamp, Stamp]] = []
        # the compute stream's waits for this layer's comm; their presence means the comm runs
        # on a side stream, and then they (not the intervals) are the exposed time
        self.waits: list[tuple[str, Stamp, Stamp]] = []
        self.overlapped = False
        self.rows_per_expert_E: torch.Tensor | None = None
        self.bytes: dict[str, torch.Tensor] = {}
        # where the counts live; until the first dispatch, where collectives would run
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def add_interval(self, phase: str, start: Stamp, end: Stamp) -> None:
        _append_bounded(self.intervals, (phase, start, end))

    def add_wait(self, phase: str, before: Stamp, after: Stamp) -> None:
        self.overlapped = True
        _append_bounded(self.waits, (phase, before, after))

    def add_bytes(self, phase: str, nbytes: torch.Tensor) -> None:
        self.bytes[phase] = self.bytes[phase] + nbytes if phase in self.bytes else nbytes

    def add_rows_per_expert(self, rows_E: torch.Tensor) -> None:
        self.device = rows_E.device
        if self.rows_per_expert_E is None:
            self.rows_per_expert_E = rows_E
        else:
            self.rows_per_expert_E += rows_E

    def take_rows_per_expert(self) -> torch.Tensor:
        rows_E = self.rows_per_expert_E
        self.rows_per_expert_E = None
        if rows_E is None:
            return torch.zeros(self.num_experts, dtype=torch.int64, device=self.device)
        return rows_E

    def take_times_ms(self) -> dict[str, float]:
        """Milliseconds per phase of the intervals whose end the device has passed."""
        times, self.intervals = _take_ms(self.intervals)
        return times

    def take_exposed_ms(self, times_ms: dict[str, float]) -> dict[str, float]:
        """Milliseconds per phase the compute stream spent on this layer's comm: `times_ms`
        (what take_times_ms just returned) when the comm runs on it, else its waits."""
        if not self.overlapped:
            return times_ms
        exposed, self.waits = _take_ms(self.waits)
        return exposed


def _append_bounded(pending: list, item) -> None:
    if len(pending) >= MAX_PENDING_INTERVALS:
        # nobody is reading (a script using a backend without our metrics processor):
        # keep memory bounded, drop the oldest half
        del pending[: MAX_PENDING_INTERVALS // 2]
    pending.append(item)


def _take_ms(pending: list) -> tuple[dict[str, float], list]:
    """(milliseconds per phase of the (phase, start, end) whose end the device has passed,
    the ones it has not passed yet)."""
    times = defaultdict(float)
    left = []
    for phase, start, end in pending:
        if _ready(end):
            times[phase] += _elapsed_ms(start, end)
        else:
            left.append((phase, start, end))
    return dict(times), left


def rows_per_expert(topk_idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routed (token, expert) pairs per expert; negative ids (masked slots) are not counted.
    scatter_add_ instead of bincount: CUDA bincount reads the max back to the host."""
    valid_TK = topk_idx_TK >= 0
    rows_E = torch.zeros(num_experts, dtype=torch.int64, device=topk_idx_TK.device)
    rows_E.scatter_add_(0, topk_idx_TK.clamp(min=0).flatten().long(), valid_TK.flatten().long())
    return rows_E


def rows_leaving_rank(
    topk_idx_TK: torch.Tensor,
    rows_E: torch.Tensor,
    ep_rank: int,
    num_local_experts: int,
    ep_size: int,
    once_per_rank: bool,
) -> torch.Tensor:
    """Rows this rank sends to other ranks in one dispatch (0-d int64 device tensor).

    once_per_rank=False (all-to-all): one row per (token, expert on another rank), i.e. all
    routed rows but those of the local experts: two reductions of the per-expert counts.
    once_per_rank=True (dedup): one row per (token, other rank hosting any of its experts).
    """
    if not once_per_rank:
        first = ep_rank * num_local_experts
        return rows_E.sum() - rows_E[first : first + num_local_experts].sum()
    valid_TK = topk_idx_TK >= 0
    # masked slots go to a dummy column ep_size, dropped below
    dest_TK = torch.where(valid_TK, topk_idx_TK // num_local_experts, ep_size).long()
    hit_TR = torch.zeros(dest_TK.shape[0], ep_size + 1, dtype=torch.bool, device=dest_TK.device)
    hit_TR.scatter_(1, dest_TK, True)
    hit_TR[:, ep_rank] = False
    return hit_TR[:, :ep_size].sum()


class InstrumentedBackend:
    """A CommBackend's interface in front of a real backend, adding timers and counters."""

    def __init__(self, backend):
        self.backend = backend
        self.name = backend.name
        self.layer = backend.layer
        self.config = backend.config
        self.ep_group = backend.ep_group
        self.ep_size = backend.ep_size
        self.ep_rank = backend.ep_rank
        self.num_local_experts = backend.num_local_experts
        # how the bytes that leave a rank are counted from the routing (the backend class says)
        self.sends_once_per_rank = backend.sends_once_per_rank
        self.stats = LayerCommStats(backend.layer.num_experts)
        # rows that left in the last dispatch; combine sends the same rows back
        self._last_rows: torch.Tensor | None = None

    def __getattr__(self, attr: str) -> Any:
        # anything backend-specific (buffers, kernel handles) is the wrapped backend's
        return getattr(self.__dict__["backend"], attr)

    def _active(self) -> bool:
        # no timing in validation (no_grad) or inside torch.compile (events would break graphs)
        return torch.is_grad_enabled() and not torch.compiler.is_compiling()

    @staticmethod
    def _first_forward() -> bool:
        # -1 outside backward; activation-checkpoint recomputation runs inside backward
        return torch._C._current_graph_task_id() == -1

    def _bytes(self, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return rows * (self.layer.hidden * x.element_size())

    def dispatch(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor
    ) -> DispatchResult:
        global _first_dispatch_done
        if not _first_dispatch_done:
            _first_dispatch_done = True
            return self._first_dispatch(x_TD, topk_idx_TK, topk_w_TK)
        if not self._active():
            return self.backend.dispatch(x_TD, topk_idx_TK, topk_w_TK)
        self.stats.calls += 1
        nbytes = None
        self._last_rows = None
        if self._first_forward():
            rows_E = rows_per_expert(topk_idx_TK, self.layer.num_experts)
            self.stats.add_rows_per_expert(rows_E)
            if self.ep_size > 1:
                self._last_rows = rows_leaving_rank(
                    topk_idx_TK,
                    rows_E,
                    self.ep_rank,
                    self.num_local_experts,
                    self.ep_size,
                    self.sends_once_per_rank,
                )
                nbytes = self._bytes(self._last_rows, x_TD)
                self.stats.add_bytes("dispatch_fwd", nbytes)
        backward = _BackwardInterval(self.stats, "dispatch_bwd", nbytes)
        if x_TD.requires_grad:
            x_TD = _OnBackward.apply(x_TD, backward.end)
        start = _stamp(x_TD.device)
        result = self.backend.dispatch(x_TD, topk_idx_TK, topk_w_TK)
        self.stats.add_interval("dispatch_fwd", start, _stamp(x_TD.device))
        recv_x_RD = result.recv_x_RD
        if recv_x_RD.requires_grad:
            recv_x_RD = _OnBackward.apply(recv_x_RD, backward.begin)
        return dataclasses.replace(result, recv_x_RD=recv_x_RD)

    def _first_dispatch(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor
    ) -> DispatchResult:
        """The process's first dispatch, timed on the host: a backend's one-time start-up."""
        console.watch.phase(f"running the first dispatch through the {self.name} backend (its one-time start-up)")
        start = time.perf_counter()
        result = self.dispatch(x_TD, topk_idx_TK, topk_w_TK)
        console.watch.add_time(f"first {self.name} dispatch", time.perf_counter() - start)
        console.watch.phase("running the first step")
        return result

    def record_wait(self, phase: str, before: Stamp, after: Stamp) -> None:
        """The compute stream waited for this layer's `phase` ("dispatch_fwd", ...) between
        events `before` and `after` on it (moe_comm.titan.overlap calls it)."""
        self.stats.add_wait(phase, before, after)

    def combine(self, y_RD: torch.Tensor, handle: Any) -> torch.Tensor:
        if not self._active():
            return self.backend.combine(y_RD, handle)
        nbytes = None
        if self._last_rows is not None:
            nbytes = self._bytes(self._last_rows, y_RD)
            self.stats.add_bytes("combine_fwd", nbytes)
            self._last_rows = None
        backward = _BackwardInterval(self.stats, "combine_bwd", nbytes)
        if y_RD.requires_grad:
            y_RD = _OnBackward.apply(y_RD, backward.end)
        start = _stamp(y_RD.device)
        out_TD = self.backend.combine(y_RD, handle)
        self.stats.add_interval("combine_fwd", start, _stamp(y_RD.device))
        if out_TD.requires_grad:
            out_TD = _OnBackward.apply(out_TD, backward.begin)
        return out_TD


def _imbalance(load_LX: torch.Tensor) -> tuple[float, float]:
    """max/mean per row of a [layers, bins] load, as (mean over layers, worst layer)."""
    load_LX = load_LX.double()
    mean_L = load_LX.mean(dim=1)
    keep_L = mean_L > 0
    if not bool(keep_L.any()):
        return float("nan"), float("nan")
    ratio_L = load_LX.max(dim=1).values[keep_L] / mean_L[keep_L]
    return ratio_L.mean().item(), ratio_L.max().item()


def summarize(backends: list[InstrumentedBackend], steps: int) -> dict[str, float]:
    """Per-step comm metrics of all layers since the last call; resets the counters.

    Collective over the first backend's EP group (one small all-reduce of the per-expert
    counts, so imbalance is global): every rank of the group must call it, as TorchTitan's
    MetricsProcessor.log is called on every rank.
    """
    if not backends or steps <= 0:
        return {}
    # Nothing instrumented ran (e.g. the layer is inside torch.compile): no numbers rather than
    # zeros. Every rank of the EP group runs the same layers, so all ranks return here together.
    if sum(b.stats.calls for b in backends) == 0:
        return {}
    for backend in backends:
        backend.stats.calls = 0
    times_ms, exposed_ms = defaultdict(float), defaultdict(float)
    for backend in backends:
        times = backend.stats.take_times_ms()
        for phase, ms in times.items():
            times_ms[phase] += ms
        for phase, ms in backend.stats.take_exposed_ms(times).items():
            exposed_ms[phase] += ms
    metrics = {
        keys.DISPATCH_FWD_MS: times_ms["dispatch_fwd"] / steps,
        keys.DISPATCH_BWD_MS: times_ms["dispatch_bwd"] / steps,
        keys.COMBINE_FWD_MS: times_ms["combine_fwd"] / steps,
        keys.COMBINE_BWD_MS: times_ms["combine_bwd"] / steps,
    }
    metrics[keys.DISPATCH_MS] = metrics[keys.DISPATCH_FWD_MS] + metrics[keys.DISPATCH_BWD_MS]
    metrics[keys.COMBINE_MS] = metrics[keys.COMBINE_FWD_MS] + metrics[keys.COMBINE_BWD_MS]
    metrics[keys.COMM_MS] = metrics[keys.DISPATCH_MS] + metrics[keys.COMBINE_MS]
    metrics[keys.DISPATCH_EXPOSED_MS] = (exposed_ms["dispatch_fwd"] + exposed_ms["dispatch_bwd"]) / steps
    metrics[keys.COMBINE_EXPOSED_MS] = (exposed_ms["combine_fwd"] + exposed_ms["combine_bwd"]) / steps
    metrics[keys.COMM_EXPOSED_MS] = metrics[keys.DISPATCH_EXPOSED_MS] + metrics[keys.COMBINE_EXPOSED_MS]
    if any(b.stats.overlapped for b in backends):
        comm_ms = metrics[keys.COMM_MS]
        metrics[keys.COMM_HIDDEN_PCT] = 100 * (1 - metrics[keys.COMM_EXPOSED_MS] / comm_ms) if comm_ms > 0 else math.nan

    # bytes: one host read for all layers and phases (the step already synced at .item())
    device = backends[0].stats.device
    byte_totals = {phase: torch.zeros((), dtype=torch.int64, device=device) for phase in PHASES}
    for backend in backends:
        for phase, nbytes in backend.stats.bytes.items():
            byte_totals[phase] = byte_totals[phase] + nbytes
        backend.stats.bytes = {}
    by_phase = dict(zip(PHASES, torch.stack([byte_totals[p] for p in PHASES]).cpu().tolist()))
    metrics[keys.DISPATCH_GB] = (by_phase["dispatch_fwd"] + by_phase["dispatch_bwd"]) / 1e9 / steps
    metrics[keys.COMBINE_GB] = (by_phase["combine_fwd"] + by_phase["combine_bwd"]) / 1e9 / steps
    metrics[keys.SENT_GB] = metrics[keys.DISPATCH_GB] + metrics[keys.COMBINE_GB]

    # Every rank all-reduces the same [layers, experts] shape, so a layer that saw no tokens
    # on this rank contributes zeros rather than skipping the collective (which would hang).
    rows_LE = torch.stack([b.stats.take_rows_per_expert() for b in backends])
    group = backends[0].ep_group
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(rows_LE, op=dist.ReduceOp.SUM, group=group)
        settle.released(rows_LE)  # before rows_LE is rebound (moe_comm.metrics.settle)
    rows_LE = rows_LE.cpu()
    rows_LR = rows_LE.view(rows_LE.shape[0], backends[0].ep_size, -1).sum(dim=-1)
    metrics[keys.IMBALANCE_RANK], metrics[keys.IMBALANCE_RANK_WORST] = _imbalance(rows_LR)
    metrics[keys.IMBALANCE_EXPERT], metrics[keys.IMBALANCE_EXPERT_WORST] = _imbalance(rows_LE)
    return metrics
