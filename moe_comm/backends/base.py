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
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from moe_comm import fp8_experts, gpus
from moe_comm.config import MoEComm
from moe_comm.errors import RecipeError
from moe_comm.fp8_experts import Fp8Rows


# Token chunks per MoE layer call for each [moe_comm] overlap (moe_comm.titan.overlap).
OVERLAP_CHUNKS = {"none": 1, "chunked": 2}


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


@dataclass(frozen=True)
class RunPlan:
    """What is known about a run before its backend starts, for `CommBackend.check_run`.

    recipe.py builds it before launch (`check`, `submit`, `train` before torchrun) from the
    recipe's content and this machine; the model build builds it again from the live process
    group and device. Fields the caller cannot know are left at their "unknown" value (0, "",
    None), and a check that needs them says what it could not verify instead of guessing.
    """

    options: MoEComm  # the [moe_comm] section, overrides applied
    device: str  # "cuda" or "cpu": where the ranks run
    ep: int  # ranks in one EP group
    ranks_per_node: int  # processes per real node
    nodes: int  # nodes in the job
    num_experts: int
    top_k: int
    hidden: int
    score_before_experts: bool = False
    tokens_per_rank: int = 0  # tokens one rank routes per MoE call (0: unknown)
    param_dtype: str = ""  # [training] mixed_precision_param ("": unknown)
    converters: tuple[str, ...] = ()
    gpu: str = ""  # GPU model or device name ("": unknown before launch)
    gpu_sms: int = 0  # its SM count (0: unknown)
    launch_env: Mapping[str, str] | None = field(default=None, compare=False)
    """The environment the ranks start with (None: unknown), e.g. what [cluster] env_file sets."""
    launch_env_source: str = "the launch environment"  # where launch_env comes from, for messages
    python_env: str = ""  # "": the ranks run in this Python environment; else where they run
    activation_checkpoint: str = ""  # [activation_checkpoint] mode ("": unknown)
    dual_pipe_v: bool = False
    """TorchTitan's DualPipeV EP overlap is on: pipeline and expert parallelism, [parallelism]
    pipeline_parallel_schedule = "DualPipeV" and pipeline_parallel_expert_parallel_overlap."""

    @property
    def ep_nodes(self) -> int:
        """Real nodes one EP group spans (EP groups are consecutive ranks)."""
        return max(1, -(-self.ep // self.ranks_per_node))

    @classmethod
    def for_group(cls, layer: "MoELayerSpec", ep_group: dist.ProcessGroup, config: MoEComm) -> "RunPlan":
        """The plan as far as a process that builds a backend can see it: its EP group, its
        device, torchrun's LOCAL_WORLD_SIZE and its environment (what NVSHMEM will read)."""
        ep = dist.get_world_size(ep_group)
        world = dist.get_world_size() if dist.is_initialized() else ep
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        device = gpus.this_machine()
        return cls(
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

    name: ClassVar[str]
    cuda_only: ClassVar[bool] = False
    fp8_dispatch: ClassVar[bool] = False  # takes [moe_comm] dispatch_dtype = "fp8"
    # Feeds [moe_comm] expert_dtype = "fp8": dispatch delivers the rows in e4m3, one scale per
    # row (DispatchResult.recv_fp8), each quantised once.
    feeds_fp8_experts: ClassVar[bool] = False
    fp8_combine_grad: ClassVar[bool] = False  # takes [moe_comm] combine_grad_dtype = "fp8"
    # [moe_comm] overlap values it runs (moe_comm.titan.overlap): "chunked" needs calls that
    # run on a side stream and two dispatches in flight before their combines.
    overlap: ClassVar[tuple[str, ...]] = ("none",)
    # The [moe_comm] fields that configure a backend (`backend` picks one, `peak_tflops` is MFU's).
    OPTIONS: ClassVar[tuple[str, ...]] = (
        "num_sms", "max_tokens_per_rank", "recv_capacity_factor", "dispatch_dtype", "virtual_node_size",
        "network_sms", "wait_timeout_s", "expert_dtype", "combine_grad_dtype",
    )

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
        if run.dual_pipe_v and run.activation_checkpoint not in ("", "none"):
            raise RecipeError(
                '[parallelism] pipeline_parallel_schedule = "DualPipeV" with '
                "pipeline_parallel_expert_parallel_overlap = true overlaps the MoE communication "
                "with the other microbatch's compute, which TorchTitan does not run with "
                f'[activation_checkpoint] mode = "{run.activation_checkpoint}": set mode = "none", '
                "or pipeline_parallel_expert_parallel_overlap = false (then [moe_comm] overlap = "
                '"chunked" works with activation checkpointing)'
            )
        if run.dual_pipe_v and o.overlap != "none":
            raise RecipeError(
                f'[moe_comm] overlap = "{o.overlap}" and DualPipeV\'s EP overlap ([parallelism] '
                'pipeline_parallel_schedule = "DualPipeV", pipeline_parallel_expert_parallel_overlap '
                "= true) both hide the MoE communication, and their sync points conflict: set "
                'overlap = "none" or pipeline_parallel_expert_parallel_overlap = false'
            )
        if o.dispatch_dtype != "bf16" and not cls.fp8_dispatch:
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
        type(self).check_run(RunPlan.for_group(layer, ep_group, config))
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
