"""The "nvshmem" backend: this project's CUDA kernels (csrc/) over NVLink.

Dispatch sends each token once per rank that holds one of its experts and lays the rows out
expert-major on the receiver; combine reduces each rank's share before sending it back. Only
the communication kernels run on the recipe's `num_sms`; the expert-major layout (expand,
reduce) runs as local kernels over the whole GPU, like TorchTitan's own permute. There
is no host synchronisation on the path: buffers and the receive capacity are sized from the
recipe, so a step can be captured in a CUDA graph. Rows beyond capacity are never dropped
silently: the kernel records how many were needed and the next call (or `check_errors`)
raises, naming the recipe field to raise.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_comm.backends.base import CommBackend, DispatchResult, MoELayerSpec, RunPlan
from moe_comm.config import MoEComm
from moe_comm.errors import RecipeError
from moe_comm.kernels.limits import LIMITS
from moe_comm.kernels import COMBINE_PUSHER_WARPS, DISPATCH_SENDER_WARPS
from moe_comm.kernels.runtime import NvshmemRuntime, load_library

MAX_TOP_K = 8  # csrc/common.cuh kMaxTopK
MAX_EXPERTS = 1024  # csrc/common.cuh kMaxExperts
MAX_RANKS = 8  # csrc/common.cuh kMaxRanks


@dataclass
class NvshmemHandle:
    topk_idx_TK: torch.Tensor
    topk_w_TK: torch.Tensor
    token_slot_TW: torch.Tensor
    slot_rows: torch.Tensor
    slot_w: torch.Tensor
    slot_token: torch.Tensor
    recv_info: torch.Tensor
    align: int


def token_group_alignment() -> int:
    """TorchTitan's per-expert row alignment for grouped GEMMs (8 bf16, 16 fp8, 32 mxfp8),
    read at call time because the low-precision converters change it after model build."""
    from torchtitan.models.moe import utils

    return utils.TOKEN_GROUP_ALIGN_SIZE_M


def receive_capacity(max_tokens: int, layer: MoELayerSpec, ep_size: int, factor: float, align: int) -> int:
    """Rows one rank can receive: the balanced load times `factor`, or the exact worst case
    when factor is 0, plus room for every local expert's alignment padding."""
    local_experts = layer.num_experts // ep_size
    worst = max_tokens * ep_size * min(layer.top_k, local_experts)
    rows = worst if factor <= 0 else min(worst, math.ceil(factor * max_tokens * layer.top_k))
    return rows + local_experts * (align - 1)


