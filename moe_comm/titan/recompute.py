"""Activation checkpointing whose recompute never communicates.

TorchTitan's activation checkpointing (`apply_ac`: full, per-layer selective, per-op selective)
wraps each transformer block in torch.utils.checkpoint, which in the backward runs the block's
forward a second time. For an MoE block that second forward would call dispatch and combine
again: two more transfers per MoE layer and microbatch (and, for the nccl backend, its host
syncs for the split sizes), each as long as the forward's. Here an MoE block's checkpoint keeps
what its forward's dispatch and combine calls produced, and its recompute replays them:

- forward (inside the checkpoint): each `dispatch(...)` / `combine(...)` call runs the backend as
  without checkpointing, and its result (a DispatchResult: the expert rows, their counts, the
  handle; combine's output) is kept in the block's checkpoint frame, in call order. The call
  runs outside the checkpoint's saved-tensor hooks, so what the backend's own autograd saves
  for its backward (indices, routing weights, the handle, combine's input rows) is kept as it is
  without checkpointing, and outside any dispatch mode, so torch's selective-checkpoint caches
  never see these calls in either pass.
- recompute (in the backward): the same calls return the kept results instead of calling the
  backend: no transfer, no host sync, no backend work at all. The rest of the block (attention,
  router, shared experts, and the routed experts on the kept rows) recomputes as before, on the
  compute stream (moe_comm.titan.overlap runs no comm-stream handoff, sync point or timed wait
  in a recompute).

So dispatch and combine run exactly as often per step with checkpointing as without (and their
backward passes once each, as always). The frame, and what it keeps, is freed with the block's
autograd graph at the end of the block's backward.

What it costs in memory, per MoE layer and microbatch, held from the layer's forward to its
backward (moe_comm.predict.estimate.comm_kept_bytes computes it per backend): the received
expert rows (R x D), the rows the backend's combine saves for its own backward (combine's input
rows: R x D, or for nccl the (token, k) rows in fp32 before the weighted sum), combine's output
(T x D), and the small index and routing-weight tensors of the handle. Plain checkpointing held
none of this: it recomputed it (and re-sent it). That is the trade: about two activation-sized
tensors per layer and microbatch in flight, for two transfers and their host syncs fewer.

Which blocks: every checkpointed block with an MoE layer served by a backend; a dense block's
checkpoint is TorchTitan's, untouched. The kept results are per thread (a thread-local stack of
frames), so the two threads of an overlapped pipeline action each keep and replay their own.
"""

import functools
import os
import threading
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import noop_context_fn
from torchtitan.distributed.activation_checkpoint import apply_ac as titan_apply_ac
from torchtitan.models.deepseek_v3.infra import parallelize as titan_dsv3
from torchtitan.tools.logging import logger

from moe_comm.backends.base import DispatchResult


class Frame:
    """One checkpointed block's forward: the comm calls' results (and its `choice`s), in call order."""

    def __init__(self):
        self.kept: list[tuple[str, Any]] = []
        self.replaying = False
        self.next = 0  # the next kept result a recompute returns


_local = threading.local()


def _frames() -> list[Frame]:
    if not hasattr(_local, "frames"):
        _local.frames = []
    return _local.frames


def replaying() -> bool:
    """Whether this thread is recomputing a checkpointed MoE block (its comm calls replay)."""
    frames = _frames()
    return bool(frames) and frames[-1].replaying


class _Entered:
    """A context manager for torch.utils.checkpoint's context_fn that makes `frame` this
    thread's current frame, keeping (`replay` False) or replaying; the recompute one may be
    entered several times (each recompute replays from the start)."""

    def __init__(self, frame: Frame, replay: bool):
        self.frame, self.replay = frame, replay

    def __enter__(self):
        self.frame.replaying, self.frame.next = self.replay, 0
        _frames().append(self.frame)

    def __exit__(self, *exc):
        _frames().pop()
        return False


