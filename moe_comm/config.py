"""The `[moe_comm]` recipe section, merged into TorchTitan's JobConfig.

TorchTitan imports this module through `[job] custom_config_module = "moe_comm.config"` and merges
the dataclass named `JobConfig` into its own, so a recipe stays one TorchTitan TOML file.
"""

from dataclasses import dataclass, field
from typing import Literal

BackendName = Literal["nccl", "nvshmem", "deepep"]
BACKENDS: tuple[str, ...] = ("nccl", "nvshmem", "deepep")


@dataclass
class MoEComm:
    backend: BackendName = "nccl"
    """Which backend moves MoE tokens: "nccl" (TorchTitan's all-to-all; gloo on CPU),
    "nvshmem" (this project's CUDA kernels) or "deepep" (DeepEP, installed from source)."""

    num_sms: int = 20
    """SMs the nvshmem/deepep kernels may use; the rest stay free for compute."""

    max_tokens_per_rank: int = 0
    """Most tokens one rank dispatches per MoE call; 0 means local_batch_size * seq_len.
    Sizes the symmetric buffers once at start-up."""

    recv_capacity_factor: float = 0.0
    """Rows each rank can receive, as a multiple of the balanced load
    (max_tokens_per_rank * top_k). 0 means the exact worst case, every source rank sending all
    its tokens here: max_tokens_per_rank * ep_size * min(top_k, local experts). Routed rows
    beyond capacity raise an error naming this field; they are never dropped."""


@dataclass
class JobConfig:
    moe_comm: MoEComm = field(default_factory=MoEComm)