class NvshmemBackend(CommBackend):
    name = "nvshmem"
    cuda_only = True
    fp8_dispatch = True
    # What the kernels run (csrc/common/limits.h, read by moe_comm.kernels.limits).
    max_ranks = LIMITS.max_ranks  # ranks in one EP group
    max_ranks_per_node = LIMITS.max_ranks_per_node  # EP ranks per (virtual) node
    max_nodes = LIMITS.max_nodes  # (virtual) nodes one EP group spans
    max_top_k = LIMITS.max_top_k
    max_experts = LIMITS.max_experts
    fp8_block = 128  # channels per fp32 scale of an FP8 row

    @classmethod
    def check_run(cls, run: RunPlan) -> list[str]:
        """Every rule of the kernels, before launch: the EP group's shape over (virtual) nodes,
        the routing bounds, the SM budget, FP8 dispatch and, across real nodes, NVSHMEM's
        InfiniBand settings in the platform environment."""
        notes = super().check_run(run)
        o = run.options
        if run.score_before_experts:
            raise RecipeError(
                "the nvshmem backend weights expert outputs in combine; this flavor sets "
                'score_before_experts = True, which needs [moe_comm] backend = "nccl"'
            )
        if not 1 <= run.top_k <= cls.max_top_k:
            raise RecipeError(
                f"[model] flavor routes each token to top_k = {run.top_k} experts; the nvshmem kernels "
                f"take 1..{cls.max_top_k}: choose another flavor or backend"
            )
        if run.num_experts > cls.max_experts:
            raise RecipeError(
                f"[model] flavor has {run.num_experts} experts; the nvshmem kernels take up to "
                f"{cls.max_experts}: choose another flavor or backend"
            )
        if not 1 <= run.ep <= cls.max_ranks:
            raise RecipeError(
                f"[parallelism] expert_parallel_degree = {run.ep}: the nvshmem kernels serve EP groups "
                f"of 1..{cls.max_ranks} ranks"
            )
        vns = o.virtual_node_size
        if vns < 0 or (vns and (run.ep % vns or run.ranks_per_node % vns)):
            raise RecipeError(
                f"[moe_comm] virtual_node_size = {vns} must be 0 (the real node) or divide both "
                f"expert_parallel_degree ({run.ep}) and the ranks per node ({run.ranks_per_node}, "
                "[cluster] gpus_per_node)"
            )
        node = vns or run.ranks_per_node
        where = "virtual node ([moe_comm] virtual_node_size)" if vns else "node ([cluster] gpus_per_node)"
        if run.ep > node and run.ep % node:
            raise RecipeError(
                f"[parallelism] expert_parallel_degree = {run.ep} spans several nodes, so it must be a "
                f"multiple of the {node} ranks per {where}"
            )
        if run.ep < node and node % run.ep:
            raise RecipeError(
                f"[parallelism] expert_parallel_degree = {run.ep} does not divide the {node} ranks per "
                f"{where}, so some EP groups would straddle two nodes; use a divisor or a multiple of {node}"
            )
        if min(run.ep, node) > cls.max_ranks_per_node:
            raise RecipeError(
                f"an EP group of {run.ep} ranks with {min(run.ep, node)} of them on one {where}: the "
                f"nvshmem kernels take at most {cls.max_ranks_per_node} ranks per node; set "
                f"[moe_comm] virtual_node_size = {cls.max_ranks_per_node} or less"
            )
        ep_nodes = max(1, run.ep // node)
        if ep_nodes > cls.max_nodes:
            raise RecipeError(
                f"[parallelism] expert_parallel_degree = {run.ep} spans {ep_nodes} nodes of {node} ranks; "
                f"the nvshmem kernels take at most {cls.max_nodes} nodes per EP group"
            )
        notes += cls.check_num_sms(run)
        if o.network_sms < 0 or (ep_nodes > 1 and o.network_sms >= o.num_sms):
            raise RecipeError(
                f"[moe_comm] network_sms = {o.network_sms} must be 0 (half of num_sms) or below "
                f"num_sms = {o.num_sms}: the rest forward over NVLink"
            )
        if not o.wait_timeout_s > 0:
            raise RecipeError(
                f"[moe_comm] wait_timeout_s = {o.wait_timeout_s} must be > 0: a wait without a bound "
                "is a silent hang"
            )
        if o.dispatch_dtype == "fp8":
            if run.param_dtype and run.param_dtype != "bfloat16":
                raise RecipeError(
                    f'[moe_comm] dispatch_dtype = "fp8" dequantises into bf16 rows, so it needs bf16 '
                    f'parameters; [training] mixed_precision_param is "{run.param_dtype}": set it to '
                    '"bfloat16" or use dispatch_dtype = "bf16"'
                )
            if run.hidden % cls.fp8_block:
                raise RecipeError(
                    f'[moe_comm] dispatch_dtype = "fp8" scales rows per {cls.fp8_block} channels; the '
                    f'flavor\'s hidden size {run.hidden} is not a multiple of it: use dispatch_dtype = "bf16"'
                )
        if run.ep > run.ranks_per_node:  # the EP group crosses real nodes: NVSHMEM needs the network
            if run.launch_env is None:
                notes.append("NVSHMEM's InfiniBand settings not checked: the launch environment is not known here")
            else:
                transport = run.launch_env.get("NVSHMEM_REMOTE_TRANSPORT", "")
                hcas = run.launch_env.get("NVSHMEM_HCA_LIST", "")
                if transport.lower() in ("", "none") or not hcas:
                    raise RecipeError(
                        f"the EP group of {run.ep} ranks spans {run.ep_nodes} nodes, so NVSHMEM needs the "
                        f"network, but {run.launch_env_source} sets NVSHMEM_REMOTE_TRANSPORT = "
                        f"{transport or '(unset)'!r} and NVSHMEM_HCA_LIST = {hcas or '(unset)'!r}: export "
                        "NVSHMEM_REMOTE_TRANSPORT=ibrc (or ibgda) and NVSHMEM_HCA_LIST there, as "
                        "slurm/env/nebius-b200.sh does"
                    )
        return notes

    def __init__(self, layer: MoELayerSpec, ep_group: dist.ProcessGroup, config: MoEComm):
        super().__init__(layer, ep_group, config)
        if layer.score_before_experts:
            raise ValueError(
                "the nvshmem backend weights expert outputs in combine; this model sets "
                "score_before_experts=True, which needs [moe_comm] backend = \"nccl\""
            )
        if not 1 <= layer.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k={layer.top_k}: the nvshmem backend supports 1..{MAX_TOP_K}")
        if layer.num_experts > MAX_EXPERTS:
            raise ValueError(f"num_experts={layer.num_experts}: the nvshmem backend supports up to {MAX_EXPERTS}")
        if self.ep_size > MAX_RANKS:
            raise ValueError(
                f"an EP group of {self.ep_size} ranks: the nvshmem backend is the intranode (NVLink) "
                f"path for up to {MAX_RANKS} GPUs; use backend = \"deepep\" or \"nccl\" across nodes"
            )
        if config.num_sms < 1:
            raise ValueError(f"[moe_comm] num_sms = {config.num_sms} must be at least 1")
        if not torch.cuda.is_available():
            raise RuntimeError('the nvshmem backend needs CUDA GPUs; on CPU use [moe_comm] backend = "nccl"')
        load_library(ep_group)
        self.runtime: NvshmemRuntime | None = None
        self.max_tokens = 0  # set with the buffers at the first dispatch
        self.capacity = 0
        # Warp roles per block (experiments/bench_comm.py sweeps them).
        self.sender_warps = DISPATCH_SENDER_WARPS
        self.pusher_warps = COMBINE_PUSHER_WARPS

    def _start(self, x_TD: torch.Tensor) -> None:
        max_tokens = self.config.max_tokens_per_rank or x_TD.shape[0]
        self.runtime = NvshmemRuntime.start(self.ep_group, max_tokens, x_TD.shape[1] * x_TD.element_size())
        self.max_tokens = max_tokens

    def check_errors(self, synchronize: bool = False) -> None:
        """Raise if an earlier call overflowed or saw bad routing. Without `synchronize` it reads
        what the GPU has written so far (no host sync); with it, everything issued so far."""
        if synchronize:
            torch.cuda.current_stream().synchronize()
        rows_needed, bad_index, duplicate = NvshmemRuntime.errors()
        if rows_needed:
            raise RuntimeError(
                f"nvshmem dispatch on EP rank {self.ep_rank} needed {rows_needed} receive rows but has "
                f"{self.capacity}: raise [moe_comm] recv_capacity_factor (now "
                f"{self.config.recv_capacity_factor}; 0 sizes for the exact worst case). No rows were "
                "dropped silently: this step's results are invalid and the run stops here."
            )
        if bad_index:
            raise RuntimeError(f"the router produced an expert index outside [0, {self.layer.num_experts})")
        if duplicate:
            raise RuntimeError("a token picked the same expert twice (topk indices must be distinct per token)")

    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> DispatchResult:
        if self.runtime is None:
            self._start(x_TD)
        self.check_errors()
        if x_TD.shape[0] > self.max_tokens:
            raise ValueError(
                f"{x_TD.shape[0]} tokens on this rank exceed [moe_comm] max_tokens_per_rank = {self.max_tokens}"
            )
        align = token_group_alignment()
        self.capacity = receive_capacity(
            self.max_tokens, self.layer, self.ep_size, self.config.recv_capacity_factor, align
        )
        topk_idx_TK = topk_idx_TK.to(torch.int64).contiguous()
        topk_w_TK = topk_w_TK.to(torch.float32).contiguous()
        recv_x_RD, tokens_per_expert_L, token_slot, slot_rows, slot_w, slot_token, recv_info = (
            torch.ops.moe_comm.dispatch(
                x_TD.contiguous(), topk_idx_TK, topk_w_TK, self.layer.num_experts, self.capacity, align,
                self.config.num_sms, self.sender_warps,
            )
        )
        handle = NvshmemHandle(topk_idx_TK, topk_w_TK, token_slot, slot_rows, slot_w, slot_token, recv_info, align)
        return DispatchResult(recv_x_RD, tokens_per_expert_L, handle)

    def combine(self, y_RD: torch.Tensor, handle: NvshmemHandle) -> torch.Tensor:
        return torch.ops.moe_comm.combine(
            y_RD.contiguous(), handle.topk_idx_TK, handle.topk_w_TK, handle.token_slot_TW, handle.slot_rows,
            handle.slot_w, handle.slot_token, handle.recv_info, self.layer.num_experts, handle.align, True,
            self.config.num_sms, self.pusher_warps,
        )
