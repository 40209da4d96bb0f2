"""DeepSeek-V3 with a token-level MoE, so a comm backend sees tokens and their routing.

TorchTitan's standard `MoE.forward` sorts and gathers the routed rows itself and hands the
experts module only (rows, counts); a dispatch that wants to move each token once (dedup, as
DeepEP and our kernels do) needs the tokens and their top-k instead. Under expert parallelism
`TokenLevelMoE` runs router -> backend.dispatch(x_TD, topk_idx_TK, topk_w_TK) -> grouped experts
-> backend.combine -> + shared experts, with the backend that moe_comm.titan.expert_parallel
attached to it.

Why the calls are here and not in the experts module's forward hooks (where TorchTitan's
ExpertParallel does its all-to-all): FSDP's pre-forward hook on the experts runs first and
casts every floating-point input to the bf16 param dtype, which would round the fp32 routing
weights before combine. TorchTitan's standard path never passes them through that module, so
to match it bit for bit in bf16 they must not either.

Without expert parallelism (no backend attached) it runs TorchTitan's standard forward.
"""

import torch
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs
from torchtitan.models.moe import MoE
from torchtitan.models.moe.moe import MoEArgs

from moe_comm.backends.base import CommBackend


class TokenLevelMoE(MoE):
    """TorchTitan's MoE (same parameters, buffers and init) with a token-level forward under EP."""

    def __init__(self, moe_args: MoEArgs, dim: int, hidden_dim: int):
        super().__init__(moe_args, dim, hidden_dim)
        # Set by moe_comm.titan.expert_parallel.apply_backend_ep when EP shards the experts.
        self.comm_backend: CommBackend | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm_backend is None:
            return super().forward(x)

        bs, slen, dim = x.shape
        x_TD = x.view(-1, dim)
        topk_w_TK, topk_idx_TK, num_tokens_per_expert_E = self.router(x_TD, self.expert_bias)

        # Expert usage for the load-balancing bias, exactly as MoE.forward counts it.
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert_E)

        # recv_x_RD: this rank's experts' rows, expert-major, each segment padded for grouped_mm
        dispatched = self.comm_backend.dispatch(x_TD, topk_idx_TK, topk_w_TK)
        y_RD = self.experts(dispatched.recv_x_RD, dispatched.tokens_per_expert_L)
        # back to token order, weighted by topk_w_TK (fp32 accumulation)
        routed_out_TD = self.comm_backend.combine(y_RD, dispatched.handle)

        if self.shared_experts is None:
            return routed_out_TD.reshape(bs, slen, dim)
        return (self.shared_experts(x_TD) + routed_out_TD).reshape(bs, slen, dim)


class MoECommDeepSeekV3Model(DeepSeekV3Model):
    """TorchTitan's DeepSeekV3Model whose MoE layers are `TokenLevelMoE`.

    The MoE modules are rebuilt in the same slots with the same arguments, so parameter names,
    order and initialisation (and hence checkpoints and the seeded loss) match TorchTitan's.
    """

    def __init__(self, model_args: DeepSeekV3ModelArgs):
        super().__init__(model_args)
        for block in self.layers.values():
            if block.moe_enabled:
                block.moe = TokenLevelMoE(
                    model_args.moe_args, dim=model_args.dim, hidden_dim=model_args.moe_inter_dim
                )