class _Both:
    """Two context managers as one (TorchTitan's selective-op contexts and ours)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __enter__(self):
        self.first.__enter__()
        try:
            self.second.__enter__()
        except BaseException:
            self.first.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            self.second.__exit__(*exc)
        finally:
            self.first.__exit__(*exc)
        return False


def context_fn(inner: Callable = noop_context_fn):
    """torch.utils.checkpoint's context_fn for an MoE block: a fresh frame whose forward keeps
    and whose recompute replays the comm calls, around `inner`'s contexts (TorchTitan's
    selective-op ones, or none)."""
    frame = Frame()
    forward, recompute = inner()
    return _Both(forward, _Entered(frame, False)), _Both(recompute, _Entered(frame, True))


def _pack(t: torch.Tensor) -> torch.Tensor:
    return t.detach()  # not the tensor itself: a saved output would reference its own grad_fn


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _run(call: Callable, *args):
    frames = _frames()
    if not frames:
        return call(*args)
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack), _disable_current_modes():
        return call(*args)


def _replayed(t):
    """A kept tensor for the recompute's graph: the same data, detached from the forward's
    graph, requiring grad as it did (so the recompute saves what the forward saved)."""
    if isinstance(t, torch.Tensor) and t.requires_grad:
        return t.detach().requires_grad_(True)
    return t


def _take(op: str):
    frame = _frames()[-1]
    if frame.next >= len(frame.kept) or frame.kept[frame.next][0] != op:
        made = [kind for kind, _ in frame.kept]
        raise RuntimeError(
            f"the recompute of a checkpointed MoE block asked for {op} call {frame.next + 1}, but its forward "
            f"made {made}: a block's forward and its recompute must make the same dispatch/combine calls"
        )
    _, result = frame.kept[frame.next]
    frame.next += 1
    return result


def _keep(kind: str, value):
    """`value`, kept in this thread's checkpointed forward (if it is in one) for its recompute."""
    if _frames():
        _frames()[-1].kept.append((kind, value))
    return value


def choice(name: str, choose: Callable[[], Any]) -> Any:
    """`choose()`, a choice the forward makes from the moment's state (how many chunks a call
    runs in, say), kept in a checkpointed forward and replayed in its recompute: the recompute
    must make the same calls in the same order, whatever the state is then."""
    return _take(name) if replaying() else _keep(name, choose())


def dispatch(backend, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> DispatchResult:
    """backend.dispatch, kept in a checkpointed forward and replayed in its recompute."""
    if replaying():
        r = _take("dispatch")
        return DispatchResult(_replayed(r.recv_x_RD), r.tokens_per_expert_L, r.handle, r.recv_fp8)
    return _keep("dispatch", _run(backend.dispatch, x_TD, topk_idx_TK, topk_w_TK))


def combine(backend, y_RD: torch.Tensor, handle: Any) -> torch.Tensor:
    """backend.combine, kept in a checkpointed forward and replayed in its recompute."""
    if replaying():
        return _replayed(_take("combine"))
    return _keep("combine", _run(backend.combine, y_RD, handle))


# A benchmark's switch, never a recipe field: "1" runs TorchTitan's checkpointing as it is, whose
# recompute calls dispatch and combine again (the baseline experiments/emulated_link.py measures
# the kept results against).
RECOMPUTE_COMM_ENV = "MOE_COMM_RECOMPUTE_COMM"


def apply_ac(model: nn.Module, ac_config, *, model_compile_enabled: bool, base_folder: str) -> None:
    """TorchTitan's apply_ac (its modes, its selective-op save list), then every checkpointed MoE
    block's checkpoint keeps its comm results (`context_fn`, around TorchTitan's own contexts)."""
    titan_apply_ac(model, ac_config, model_compile_enabled=model_compile_enabled,
                   op_sac_save_list=set(titan_dsv3._op_sac_save_list), base_folder=base_folder)
    if os.environ.get(RECOMPUTE_COMM_ENV) == "1":
        logger.warning(f"{RECOMPUTE_COMM_ENV}=1: the recompute calls dispatch and combine again (a benchmark's "
                       "baseline, TorchTitan's own activation checkpointing)")
        return
    for block in model.layers.values():
        if isinstance(block, CheckpointWrapper) and block.moe_enabled:
            checkpoint_fn = block.checkpoint_fn
            inner = checkpoint_fn.keywords.get("context_fn", noop_context_fn)
            block.checkpoint_fn = functools.partial(checkpoint_fn, context_fn=functools.partial(context_fn, inner))
