"""The one interface every MoE communication backend implements.

A backend moves routed tokens from the rank that owns them to the ranks that own their experts
(dispatch), and brings the expert outputs back, reduced with the routing weights (combine).
TorchTitan's expert-parallel hook (moe_comm.titan) calls it; the same oracle tests run against
every backend.

Shapes: T tokens on this rank, K = top_k, D = hidden, E = experts in the layer, L = experts on
this rank (E / ep_size), R = rows handed to the local experts (a static bound for backends that
avoid host syncs, the exact count for the NCCL path).
"""

import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from moe_comm import fp8_experts, gpus
from moe_comm.config import MoEComm
from moe_comm.errors import RecipeError
from moe_comm.fp8_experts import Fp8Rows
from moe_comm.layout import RunPlan


# Token chunks per MoE layer call for each [moe_comm] overlap (moe_comm.titan.overlap).
OVERLAP_CHUNKS = {"none": 1, "chunked": 2, "microbatch": 1}

# Pipeline schedules whose steady state the "microbatch" overlap runs (moe_comm.titan.pipeline).
MICROBATCH_OVERLAP_SCHEDULES = ("Interleaved1F1B",)


def chunk_sizes(num_tokens: int, chunks: int) -> list[int]:
    """Token counts of `chunks` consecutive chunks, the first ones one larger when it does not
    divide (an empty chunk is still dispatched: every rank must make the same calls)."""
    base, extra = divmod(num_tokens, chunks)
    return [base + (i < extra) for i in range(chunks)]


def tokens_per_call(tokens_per_rank: int, overlap: str) -> int:
    """Most tokens one dispatch carries: all of a rank's tokens, or the larger chunk."""
    return chunk_sizes(tokens_per_rank, OVERLAP_CHUNKS[overlap])[0]


def rows_in_compute_dtype(x_TD: torch.Tensor) -> torch.Tensor:
    """The rows the experts compute on, which a backend moves. Under FSDP's mixed precision a
    block's input is already bf16; where TorchTitan trains under autocast instead (one GPU, or
    DDP: no FSDP to cast the block's inputs) the residual stream arrives in fp32 while the grouped
    GEMM computes in the autocast dtype, so moving fp32 rows would cost twice the bytes for
    nothing (FP8 dispatch quantises from bf16, DeepEP takes bf16 only). Differentiable: the
    gradient returns in fp32."""
    device = x_TD.device.type
    if x_TD.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return x_TD.to(torch.get_autocast_dtype(device))
    return x_TD


@dataclass(frozen=True)
class MoELayerSpec:
    """What a backend must know about the MoE layer it serves; fixed for the whole run."""

    num_experts: int
    top_k: int
    hidden: int
    # False (every DeepSeek-V3 flavor): combine weights the expert outputs. True: dispatch
    # weights the expert inputs and combine is a plain sum.
    score_before_experts: bool = False


