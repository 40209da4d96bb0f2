"""Overlap across microbatches in the pipeline schedule: `[moe_comm] overlap = "microbatch"`.

In the steady state of torch's Interleaved1F1B, each rank alternates one microbatch's forward on
one of its stages with another microbatch's backward on another. Here such a forward and
backward run as one overlapped action (torch's OVERLAP_F_B, executed by TorchTitan's DualPipeV
callback: the forward in the calling thread, the backward in a second thread, both issuing to the
same compute stream S), and every MoE layer passes TorchTitan's sync points A, B around dispatch
and C, D around combine (moe_comm.titan.overlap, as under DualPipeV). The two threads meet at
every point, so between two points exactly one of them issues communication, on the comm stream
C, while the other issues compute on S. Per MoE layer of each thread, in issue order:

    forward thread   [attention, router] A dispatch B [experts] C combine D [shared experts, next layer ...
    backward thread  [shared experts bwd] (D) combine bwd C [experts bwd] B dispatch bwd A [router, attention bwd, ...

and the points pair up (forward A with backward C, B with B, C with A, D with the next layer's
D), so what hides behind what is, on the GPU:
    forward dispatch        behind the other microbatch's routed experts' backward (data and
                            weight gradients);
    backward dispatch       (combine of the gradient rows) behind the routed experts' forward;
    forward combine         behind the rest of the other microbatch's block backward (router,
                            attention, norms) and the previous block's shared experts' backward;
    backward combine        (dispatch of the output gradient) behind the shared experts' forward,
                            the next block's attention and router forward.
Nothing hides if the compute issued beside a transfer is shorter than it; the comm kernels' SMs
(num_sms) are taken from that compute while they run. The backend's calls never overlap each
other (one stream, one thread at a time), so the nvshmem kernels' shared buffers and call order
hold, and every rank of an EP group (the same pipeline rank, so the same action list and layers)
issues them in the same order. The nccl backend's dispatch waits on the host for its split
sizes; that blocks only the forward thread, while the backward thread keeps issuing the compute
beside it, so the wait hides as long as that compute outlasts the counts' round trip; the rows'
all-to-all is issued only after it. With activation checkpointing the backward thread's
recompute replays the forward's dispatch and combine (moe_comm.titan.recompute) and passes no
sync point: it runs inline on S.

The action lists are torch's own Interleaved1F1B pipeline_order, with two changes:
  * one more warmup forward on every rank (the same forwards and backwards, each stage's in the
    same microbatch order, the backwards shifted one action later): then a steady-state pair's
    backward input has arrived when the pair starts (both halves' inputs must be there: torch's
    lowering adds the pair's receives before it), as in Megatron-Core's combined 1F1B. It holds
    one more microbatch-stage of activations per rank;
  * each steady-state (forward, backward) pair on two different stages of the rank is merged
    into one OVERLAP_F_B action; a pair on the same stage stays two actions. Two threads must
    never run the same stage: FSDP keeps one training state per module (a forward that found its
    module in the backward's state would skip its hooks), and each stage is its own FSDP root.
    For the same reason 1F1B (one stage per rank) is refused (moe_comm.backends.base).
What torch's lowering then adds (sends, receives, FSDP unshard/reshard, gradient reduction) is
torch's. It replaces the chunked overlap: one chunk per MoE call (DualPipeV's overlap, unlike it, composes
with "chunked" outside its pairs: moe_comm.titan.overlap).
"""

import threading

from torch.distributed.pipelining.schedules import (
    _Action,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    ScheduleInterleaved1F1B,
)
from torchtitan.distributed import dual_pipe_v
from torchtitan.distributed.pipeline_parallel import pipeline_llm as titan_pipeline_llm

from moe_comm.backends.base import MICROBATCH_OVERLAP_SCHEDULES
from moe_comm.errors import RecipeError


def overlapped_order(pipeline_order: dict[int, list]) -> dict[int, list[_Action]]:
    """Each rank's compute actions of a 1F1B-shaped order (warmup forwards, then forward/backward
    pairs, then the remaining backwards) with one more warmup forward, and every steady-state pair
    on two different stages merged into one OVERLAP_F_B (module doc)."""
    merged = {}
    for rank, actions in pipeline_order.items():
        actions = [a for a in actions if a is not None]
        forwards = [a for a in actions if a.computation_type == FORWARD]
        backwards = [a for a in actions if a.computation_type == FULL_BACKWARD]
        if len(forwards) + len(backwards) != len(actions):
            kinds = sorted({a.computation_type.value for a in actions} - {"F", "B"})
            raise ValueError(f"rank {rank}'s schedule has actions {kinds}: only forwards and full backwards overlap")
        # torch runs w forwards, then pairs (forward, backward): w + 1 forwards precede the first
        # backward, and pairing the backward with the forward after them adds one warmup forward
        warmup = next((i for i, a in enumerate(actions) if a.computation_type == FULL_BACKWARD), len(actions))
        out = forwards[:warmup]
        for f, b in zip(forwards[warmup:], backwards):
            out.append(_Action(-1, OVERLAP_F_B, None, (f, b)) if f.stage_index != b.stage_index else f)
            if f.stage_index == b.stage_index:
                out.append(b)
        out += backwards[len(forwards) - warmup:]
        merged[rank] = out
    return merged


def overlap_f_b(action: _Action, ctx) -> None:
    """TorchTitan's DualPipeV callback for one OVERLAP_F_B action (the forward here, the backward
    in a thread of its own, meeting at the MoE layers' sync points), except that a failure in the
    backward thread fails the step: TorchTitan's would lose it, and the forward thread would wait
    at the next sync point forever. Either thread's failure breaks the other's waits."""
    errors = []
    previous = threading.excepthook

    def backward_failed(args):
        errors.append(args.exc_value)
        dual_pipe_v._hook_coordinator.disable_coordination()  # frees the forward thread's wait
        previous(args)

    threading.excepthook = backward_failed
    try:
        dual_pipe_v.overlap_callback(action, ctx)
    finally:
        threading.excepthook = previous
        dual_pipe_v._hook_coordinator.disable_coordination()
    if errors:
        raise RuntimeError(f"the backward half of the overlapped pipeline action {action} failed") from errors[0]


def overlap_microbatches(schedule) -> None:
    """Make TorchTitan's built Interleaved1F1B schedule run its steady state overlapped."""
    if not isinstance(schedule, ScheduleInterleaved1F1B):
        raise RecipeError(
            f'[moe_comm] overlap = "microbatch" runs pipeline_parallel_schedule = '
            f'{" or ".join(repr(s) for s in MICROBATCH_OVERLAP_SCHEDULES)} only, and this run built '
            f"{type(schedule).__name__} (a pipeline_parallel_schedule_csv replaces the schedule): "
            'choose the schedule, or overlap = "chunked"'
        )
    order = overlapped_order(schedule.pipeline_order)
    schedule.pipeline_order = order
    schedule._prepare_schedule_with_comms(order)
    schedule.register_custom_function(OVERLAP_F_B, overlap_f_b)


def pipeline_llm(model, parallel_dims, job_config, device, model_args, parallelize_fn, loss_fn):
    """TorchTitan's pipeline_llm (the train spec's pipelining_fn); with [moe_comm] overlap =
    "microbatch", its schedule's steady state overlapped."""
    built = titan_pipeline_llm(model, parallel_dims, job_config, device, model_args, parallelize_fn, loss_fn)
    if job_config.moe_comm.overlap == "microbatch":
        overlap_microbatches(built[0])
    return built
