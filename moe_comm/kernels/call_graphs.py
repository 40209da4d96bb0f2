"""Each MoE call of the nvshmem backend as a CUDA graph: captured once, then replayed.

A dispatch is a chain of seven kernels (plan, scans, the communication kernel, the expert-major
layout), a combine three, combine's backward four; eagerly each is a launch, and each op call
goes through Python autograd glue. Replayed from a graph, a call costs the host one graph
launch. Our ops can be captured because nothing on their path waits for the host:
- their buffers are sized once at start-up, so no call allocates symmetric memory;
- the per-kind call counters that tag every flag (csrc/runtime/buffers.h) live on the device
  and advance when the communication kernels run. A capture runs nothing, so it leaves them as
  they were, and a replay advances them exactly as the same call made eagerly would: graphed
  and eager calls mix freely, and every rank still issues the same calls in the same order;
- after start-up the backend issues no NVSHMEM host call (NVSHMEM's on-stream host barrier,
  which aborts a process under capture, is gone), and an error is read from the error words after the fact.

What a graph reads and writes. A captured kernel keeps the pointers it was captured with, so:
- **inputs are read where they are.** A graph is keyed by the address, shape, stride and dtype
  of every tensor its op reads, and by the op's other arguments; it replays only for a call
  whose inputs sit at exactly those addresses. A training step makes the same allocations in the
  same order every step, so from the first steps on the caching allocator hands each call the
  same addresses and its graph replays. Copying inputs into fixed buffers instead would read
  and write the expert rows once more per combine and per dispatch backward: as much HBM
  traffic as the layout kernel itself.
- **outputs live in the graph's own memory pool**, rewritten by every replay. A replay hands out
  fresh aliases of them; an instance is replayed only once no alias of its outputs is alive any
  more (autograd's saved tensors count), else the same key gets another instance. So
  activations kept for the backward or across microbatches are never overwritten. The cost is
  memory: an idle instance keeps its outputs' memory (about one layer's expert rows for
  combine's backward, whose gradient the eager path frees at once).
- **bounded**: at most `MAX_INSTANCES` graphs per MoE layer (the least recently used idle one
  is dropped for a new key, its memory returned), and a layer that has captured
  `MAX_CAPTURES` times without settling (its inputs keep moving) runs eagerly from then on, which
  it says once.

Replays are ordered after every earlier use of the outputs they rewrite: without an overlap
every call is on one stream, and under moe_comm.titan.overlap each op on the comm stream first
waits for the compute stream, where the previous call's outputs were read.

Calls run as the op itself where a graph cannot stand in (`op_itself_because`: inside another capture,
under torch.compile, under a dispatch mode such as selective activation checkpointing's), and
every call does when `[moe_comm] cuda_graphs = false` turns graphs off (to give their memory back,
to compare, or to rule them out; `reason_off` says why a process runs without them).

The autograd of a graphed call is the op's own (moe_comm.kernels.ops: dispatch's backward is an
unweighted combine, combine's is combine_backward), and the backward ops go through the same
layer's graphs.
"""

import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _python_dispatch

MAX_INSTANCES = 12  # graphs one MoE layer keeps: 4 call kinds, x2 for chunks or recompute, and spare
MAX_CAPTURES = 64  # captures one MoE layer may make before it stops trying (its inputs never settle)


def reason_off(device: torch.device, enabled: bool) -> str:
    """Why this process's MoE calls on `device` run without graphs ("" when they run from them);
    `enabled`: the recipe's [moe_comm] cuda_graphs."""
    if not enabled:
        return "[moe_comm] cuda_graphs = false"
    if device.type != "cuda":
        return f"the rows are on {device.type}, not CUDA"
    return ""


