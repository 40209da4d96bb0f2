"""The one interface every MoE communication backend implements.

A backend moves routed tokens from the rank that owns them to the ranks that own their experts
(dispatch), and brings the expert outputs back, reduced with the routing weights (combine).
TorchTitan's expert-parallel hook (moe_comm.titan) calls it; the same oracle tests run against
every backend.

Shapes: T tokens on this rank, K = top_k, D = hidden, E = experts in the layer, L = experts on
this rank (E / ep_size), R = rows handed to the local experts (a static bound for backends that
avoid host syncs, the exact count for the NCCL path).
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from moe_comm.config import MoEComm


@dataclass(frozen=True)
class MoELayerSpec:
    """What a backend must know about the MoE layer it serves; fixed for the whole run."""

    num_experts: int
    top_k: int
    hidden: int
    # False (every DeepSeek-V3 flavor): combine weights the expert outputs. True: dispatch
    # weights the expert inputs and combine is a plain sum.
    score_before_experts: bool = False


@dataclass
class DispatchResult:
    """What dispatch hands to the grouped experts, and what combine needs to undo it."""

    # Rows for the local experts, expert-major: expert 0's rows, then expert 1's, ...; each
    # expert's segment is padded with zero rows to TorchTitan's TOKEN_GROUP_ALIGN_SIZE_M.
    recv_x_RD: torch.Tensor
    # Rows per local expert including padding (what TorchTitan's grouped GEMM takes as offsets).
    tokens_per_expert_L: torch.Tensor
    # Backend-private state for combine (indices, splits, buffers).
    handle: Any


class CommBackend(ABC):
    """dispatch(x_TD, topk_idx_TK, topk_w_TK) -> DispatchResult; combine(y_RD, handle) -> out_TD.

    Both ops are differentiable: gradients flow to x_TD and to topk_w_TK (the router), so the
    backend is a drop-in for TorchTitan's all-to-all in training.
    """

    name: ClassVar[str]

    def __init__(self, layer: MoELayerSpec, ep_group: dist.ProcessGroup, config: MoEComm):
        self.layer = layer
        self.config = config
        self.ep_group = ep_group
        self.ep_size = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        if layer.num_experts % self.ep_size != 0:
            raise ValueError(
                f"num_experts={layer.num_experts} is not divisible by the EP group size "
                f"{self.ep_size}; set [parallelism] expert_parallel_degree to a divisor of it"
            )
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
