"""Hiding the MoE communication behind compute.

Two ways, and the two together, all driven from `TokenLevelMoE.forward` (moe_comm.titan.model):

- `[moe_comm] overlap = "chunked"`: the layer's tokens split in two halves c0, c1 (token order;
  c0 takes the odd token). Communication runs on the process's comm stream C, expert compute
  on the compute stream S (the stream current when the layer runs):

      C: dispatch(c0) dispatch(c1)   [wait e0] combine(c0)   [wait e1] combine(c1)
      S: shared(x)  [wait d0] experts(c0)  [wait d1] experts(c1)   [wait c0, c1] sum

  so dispatch(c0) hides behind the shared experts, dispatch(c1) behind experts(c0) and
  combine(c0) behind experts(c1); combine(c1) stays exposed. Both chunks' experts are one call
  of the experts module (`TokenLevelExperts.forward_chunks`), so FSDP gathers and reduces the
  expert weights once per layer, as without chunking.
- across microbatches, under DualPipeV's EP overlap (TorchTitan 0.2.2's `ScheduleDualPipeV`
  with `pipeline_parallel_expert_parallel_overlap`) or `[moe_comm] overlap = "microbatch"`
  (Interleaved1F1B's steady state: moe_comm.titan.pipeline): one chunk, and TorchTitan's sync
  points A and B around dispatch, C and D around combine, where TorchTitan's
  `DualPipeExpertParallel` puts them (`sync_points`). TorchTitan's overlap callback runs one
  microbatch's forward and another's backward in two threads that meet at these points, so one
  thread's communication runs while the other computes; only one thread issues communication
  between two points, so every rank issues it in the same order. Comm runs on C here too, so the nvshmem kernels (which run on the current
  stream) do not queue behind the other thread's compute. Each handoff marks its stream before
  the sync point and waits after it, so neither thread's wait covers the other thread's next
  work; autograd's own syncs at the backward's handoffs are made when a node returns, after the
  point, and may cover a little of it (a cost in overlap, never in correctness).
- both: DualPipeV's EP overlap with `[moe_comm] overlap = "chunked"`. DualPipeV pairs most of a
  rank's microbatch-stages, not its warmup forwards and cooldown backwards (at the flagship 23
  of rank 0's 128), whose communication nothing else hides. There the forward runs chunked
  (`chunks_for`: an MoE call outside a pair's forward half). Its backward may yet run in a pair
  (a warmup forward's backward comes in the steady state), where the other thread expects one
  meeting per sync point: the two chunks' handoffs at B and at C meet once (`Join`: C after the
  last chunk's combine backward, B before the first chunk's dispatch backward), so the meetings
  pair as a one-chunk call's would. Under activation checkpointing the forward's chunk count is
  kept and replayed by its recompute (moe_comm.titan.recompute.choice), which may run inside a
  pair although its forward did not.

Why one comm stream per process, not one per layer: the nvshmem kernels share one set of
symmetric buffers and per-kind call counters per process (csrc/runtime/buffers.h), so two of
their calls must never run at once, and every rank must issue them in the same order. One
stream runs them in issue order, which is the program's order on every rank (and, across
microbatches, the order the sync points impose on the two threads). It is created with high
priority, so its kernels' blocks are scheduled ahead of queued GEMM blocks: the nvshmem and
DeepEP kernels are cooperative launches on `num_sms` blocks that must all be resident at once,
and they spin on their peers. The local layout kernels (plan, expand, reduce) of the nvshmem
backend run on C as well, as grids over the whole GPU, sharing SMs with the GEMMs.

Stream semantics: `_ToComm` and `_FromComm` hand tensors between S and C. Each records an event
on the producing stream, makes the consuming stream wait for it, and `record_stream`s the tensors
on the consumer, so the caching allocator never reuses their memory while the other stream may
still read it. Autograd runs every op's backward on the stream its forward ran on (dispatch and
combine on C) and syncs producer and consumer streams itself; `_ToComm`'s backward (on C) hands
the gradients coming out of a comm op's backward to S explicitly, timing that wait.

Activation checkpointing (moe_comm.titan.recompute) re-runs the block's forward in the backward,
but its dispatch and combine calls replay what the forward's returned, and what their backward
nodes (on C) saved is the forward's own tensors, never recomputed ones. So the recompute needs C
for nothing: it runs inline on the stream that triggered it, which is S (no node on C unpacks a
checkpointed tensor), with no handoff, no sync point and no timed wait. That matters under an
overlapped pipeline action, where C holds the other microbatch's communication: a recompute that
waited on C would stall S behind it.

What each handoff cost the compute stream is reported to the instrumented backend
(`record_wait`: an event on S before and after the wait), so the metrics count as exposed only the
time S stood still waiting for communication. Slowdown of the GEMMs from sharing SMs with the comm
kernels is not in that figure. On CPU there are no streams: every stream operation is a no-op and
the chunked path is the same maths in the same order, so CPU runs check it end to end.

The nccl backend syncs with the host inside dispatch (split sizes). Under "chunked" the shared
experts are issued before the dispatches, so S computes them while the host waits for dispatch(c0)'s
and dispatch(c1)'s counts; dispatch(c1)'s all-to-all then runs behind experts(c0) and combine(c0)'s
behind experts(c1). What it cannot hide: the host waits beyond the shared experts' compute (the
host cannot issue experts(c0) before dispatch(c1)'s split sizes are back), and combine(c1).
"""

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torchtitan.distributed import dual_pipe_v

