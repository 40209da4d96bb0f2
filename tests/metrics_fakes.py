"""A fake backend and process-group helpers for the metrics tests (no TorchTitan run needed).

The fake moves nothing between ranks: it expands each token to one row per routed expert,
sorted expert-major, and combines them back with the routing weights. That is all the
instrumentation needs: it times the calls and counts the routing, whatever the backend does.
"""

import os
import socket

import torch
import torch.distributed as dist

from moe_comm.backends import backend_class
from moe_comm.backends.base import CommBackend, DispatchResult, MoELayerSpec
from moe_comm.config import MoEComm


class FakeBackend(CommBackend):
    name = "nccl"

    def dispatch(self, x_TD, topk_idx_TK, topk_w_TK):
        top_k = topk_idx_TK.shape[1]
        order_R = topk_idx_TK.flatten().argsort(stable=True)
        token_R = order_R // top_k
        recv_x_RD = x_TD[token_R]
        local_E = self.layer.num_experts
        counts_L = torch.zeros(local_E, dtype=torch.int64).scatter_add_(
            0, topk_idx_TK.flatten(), torch.ones_like(topk_idx_TK.flatten())
        )
        return DispatchResult(recv_x_RD, counts_L, (order_R, token_R, topk_w_TK, x_TD.shape[0]))

    def combine(self, y_RD, handle):
        order_R, token_R, topk_w_TK, num_tokens = handle
        w_R = topk_w_TK.flatten()[order_R]
        out_TD = torch.zeros(num_tokens, y_RD.shape[1], dtype=y_RD.dtype)
        return out_TD.index_add(0, token_R, y_RD * w_R[:, None])


def make_fake(name: str = "nccl", num_experts: int = 4, top_k: int = 2, hidden: int = 8):
    """A fake that the metrics take for backend `name`: its name and how its class sends."""
    backend = FakeBackend(MoELayerSpec(num_experts, top_k, hidden), dist.group.WORLD, MoEComm(backend=name))
    backend.name = name
    backend.sends_once_per_rank = backend_class(name).sends_once_per_rank
    return backend


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