def run_plan_for_group(layer: MoELayerSpec, ep_group: dist.ProcessGroup, config: MoEComm) -> RunPlan:
    """The RunPlan as far as a process that builds a backend can see it: its EP group, its
    device, torchrun's LOCAL_WORLD_SIZE and its environment (what NVSHMEM will read)."""
    ep = dist.get_world_size(ep_group)
    world = dist.get_world_size() if dist.is_initialized() else ep
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = gpus.this_machine()
    return RunPlan(
        options=config,
        device="cuda" if device else "cpu",
        ep=ep,
        ranks_per_node=per_node,
        nodes=max(1, world // per_node),
        num_experts=layer.num_experts,
        top_k=layer.top_k,
        hidden=layer.hidden,
        score_before_experts=layer.score_before_experts,
        gpu=device[0] if device else "",
        gpu_sms=device[1] if device else 0,
        launch_env=dict(os.environ),
        launch_env_source="this process's environment",
    )


@dataclass(frozen=True)
class CostTraits:
    """What the scale model (moe_comm.predict.scale_model) needs to price a backend's dispatch
    and combine. Each value names the measurement it is priced from (moe_comm.predict.calibration
    fits them; results/scale_model.md lists them)."""

    hierarchical: bool
    """Dispatch sends a token over the network once per node and over NVLink once per rank that
    holds one of its experts, and combine reduces on the way back. False: one row per (token,
    expert) pick, as an all-to-all sends them."""
    transport: str
    """What moves the rows, at its measured cost: "NCCL" (the host-driven all-to-all, at NCCL's
    measured rates), or kernels on the backend's num_sms SMs: "our kernels" (this project's,
    from the comm bench) or "DeepEP kernels" (DeepEP v1.2.1's own figure)."""
    host_syncs_per_dispatch: int
    """Host round trips a forward dispatch waits for (split sizes, received counts), as its code
    makes them. Where `host_syncs_case` has no measurement, the model prices a dispatch that makes
    any at the all-to-all path's measured cost per call, within one kernel launch per round trip
    and that cost per round trip (moe_comm.predict.scale_model.host_us)."""
    layout: str
    """Whose permute to and from the experts' expert-major rows it runs, at its measured cost:
    "TorchTitan" (_permute / _unpermute), "TorchTitan DeepEP" (its DeepEP path's permute) or
    "our kernels" (expand / reduce)."""
    host_syncs_case: str = ""
    """The case of experiments/host_syncs.py that measures its host synchronisations per dispatch,
    combine and their backwards, and what each costs (results/model_inputs); the model prices
    those where the file has the case. "NCCL" transports' per-call cost is measured whole (the
    comm bench's round trips), so theirs is for the record."""


@dataclass
class DispatchResult:
    """What dispatch hands to the grouped experts, and what combine needs to undo it."""

    # Rows for the local experts, expert-major: expert 0's rows, then expert 1's, ...; each
    # expert's segment is padded with zero rows to TorchTitan's TOKEN_GROUP_ALIGN_SIZE_M. With
    # recv_fp8 set: a zero-stride bf16 view of the rows' shape that carries their gradient
    # (moe_comm.kernels.ops.dispatch_fp8_rows), not the rows.
    recv_x_RD: torch.Tensor
    # Rows per local expert including padding (what TorchTitan's grouped GEMM takes as offsets).
    tokens_per_expert_L: torch.Tensor
    # Backend-private state for combine (indices, splits, buffers).
    handle: Any
    # [moe_comm] expert_dtype = "fp8": the rows in e4m3, one fp32 scale per row, for the FP8 experts.
    recv_fp8: Fp8Rows | None = None


class CommBackend(ABC):
    """dispatch(x_TD, topk_idx_TK, topk_w_TK) -> DispatchResult; combine(y_RD, handle) -> out_TD.

    Both ops are differentiable: gradients flow to x_TD and to topk_w_TK (the router), so the
    backend is a drop-in for TorchTitan's all-to-all in training.
    """

    # What a backend is, asked of its class everywhere else (nothing outside backends/ compares
    # a backend's name): its abilities here and in `check_run`, the options that identify its
    # runs, its label, its colour, how it sends, what selective AC keeps, what the scale model
    # prices.
    name: ClassVar[str]
    cuda_only: ClassVar[bool] = False
    # [moe_comm] dispatch_dtype values it takes (what dispatch puts on the links).
    dispatch_dtypes: ClassVar[tuple[str, ...]] = ("bf16",)
    # Feeds [moe_comm] expert_dtype = "fp8": dispatch delivers the rows in e4m3, one scale per
    # row (DispatchResult.recv_fp8), each quantised once.
    feeds_fp8_experts: ClassVar[bool] = False
    fp8_combine_grad: ClassVar[bool] = False  # takes [moe_comm] combine_grad_dtype = "fp8"
    # [moe_comm] overlap values it runs (moe_comm.titan.overlap): "chunked" needs calls that
    # run on a side stream and two dispatches in flight before their combines; "microbatch"
    # calls from two threads, one thread's between two sync points at a time.
    overlap: ClassVar[tuple[str, ...]] = ("none",)
    # Dispatch sends a token once to each rank that holds one of its experts (and combine
    # reduces there before sending back); False: once per (token, expert) pick, as TorchTitan's
    # all-to-all does. Decides how the metrics count the bytes that leave a rank.
    sends_once_per_rank: ClassVar[bool] = False
    # The [moe_comm] options that change what it does, so they identify its runs (run names,
    # W&B, identity.json: moe_comm.metrics.naming). num_sms, where it is one (the backend has an
    # SM budget), is also in its label in reports (`run_label`) and in the console header.
    IDENTITY_OPTIONS: ClassVar[tuple[str, ...]] = ()
    # Its MoE calls replay from CUDA graphs ([moe_comm] cuda_graphs), whose pools the memory counts.
    call_graphs: ClassVar[bool] = False
    # It holds NVSHMEM symmetric buffers, sized from the recipe (moe_comm.kernels.capacity),
    # outside torch's allocator: `check` prints them and the planner adds them to the memory.
    symmetric_heap: ClassVar[bool] = False
    # The backend the others are compared with (report's "vs" column, the scale model's ratio).
    baseline: ClassVar[bool] = False
    # Its colour in every plot (moe_comm.plots); "" picks one from its name.
    color: ClassVar[str] = ""
    # What the scale model prices it with; None: not priced (absent from the model's tables).
    costs: ClassVar[CostTraits | None] = None
    # The [moe_comm] fields that configure a backend (`backend` picks one, `peak_tflops` is MFU's).
    OPTIONS: ClassVar[tuple[str, ...]] = (
        "num_sms", "max_tokens_per_rank", "recv_capacity_factor", "dispatch_dtype", "virtual_node_size",
        "network_sms", "wait_timeout_s", "expert_dtype", "combine_grad_dtype", "cuda_graphs",
    )

    @classmethod
    def label(cls, dispatch_dtype: str = "bf16") -> str:
        """How tables name it with a dispatch dtype: the name, with the dtype unless bf16."""
        return cls.name if dispatch_dtype == "bf16" else f"{cls.name}-{dispatch_dtype}"

    @classmethod
    def run_label(cls, options: Mapping[str, Any]) -> str:
        """How a report names one of its runs from the run's [moe_comm] options: the name, with
        the SM budget where it has one ("nvshmem-sm20")."""
        sms = options.get("num_sms")
        return f"{cls.name}-sm{sms}" if "num_sms" in cls.IDENTITY_OPTIONS and sms is not None else cls.name

    @classmethod
    def identity_options(cls, options: MoEComm) -> dict[str, Any]:
        """The values of its IDENTITY_OPTIONS in `options`, in that order."""
        return {option: getattr(options, option) for option in cls.IDENTITY_OPTIONS}

    @classmethod
    def ignored_options(cls, run: RunPlan) -> dict[str, str]:
        """The backend options this backend does not read when it serves `run`, each with why:
        `check`, `submit` and `train` warn when a recipe sets one (it has no effect). This base
        reads none of them; subclasses drop the ones they read."""
        return {option: f'backend "{cls.name}" does not read it' for option in cls.OPTIONS}

    @classmethod
    def check_run(cls, run: RunPlan) -> list[str]:
        """Raise RecipeError, naming the field and the fix, if this backend cannot serve `run`.

        The one place a backend's abilities are written down: `check`, `submit` and `train`
        ask it before launch (through moe_comm.recipe), and every backend asks it again when
        built. Returns what it could not verify with what `run` knows (printed by `check`).
        This base covers what holds for every backend; subclasses add their own rules.
        """
        o = run.options
        if cls.cuda_only and run.device != "cuda":
            raise RecipeError(
                f"[moe_comm] backend = {cls.name!r} needs CUDA GPUs and this run is on {run.device}; "
                'on CPU use backend = "nccl"'
            )
        if run.num_experts % run.ep != 0:
            raise RecipeError(
                f"[parallelism] expert_parallel_degree = {run.ep} does not divide the {run.num_experts} "
                "experts of the model's flavor; pick a divisor"
            )
        if o.num_sms < 1:
            raise RecipeError(f"[moe_comm] num_sms = {o.num_sms} must be at least 1")
        if o.max_tokens_per_rank < 0:
            raise RecipeError(
                f"[moe_comm] max_tokens_per_rank = {o.max_tokens_per_rank} must be >= 0 "
                "(0 means local_batch_size x seq_len)"
            )
        if run.tokens_per_rank and 0 < o.max_tokens_per_rank < run.tokens_per_rank:
            raise RecipeError(
                f"[moe_comm] max_tokens_per_rank = {o.max_tokens_per_rank} is below the "
                f"{run.tokens_per_rank} tokens a rank routes per step (local_batch_size x seq_len); "
                "raise it or set 0"
            )
        if o.recv_capacity_factor != 0 and o.recv_capacity_factor < 1.0:
            raise RecipeError(
                f"[moe_comm] recv_capacity_factor = {o.recv_capacity_factor} must be 0 (exact worst "
                "case) or >= 1.0 (a multiple of the balanced load)"
            )
        if o.overlap not in cls.overlap:
            raise RecipeError(
                f'[moe_comm] overlap = "{o.overlap}": backend = "{cls.name}" runs overlap = '
                f'{" or ".join(repr(m) for m in cls.overlap)}: set overlap = "none" or choose another backend'
            )
        if o.overlap == "microbatch":
            cls.check_microbatch_overlap(run)
        if o.dispatch_dtype not in cls.dispatch_dtypes:
            raise RecipeError(
                f'[moe_comm] dispatch_dtype = "{o.dispatch_dtype}" is the nvshmem backend\'s; backend '
                f'= "{cls.name}" sends the model\'s rows as they are: set dispatch_dtype = "bf16"'
            )
        if o.combine_grad_dtype != "bf16" and not cls.fp8_combine_grad:
            raise RecipeError(
                f'[moe_comm] combine_grad_dtype = "{o.combine_grad_dtype}" is the nvshmem backend\'s; backend = '
                f'"{cls.name}" sends the output gradient as it is: set combine_grad_dtype = "bf16"'
            )
        if o.expert_dtype == "fp8":
            if not cls.feeds_fp8_experts:
                raise RecipeError(
                    f'[moe_comm] expert_dtype = "fp8" takes the experts\' rows in e4m3 from dispatch, each quantised '
                    f'once; backend = "{cls.name}" cannot feed them: set backend = "nvshmem" or expert_dtype = "bf16"'
                )
            return fp8_experts.check_run(run)
        return []

    @classmethod
    def check_microbatch_overlap(cls, run: RunPlan) -> None:
        """Where [moe_comm] overlap = "microbatch" runs (moe_comm.titan.pipeline says why): expert
        parallelism (communication to hide) and a pipeline whose schedule is Interleaved1F1B."""
        if run.ep == 1:
            raise RecipeError(
                '[moe_comm] overlap = "microbatch" hides one microbatch\'s dispatch and combine behind '
                "another's compute, and at expert_parallel_degree = 1 nothing crosses a link: set "
                'overlap = "none", or expert_parallel_degree > 1'
            )
        if run.pp == 1:
            raise RecipeError(
                '[moe_comm] overlap = "microbatch" overlaps a forward and a backward of the pipeline '
                "schedule, and pipeline_parallel_degree = 1 has no schedule: set pipeline_parallel_degree "
                '> 1 with pipeline_parallel_schedule = "Interleaved1F1B", or overlap = "chunked"'
            )
        schedule = run.pp_schedule.lower()
        if schedule and schedule not in (s.lower() for s in MICROBATCH_OVERLAP_SCHEDULES):
            why = {
                "1f1b": "with one stage per rank, the forward and the backward would run on the same FSDP "
                        "module in two threads (FSDP keeps one training state per module), and each "
                        "overlapped pair would wait for the next rank's backward of the same step",
                "dualpipev": "DualPipeV overlaps its own microbatches (pipeline_parallel_expert_parallel_overlap, "
                             'with [moe_comm] overlap = "none", or "chunked" outside its pairs)',
            }.get(schedule, "its steady state is not 1F1B-shaped")
            raise RecipeError(
                f'[moe_comm] overlap = "microbatch" runs the steady state of pipeline_parallel_schedule = '
                f'"Interleaved1F1B" only, not "{run.pp_schedule}": {why}. Set the schedule to '
                '"Interleaved1F1B" (2 or more stages per rank), or overlap = "chunked"'
            )

    @classmethod
    def check_num_sms(cls, run: RunPlan) -> list[str]:
        """num_sms within the GPU: exactly when the GPU is known, else within the largest known
        GPU (start-up checks again on the device)."""
        sms = run.gpu_sms or (gpus.lookup(run.gpu).sms if gpus.lookup(run.gpu) else 0)
        limit = sms or gpus.MAX_SMS
        if not 1 <= run.options.num_sms <= limit:
            gpu = f"{run.gpu} has {sms} SMs" if sms else f"no known GPU has more than {limit} SMs"
            raise RecipeError(
                f"[moe_comm] num_sms = {run.options.num_sms} must be between 1 and {limit} ({gpu}; "
                "20 leaves most of them for compute)"
            )
        if not sms:
            return [f"num_sms checked against {limit} SMs (the largest known GPU); the start-up checks the real one"]
        return []

    def __init__(self, layer: MoELayerSpec, ep_group: dist.ProcessGroup, config: MoEComm):
        self.layer = layer
        self.config = config
        self.ep_group = ep_group
        self.ep_size = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        type(self).check_run(run_plan_for_group(layer, ep_group, config))
        self.num_local_experts = layer.num_experts // self.ep_size

    @abstractmethod
    def dispatch(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor
    ) -> DispatchResult:
        ...

    @abstractmethod
    def combine(self, y_RD: torch.Tensor, handle: Any) -> torch.Tensor:
        """Returns out_TD: sum over k of topk_w_TK[t, k] * y(row of token t at expert k),
        accumulated in fp32 and returned in y_RD's dtype (a plain sum when the layer
        weights before the experts)."""