from moe_comm.backends.base import chunk_sizes, OVERLAP_CHUNKS
from moe_comm.titan import recompute

CHUNKS = OVERLAP_CHUNKS["chunked"]


_comm_streams: dict[int, torch.cuda.Stream] = {}


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The process's stream for MoE communication on `device` (see the module doc for why one)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _comm_streams:
        _, highest = torch.cuda.Stream.priority_range()
        _comm_streams[index] = torch.cuda.Stream(device=index, priority=highest)
    return _comm_streams[index]


class Streams:
    """The compute stream S (current when the layer runs) and the comm stream C, and the few
    operations the handoffs make on them. Without CUDA both are None and every operation is a
    no-op (CPU ops are synchronous); `inline` (a recompute) makes them no-ops on CUDA too:
    everything runs on the current stream."""

    def __init__(self, device: torch.device, inline: bool = False):
        self.cuda = device.type == "cuda" and not inline
        self.compute = torch.cuda.current_stream(device) if self.cuda else None
        self.comm = comm_stream(device) if self.cuda else None

    def on_comm(self):
        """Make C current (the comm ops launch on the current stream)."""
        return torch.cuda.stream(self.comm) if self.cuda else contextlib.nullcontext()

    def mark(self, stream) -> Any:
        """An event at the end of what `stream` has been given so far."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        if self.cuda:
            stream.wait_event(event)

    def timed_wait(self, event) -> tuple[Any, Any] | None:
        """S waits for `event`; (S before the wait, S after it): their distance is how long S
        stood still."""
        if not self.cuda:
            return None
        before = torch.cuda.Event(enable_timing=True)
        after = torch.cuda.Event(enable_timing=True)
        before.record(self.compute)
        self.compute.wait_event(event)
        after.record(self.compute)
        return before, after

    def hand_over(self, tensors, stream) -> None:
        """Tell the allocator that `stream` uses these tensors too."""
        if self.cuda:
            for t in tensors:
                if t is not None and t.is_cuda:
                    t.record_stream(stream)


def in_pair() -> bool:
    """Whether this thread runs one half of an overlapped pipeline action now (TorchTitan's
    overlap callback coordinates the two threads only then)."""
    return dual_pipe_v._hook_coordinator.is_coordination_enabled()


def chunks_for(chunked: bool, sync_points: bool) -> int:
    """How many chunks an MoE call runs in: `chunked` ([moe_comm] overlap = "chunked") runs two,
    except, under an overlap across microbatches (`sync_points`), in the forward half of an
    overlapped pair, which runs one and meets the other thread at the sync points. So under
    DualPipeV's EP overlap with "chunked", the microbatch-stages outside its pairs (the warmup and
    cooldown) hide their communication behind their own experts."""
    return CHUNKS if chunked and not (sync_points and in_pair()) else 1


class Join:
    """The chunks' handoffs at one sync point (B or C) of a chunked call whose backward may run in
    an overlapped pair: that backward meets the other thread once per point, as a one-chunk
    call's does, so the two threads' meetings stay paired. C meets after the last chunk's
    combine backward, B before the first chunk's dispatch backward: every combine backward is
    issued before the C meeting and every dispatch backward after the B meeting, as in a one-chunk
    call. Autograd runs them in that order (each chunk's combine backward is created after the
    other chunk's dispatch receipt); `after` (B's: the C join) makes any other order an error,
    not two threads communicating at once."""

    def __init__(self, chunks: int, meets_last: bool, after: "Join | None" = None):
        self.chunks, self.meets_last, self.after = chunks, meets_last, after
        self.passed = 0

    def meets(self) -> bool:
        """One chunk's backward passes the point: whether this pass is the one that meets."""
        if self.after is not None and self.after.passed < self.after.chunks:
            raise RuntimeError(
                f"a chunked MoE call's backward reached its dispatch backward after {self.after.passed} of its "
                f"{self.after.chunks} combine backwards: the sync points would pair wrongly with the other thread"
            )
        self.passed += 1
        return self.passed == (self.chunks if self.meets_last else 1)