def _uses(storage: torch.UntypedStorage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


def key(op_name: str, args: tuple) -> tuple:
    """What a graph of `op_name` on `args` is captured for: every tensor's address, shape, stride,
    dtype and device, and every other argument as it is."""
    parts: list[Any] = [op_name]
    for a in args:
        if isinstance(a, torch.Tensor):  # (an address names its device: CUDA's address space is unified)
            parts.append((a.data_ptr(), a.shape, a.stride(), a.dtype))
        elif isinstance(a, list):
            parts.append(tuple(a))
        else:
            parts.append(a)
    return tuple(parts)


class CudaCapture:
    """Captures an op call into a torch.cuda.CUDAGraph on a side stream (a capture cannot run on
    the default stream), without the device-wide synchronisation `torch.cuda.graph` makes; only
    this thread is held to capture's rules (the autograd thread may capture while the main
    thread waits, and the other way round)."""

    def __init__(self):
        self._streams: dict[int, torch.cuda.Stream] = {}

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """(the graph, what `fn` returned during capture)."""
        device = torch.cuda.current_device()
        stream = self._streams.setdefault(device, torch.cuda.Stream(device))
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                outputs = fn()
            finally:
                graph.capture_end()
        return graph, outputs

    @staticmethod
    def replay(graph: Any) -> None:
        graph.replay()  # on the current stream, after whatever produced the inputs


@dataclass
class _Instance:
    graph: Any
    outputs: tuple[torch.Tensor, ...]  # the graph's own, rewritten by every replay
    last_used: int
    storages: tuple = ()  # the outputs' storages, kept to count their uses cheaply
    baseline: tuple[int, ...] = ()  # each storage's uses when only this instance holds it

    def __post_init__(self):
        self.storages = tuple(t.untyped_storage() for t in self.outputs)
        self.baseline = tuple(_uses(s) for s in self.storages)

    def idle(self) -> bool:
        """No alias of the last replay's outputs is alive: the next replay may rewrite them."""
        return all(_uses(s) <= n for s, n in zip(self.storages, self.baseline))


def _flat(outputs: Any) -> tuple[torch.Tensor, ...]:
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


def _aliases(outputs: tuple[torch.Tensor, ...], as_tuple: bool) -> Any:
    """New tensors on the outputs' memory: each holds a use of its storage while it lives."""
    fresh = tuple(t.detach() for t in outputs)
    return fresh if as_tuple else fresh[0]


class CallGraphs:
    """One MoE layer's graphs, by key (see the module doc). `call(op, args)` returns what
    `op(*args)` returns, from a graph where it can."""

    def __init__(self, layer: str, capturer: Any = None):
        self.layer = layer  # for the note when it stops capturing
        self.capturer = capturer if capturer is not None else CudaCapture()
        self.instances: dict[tuple, list[_Instance]] = {}
        self.counts: Counter = Counter()  # "captured", "replayed", "eager", "dropped"
        self.stopped = ""  # why this layer runs eagerly from now on ("" while it graphs)
        self._returns_tuple: dict[tuple, bool] = {}  # per key: the op returns a tuple (else one tensor)
        self._clock = 0

    def call(self, op: Callable, args: tuple) -> Any:
        if self.stopped:
            self.counts["eager"] += 1
            return op(*args)
        self._clock += 1
        k = key(str(op), args)
        for inst in self.instances.get(k, ()):
            if inst.idle():
                inst.last_used = self._clock
                self.capturer.replay(inst.graph)
                self.counts["replayed"] += 1
                return _aliases(inst.outputs, self._returns_tuple[k])
        if self.counts["captured"] >= MAX_CAPTURES:
            self._stop(f"its calls' inputs did not settle at fixed addresses within {MAX_CAPTURES} captures")
            self.counts["eager"] += 1
            return op(*args)
        if self._size() >= MAX_INSTANCES and not self._drop_one():
            self.counts["eager"] += 1  # every instance is in use: this call runs as it is
            return op(*args)
        graph, outputs = self.capturer.capture(lambda: op(*args))
        flat = _flat(outputs)
        inst = _Instance(graph, flat, self._clock)
        self.instances.setdefault(k, []).append(inst)
        self._returns_tuple[k] = isinstance(outputs, (tuple, list))
        self.counts["captured"] += 1
        self.capturer.replay(graph)  # a capture runs nothing: this call's work is the first replay
        return _aliases(flat, self._returns_tuple[k])

    def _size(self) -> int:
        return sum(len(v) for v in self.instances.values())

    def _drop_one(self) -> bool:
        """Drop the least recently used idle instance (its pool returns to the allocator)."""
        idle = [(inst.last_used, k, inst) for k, insts in self.instances.items() for inst in insts if inst.idle()]
        if not idle:
            return False
        _, k, inst = min(idle, key=lambda item: item[0])
        self.instances[k].remove(inst)
        if not self.instances[k]:
            del self.instances[k]
            self._returns_tuple.pop(k, None)
        self.counts["dropped"] += 1
        return True

    def _stop(self, why: str) -> None:
        self.stopped = why
        self.instances.clear()
        self._returns_tuple.clear()
        print(f"moe_comm: {self.layer}: MoE calls run without CUDA graphs from now on: {why}", file=sys.stderr,
              flush=True)


class _Graphed(torch.autograd.Function):
    """An op of torch.ops.moe_comm through a layer's graphs, with the op's own autograd."""

    @staticmethod
    def forward(graphs: CallGraphs, name: str, *args):
        return graphs.call(OPS[name](), args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        graphs, name, *args = inputs
        ctx.graphs, ctx.op_name = graphs, name
        AUTOGRAD[name][0](ctx, args, output)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + AUTOGRAD[ctx.op_name][1](ctx, *grads)


# The ops a layer graphs, by name; looked up at call time because the library is loaded when the
# backend starts.
OPS = {
    "dispatch": lambda: torch.ops.moe_comm.dispatch.default,
    "combine": lambda: torch.ops.moe_comm.combine.default,
    "combine_backward": lambda: torch.ops.moe_comm.combine_backward.default,
}
# Their autograd, (setup_context, backward) by name: moe_comm.kernels.ops registers its own here when
# it registers them with torch (it imports this module, so this one cannot import it).
AUTOGRAD: dict[str, tuple[Callable, Callable]] = {}


def op_itself_because() -> str:
    """Why this call must run as the op itself ("" when a graph may stand in): inside another
    capture (a caller capturing a whole step records our kernels into its own graph), under
    torch.compile (the tracer runs the op's fake kernel), or under a dispatch mode, such as
    selective activation checkpointing's, which saves the op's outputs in the forward and hands
    them back in the recompute (a replay is no op call it could see)."""
    if torch.compiler.is_compiling():
        return "under torch.compile"
    if _python_dispatch._get_current_dispatch_mode() is not None:
        return "under a dispatch mode (selective activation checkpointing's)"
    if torch.cuda.is_current_stream_capturing():
        return "inside another CUDA graph capture"
    return ""


def run(graphs: CallGraphs | None, name: str, args: tuple) -> Any:
    """torch.ops.moe_comm.<name>(*args), differentiable, from `graphs` where a graph can serve
    this call (module doc), else the op itself."""
    if graphs is not None:
        why = op_itself_because()
        if not why:
            return _Graphed.apply(graphs, name, *args)
        graphs.counts[f"op itself, {why}"] += 1
    return getattr(torch.ops.moe_comm, name)(*args)


def run_backward_op(ctx, name: str, args: tuple) -> Any:
    """An op a backward makes (moe_comm.kernels.ops), through the graphs its forward used."""
    graphs = getattr(ctx, "graphs", None)
    op = OPS[name]()
    if graphs is None:
        return op(*args)
    why = op_itself_because()
    if why:
        graphs.counts[f"op itself, {why}"] += 1
        return op(*args)
    return graphs.call(op, args)


def summary(layers: list[CallGraphs], enabled: bool) -> str:
    """One line on how a process's MoE calls ran, for the run's footer; `enabled`: the recipe's
    [moe_comm] cuda_graphs."""
    if not layers:
        return "MoE calls ran without CUDA graphs (" + (reason_off(torch.device("cuda"), enabled) or "none built") + ")"
    total: Counter = Counter()
    for g in layers:
        total.update(g.counts)
    calls = total["replayed"] + total["captured"] + sum(v for k, v in total.items() if k.startswith(("eager", "op itself")))
    parts = [f"{total['replayed']:,} of {calls:,} MoE calls replayed from CUDA graphs ({total['captured']:,} captured"]
    parts += [f"{v:,} {k}" for k, v in sorted(total.items()) if k.startswith("op itself")]
    if total["eager"]:
        parts.append(f"{total['eager']:,} eager: " + "; ".join(sorted({g.stopped for g in layers if g.stopped})
                                                              or ["every graph of the layer in use"]))
    return ", ".join(parts) + ")"
