"""The "deepep" backend: TorchTitan's DeepEP path (`torchtitan.distributed.deepep`) behind our
interface, so DeepEP runs through the same EP hook, metrics and tests as the other backends.

DeepEP must be built from source (https://github.com/deepseek-ai/DeepEP, V1 `deep_ep.Buffer`,
which is what TorchTitan 0.2.2 targets); the `deep-ep` package on PyPI is an unofficial snapshot
without headers that cannot build. The combine waits for DeepEP's stream before returning
(TorchTitan's DeepEPMoE overlaps it with the shared experts; ours keeps one interface).

One departure from the interface, inherited from TorchTitan's DeepEP path: the expert segments
are not padded to TOKEN_GROUP_ALIGN_SIZE_M (tokens_per_expert_L are exact counts), which the
bf16 grouped GEMM accepts; the float8/MXFP8 grouped-GEMM converters need the padding, so use
them with the "nccl" or "nvshmem" backend.
"""

import torch
import torch.distributed as dist

from moe_comm.backends.base import CommBackend, DispatchResult, MoELayerSpec
from moe_comm.config import MoEComm

INSTALL_HINT = (
    "[moe_comm] backend = \"deepep\" needs DeepEP v1.2.1 built from source (the `deep-ep` wheel on "
    "PyPI is a broken snapshot, DeepEP's main branch the incompatible V2). Build and install it into "
    "this environment with `python -m moe_comm build-deepep`, or choose backend = \"nccl\" or \"nvshmem\"."
)


def _import_titan_deepep():
    try:
        import deep_ep  # noqa: F401
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    from torchtitan.distributed import deepep  # registers torch.ops.deepep

    return deepep


class DeepEPBackend(CommBackend):
    name = "deepep"

    def __init__(self, layer: MoELayerSpec, ep_group: dist.ProcessGroup, config: MoEComm):
        super().__init__(layer, ep_group, config)
        self._deepep = _import_titan_deepep()
        from deep_ep import Buffer

        Buffer.set_num_sms(config.num_sms)

    def dispatch(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor
    ) -> DispatchResult:
        recv_x_RD, tokens_per_expert_L, state = self._deepep.dispatch_tokens(
            x_TD,
            topk_idx_TK,
            topk_w_TK,
            self.num_local_experts,
            self.layer.num_experts,
            self.ep_group,
            score_before_experts=self.layer.score_before_experts,
        )
        return DispatchResult(recv_x_RD, tokens_per_expert_L, (state, x_TD.dtype))

    def combine(self, y_RD: torch.Tensor, handle) -> torch.Tensor:
        state, out_dtype = handle
        out_TD = self._deepep.combine_tokens(y_RD, state)
        self._deepep.sync_combine()
        return out_TD.to(out_dtype)