@dataclass
class Handoff:
    """One crossing between the streams: which comm op it belongs to (for the timing), the
    sync point it is (None outside an overlap across microbatches), whether the forward meets
    there too (a chunked call's forward runs outside a pair and meets nowhere), the chunks'
    Join at B and C, and where to report waits."""

    streams: Streams
    op: str  # "dispatch" or "combine"
    sync_point: str | None
    record_wait: Callable[[str, Any, Any], None] | None  # the instrumented backend's, or None
    forward_meets: bool = True
    join: Join | None = None

    def sync_forward(self, ctx) -> None:
        if self.sync_point is not None and self.forward_meets:
            dual_pipe_v.SyncHook.forward(ctx, None, self.sync_point)

    def sync_backward(self) -> None:
        """TorchTitan's SyncHook.backward, except how it recognises the backward thread's first
        point (a D, which has no partner in the forward thread and is skipped): SyncHook takes
        "no D passed in the forward thread yet", which also holds for the backward's second D
        when it comes before the forward thread's first D, and then the threads' barriers shift
        by one and both threads communicate at once (seen on CPU). Here: the first D since
        TorchTitan's overlap callback enabled coordination (it makes a new barrier each time)."""
        if self.sync_point is None or (self.join is not None and not self.join.meets()):
            return
        coordinator = dual_pipe_v._hook_coordinator
        if self.sync_point == "D" and coordinator.is_coordination_enabled():
            barrier = coordinator._execution_barrier
            if not getattr(barrier, "moe_comm_first_d_seen", False):
                barrier.moe_comm_first_d_seen = True
                return
        coordinator.barrier()

    def report(self, phase: str, stamps) -> None:
        if stamps is not None and self.record_wait is not None:
            self.record_wait(phase, *stamps)


def _views(ctx, tensors) -> tuple:
    outs = tuple(t.view_as(t) for t in tensors)
    ctx.mark_non_differentiable(*(o for o in outs if not o.is_floating_point()))
    return outs


class _ToComm(torch.autograd.Function):
    """S -> C for the tensors a comm op reads. Called with C current, so autograd runs its
    backward on C, right after the comm op's backward: there it hands the op's input gradients
    back to S (the timed wait) before the sync point lets the other thread go on."""

    @staticmethod
    def forward(ctx, handoff: Handoff, ready, *tensors):
        ctx.set_materialize_grads(False)
        ctx.handoff = handoff
        s = handoff.streams
        # before the sync point: the event covers only this thread's work on S
        ready = ready if ready is not None else s.mark(s.compute)
        handoff.sync_forward(ctx)
        s.wait(s.comm, ready)
        s.hand_over(tensors, s.comm)
        return _views(ctx, tensors)

    @staticmethod
    def backward(ctx, *grads):
        h = ctx.handoff
        s = h.streams
        done = s.mark(s.comm)  # this thread's backward comm, before the other thread's next
        h.sync_backward()
        h.report(f"{h.op}_bwd", s.timed_wait(done) if s.cuda else None)
        s.hand_over(grads, s.compute)
        return (None, None) + grads


class _FromComm(torch.autograd.Function):
    """C -> S for what a comm op returns. Called with S current: the forward makes S wait for
    the op (timed); the backward runs on S and hands the gradients to C, the comm op's backward."""

    @staticmethod
    def forward(ctx, handoff: Handoff, done, *tensors):
        ctx.set_materialize_grads(False)
        ctx.handoff = handoff
        s = handoff.streams
        # before the sync point: the event covers only this thread's work on C
        done = done if done is not None else s.mark(s.comm)
        handoff.sync_forward(ctx)
        handoff.report(f"{handoff.op}_fwd", s.timed_wait(done) if s.cuda else None)
        s.hand_over(tensors, s.compute)
        return _views(ctx, tensors)

    @staticmethod
    def backward(ctx, *grads):
        h = ctx.handoff
        h.sync_backward()
        h.streams.hand_over(grads, h.streams.comm)
        return (None, None) + grads


def to_comm(handoff: Handoff, *tensors, ready=None) -> tuple:
    """`tensors` (on S) for use on C; `ready`: the event C waits for (default: S now)."""
    return _ToComm.apply(handoff, ready, *tensors)


