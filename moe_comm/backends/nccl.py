"""The "nccl" backend: TorchTitan's standard expert-parallel path, op for op.

Dispatch is TorchTitan's `TokenReorderer` (histc, stable argsort, score gather), the gather of
routed rows, the optional score-before multiply, then `ExpertParallel._token_dispatch` (counts
all-to-all, host sync for the split sizes, `all_to_all_single_autograd`, `_permute`). Combine is
`ExpertParallel._token_combine` (`_unpermute`, all-to-all) followed by the unsort and the fp32
`bmm` (or sum) at the end of `MoE.forward`. Nothing is reordered or fused, so with the same seed
the loss equals TorchTitan's own deepseek_v3 path to the bit; that keeps backend comparisons fair.

At EP 1 there is nothing to exchange, and the backend is TorchTitan's own local path op for op:
the same sort and gather, then `_permute` / `_unpermute` as TorchTitan's `indices_padding_wrapper`
calls them around the grouped GEMM (no counts exchange, no host sync, no all-to-all).

On CPU the same code runs over gloo (the `_permute` indices use TorchTitan's CPU implementation,
installed by moe_comm.titan.cpu).
"""

from dataclasses import dataclass

import torch
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torchtitan.models.moe.utils import _permute, _unpermute

from moe_comm.backends.base import CommBackend, CostTraits, DispatchResult
from moe_comm.layout import RunPlan


@dataclass
class NcclHandle:
    """What combine needs to undo dispatch."""

    input_splits: list[int] | None  # rows this rank sends to each EP rank (None at EP 1)
    output_splits: list[int] | None  # rows this rank receives from each EP rank
    padded_shape: torch.Size  # shape of the received rows plus one zero row, before _permute
    permuted_indices_R: torch.Tensor  # _permute's gather indices (expert-major, padded)
    token_indices_sorted_TK: torch.Tensor  # argsort of topk_idx: flat (token, k) slot per row
    topk_w_TK: torch.Tensor  # routing weights, for the weighted sum in combine
    out_dtype: torch.dtype  # the MoE input's dtype, which TorchTitan casts the sum back to


class NcclBackend(CommBackend):
    name = "nccl"
    overlap = ("none", "chunked", "microbatch")
    baseline = True  # TorchTitan's own path: what the others are measured against
    color = "#1f77b4"
    costs = CostTraits(hierarchical=False, transport="NCCL", host_syncs_per_dispatch=1, layout="TorchTitan",
                       host_syncs_case="nccl_ep1")

    @classmethod
    def ignored_options(cls, run: RunPlan) -> dict[str, str]:
        """TorchTitan's all-to-all (and at EP 1 its local permute) has none of the backend options."""
        return {option: 'backend "nccl" is TorchTitan\'s own path, which has no such setting'
                for option in cls.OPTIONS}

    def dispatch(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor
    ) -> DispatchResult:
        num_experts, top_k = self.layer.num_experts, self.layer.top_k

        # TokenReorderer.forward
        num_tokens_per_expert_E = torch.histc(
            topk_idx_TK.view(-1), bins=num_experts, min=0, max=num_experts
        )
        token_indices_sorted_TK = torch.argsort(topk_idx_TK.view(-1), stable=True)
        topk_w_sorted_TK = topk_w_TK.view(-1)[token_indices_sorted_TK]

        # MoE.forward: gather the routed rows, optionally weight them before the experts
        routed_x_SD = x_TD[token_indices_sorted_TK // top_k]
        if self.layer.score_before_experts:
            routed_x_SD = (
                routed_x_SD.to(torch.float32) * topk_w_sorted_TK.reshape(-1, 1)
            ).to(x_TD.dtype)

        if self.ep_size == 1:  # TorchTitan's indices_padding_wrapper: pad each expert's segment
            padded_shape, recv_x_RD, permuted_indices_R, tokens_per_expert_L = _permute(
                routed_x_SD, num_tokens_per_expert_E, 1, self.num_local_experts
            )
            handle = NcclHandle(None, None, padded_shape, permuted_indices_R, token_indices_sorted_TK,
                                topk_w_TK, x_TD.dtype)
            return DispatchResult(recv_x_RD, tokens_per_expert_L, handle)

        # ExpertParallel._token_dispatch
        with torch.no_grad():
            num_tokens_per_expert_group_E = all_to_all_single(
                num_tokens_per_expert_E, None, None, group=self.ep_group
            )
            # the permute below reads it, and does not know AsyncCollectiveTensor
            num_tokens_per_expert_group_E = torch.ops._c10d_functional.wait_tensor(
                num_tokens_per_expert_group_E
            )
            input_splits = (
                num_tokens_per_expert_E.view(self.ep_size, -1)
                .sum(dim=1)
                .to(torch.device("cpu"), non_blocking=True)
            )
            # the device-to-host sync the nvshmem backend exists to avoid
            output_splits = (
                num_tokens_per_expert_group_E.view(self.ep_size, -1)
                .sum(dim=1)
                .to(torch.device("cpu"), non_blocking=False)
            )
            input_splits, output_splits = input_splits.tolist(), output_splits.tolist()

        recv_x_SD = all_to_all_single_autograd(
            routed_x_SD, output_splits, input_splits, self.ep_group
        )
        # rank-major -> expert-major, each local expert's segment zero-padded to
        # TOKEN_GROUP_ALIGN_SIZE_M
        padded_shape, recv_x_RD, permuted_indices_R, tokens_per_expert_L = _permute(
            recv_x_SD, num_tokens_per_expert_group_E, self.ep_size, self.num_local_experts
        )
        handle = NcclHandle(
            input_splits=input_splits,
            output_splits=output_splits,
            padded_shape=padded_shape,
            permuted_indices_R=permuted_indices_R,
            token_indices_sorted_TK=token_indices_sorted_TK,
            topk_w_TK=topk_w_TK,
            out_dtype=x_TD.dtype,
        )
        return DispatchResult(recv_x_RD, tokens_per_expert_L, handle)

    def combine(self, y_RD: torch.Tensor, handle: NcclHandle) -> torch.Tensor:
        top_k = self.layer.top_k

        # ExpertParallel._token_combine
        y_SD = _unpermute(y_RD, handle.padded_shape, handle.permuted_indices_R)
        if self.ep_size > 1:
            y_SD = all_to_all_single_autograd(
                y_SD, handle.input_splits, handle.output_splits, self.ep_group
            )

        # MoE.forward: unsort to (token, k) order, then the weighted sum over k
        num_tokens = handle.topk_w_TK.shape[0]
        y_unsorted_TKD = torch.zeros(
            (num_tokens * top_k, y_SD.shape[-1]), dtype=y_SD.dtype, device=y_SD.device
        )
        y_unsorted_TKD[handle.token_indices_sorted_TK] = y_SD
        y_unsorted_TKD = y_unsorted_TKD.reshape(-1, top_k, y_SD.shape[-1])
        if self.layer.score_before_experts:
            return y_unsorted_TKD.sum(dim=1)
        return (
            torch.bmm(handle.topk_w_TK.reshape(-1, 1, top_k), y_unsorted_TKD.float())
            .to(handle.out_dtype)
            .squeeze(1)
        )