def from_comm(handoff: Handoff, *tensors, done=None) -> tuple:
    """`tensors` (made on C) for use on S; `done`: the event S waits for (default: C now)."""
    return _FromComm.apply(handoff, done, *tensors)


@torch.compiler.disable  # streams, events and host syncs inside: eager, as the comm ops are
def overlapped_moe(moe, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor,
                   chunks: int, sync_points: bool) -> torch.Tensor:
    """`moe`'s routed + shared experts output for x_TD, its comm overlapped (module doc):
    `chunks` (`chunks_for`) = 2 for "chunked", 1 in the forward half of an overlapped pair;
    `sync_points`: under an overlap across microbatches, where the backward (and a one-chunk
    forward) meets the other thread at TorchTitan's sync points.

    Every wait is on an event marked right after the op it waits for, so the issue order on the
    host only matters for the nccl backend (host syncs) and for the backward: autograd issues
    backward ops latest-created first, and the order here (dispatch(c1) before experts(c0),
    combine(c0) after the wait for dispatch(c1)) makes it issue combine(c0)'s backward before the
    compute stream waits for it, behind experts(c1)'s backward; the dispatches' backwards run
    beside the shared experts' backward."""
    backend = moe.comm_backend
    # a recompute replays the comm calls: inline on S, no sync points, nothing to time (module doc)
    recomputing = recompute.replaying()
    streams = Streams(x_TD.device, inline=recomputing)
    # waits are reported for training steps only, as the instrument times only those
    record_wait = getattr(backend, "record_wait", None) if torch.is_grad_enabled() and not recomputing else None
    meet = sync_points and not recomputing
    # one chunk under sync points: the forward half of a pair; more: outside any pair (chunks_for),
    # where only the backward may run in a pair and meet
    paired = sync_points and chunks == 1
    joins = {}
    if meet and chunks > 1:
        joins["C"] = Join(chunks, meets_last=True)
        joins["B"] = Join(chunks, meets_last=False, after=joins["C"])

    def handoff(op: str, point: str) -> Handoff:
        return Handoff(streams, op, point if meet else None, record_wait, forward_meets=paired, join=joins.get(point))

    sizes = chunk_sizes(x_TD.shape[0], chunks)
    with streams.on_comm():
        # A: C waits for the router; the shared experts below are not in that wait
        x_comm, idx_comm, w_comm = to_comm(handoff("dispatch", "A"), x_TD, topk_idx_TK, topk_w_TK)
    # Issued before the dispatches, so S computes them while a host-syncing dispatch (nccl)
    # waits for its counts. In a pair they come after combine, as TorchTitan's DualPipeV.
    shared_TD = None
    if moe.shared_experts is not None and not paired:
        shared_TD = moe.shared_experts(x_TD)
    dispatched, dispatch_done = [], []
    with streams.on_comm():
        for x, idx, w in zip(x_comm.split(sizes), idx_comm.split(sizes), w_comm.split(sizes)):
            dispatched.append(recompute.dispatch(backend, x, idx, w))
            dispatch_done.append(streams.mark(streams.comm))

    def receive(i, recv_x_RD, tokens_per_expert_L):  # B: S waits for chunk i's dispatch only
        return from_comm(handoff("dispatch", "B"), recv_x_RD, tokens_per_expert_L, done=dispatch_done[i])

    def send(i, y_RD, ready):  # C: C waits for chunk i's experts only, then its combine
        with streams.on_comm():
            (y_RD,) = to_comm(handoff("combine", "C"), y_RD, ready=ready)
            return recompute.combine(backend, y_RD, dispatched[i].handle)

    chunks_in = [(d.recv_x_RD, d.tokens_per_expert_L) for d in dispatched]
    if paired:
        # B before the experts module (and its FSDP hooks), C and combine after it, as
        # TorchTitan's DualPipeExpertParallel places them
        chunks_in = [receive(i, *c) for i, c in enumerate(chunks_in)]
        ys, ready = moe.experts.forward_chunks(chunks_in, streams)
        outs = [send(i, y, r) for i, (y, r) in enumerate(zip(ys, ready))]
    else:
        outs, _ = moe.experts.forward_chunks(chunks_in, streams, receive, send)
    outs = from_comm(handoff("combine", "D"), *outs)  # D: S waits for every combine
    routed_TD = torch.cat(outs) if chunks > 1 else outs[0]
    if moe.shared_experts is not None and paired:
        shared_TD = moe.shared_experts(x_TD)
    return routed_TD if shared_TD is None else shared_TD + routed_TD

