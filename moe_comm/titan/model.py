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

The backend is attached at every EP degree, EP 1 included (one rank holds every expert), so
the recipe's backend is what runs: at EP 1 nothing crosses a link, and the backend's local work
(the nccl backend: TorchTitan's own sort, gather and padding permute; nvshmem: its layout
kernels) is what the step pays. Rows reach the experts already laid out for the grouped GEMM
(`TokenLevelExperts`).

With `[moe_comm] overlap = "chunked"`, or under an overlap across microbatches (DualPipeV's EP
overlap or overlap "microbatch": `sync_points`, set by moe_comm.titan.parallelize), the tail
after the router is moe_comm.titan.overlap's: dispatch and combine on the comm stream, chunk by
chunk or between TorchTitan's sync points, beside the other compute.

Every dispatch and combine call goes through moe_comm.titan.recompute, so under activation
checkpointing the backward's recompute replays what the forward's calls returned instead of
communicating again.

Without a backend (a model built outside moe_comm.titan's parallelize) it runs TorchTitan's
standard forward.
"""

from typing import Callable

import torch
from torch.distributed.tensor import DTensor
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs
from torchtitan.models.moe import MoE
from torchtitan.models.moe import moe as titan_moe
from torchtitan.models.moe.moe import GroupedExperts, MoEArgs

from moe_comm import fp8_experts
from moe_comm.backends.base import CommBackend
from moe_comm.titan import attention, overlap, recompute


class TokenLevelExperts(GroupedExperts):
    """TorchTitan's GroupedExperts (same parameters and init) whose input comes from a backend's
    dispatch, already expert-major as the grouped GEMM takes it (nccl and nvshmem pad each
    expert's segment to TOKEN_GROUP_ALIGN_SIZE_M; deepep's exact segments suit bf16), and that can
    run several token chunks in one call.

    TorchTitan pads inside the experts module when the weights are not sharded on an "ep" mesh
    (`indices_padding_wrapper`), i.e. at EP 1; rows a backend laid out must not be gathered and
    scattered a second time, so once `rows_from_backend` is set the grouped GEMM runs on them as
    they are, at every EP degree. Chunks run in one call so FSDP gathers and reduces the expert
    weights once per layer however many chunks there are (two calls would gather twice and
    reduce-scatter a partial gradient).

    With `[moe_comm] expert_dtype = "fp8"` the backend hands the rows in e4m3 (`fp8_rows`) and the
    grouped GEMMs run in FP8 (moe_comm.fp8_experts), on the same parameters."""

    rows_from_backend: bool = False
    # set by moe_comm.titan.parallelize where the FP8 experts keep their e4m3 weights over the step
    # (fp8_experts.caches_weights)
    fp8_weight_cache: "fp8_experts.WeightCache | None" = None

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                fp8_rows: "fp8_experts.Fp8Rows | None" = None) -> torch.Tensor:
        if fp8_rows is not None:  # x carries the rows' gradient (a zero-stride view), not the rows
            return fp8_experts.grouped_experts(*self._local_weights(), x, fp8_rows, num_tokens_per_expert,
                                               cache=self.fp8_weight_cache)
        if x.dim() == 2 and x.numel() and x.stride() == (0, 0):
            raise RuntimeError("the experts got the gradient carrier of FP8 rows without the rows: with [moe_comm] "
                               'expert_dtype = "fp8" pass DispatchResult.recv_fp8 to the experts')
        if not (self.rows_from_backend and self.use_grouped_mm):
            return super().forward(x, num_tokens_per_expert)
        # looked up at call time: TorchTitan's apply_compile swaps in a compiled version
        return titan_moe._run_experts_grouped_mm(*self._local_weights(), x, num_tokens_per_expert)

    def _local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """w1, w2, w3 as this rank's local tensors (its shard of the experts under EP)."""
        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))

    def forward_chunks(
        self,
        chunks: list[tuple[torch.Tensor, torch.Tensor]],
        streams: "overlap.Streams",
        receive: Callable | None = None,
        send: Callable | None = None,
    ) -> tuple[list, list]:
        """The experts on each (recv_x_RD, tokens_per_expert_L) chunk, in one call. With
        `receive(i, recv_x_RD, tokens_per_expert_L)` (onto the compute stream: the wait for chunk
        i's dispatch) and `send(i, y_RD, ready)` (chunk i's combine, after the compute stream's
        mark `ready`), each chunk's dispatch is received right after the previous chunk's
        experts and before its combine is sent (moe_comm.titan.overlap says why that order).
        Returns (what send returned, or the outputs; the marks after each chunk's experts)."""
        outs, ready = [], []
        x, n = receive(0, *chunks[0]) if receive else chunks[0]
        for i in range(len(chunks)):
            y = self.forward(x, n)
            ready.append(streams.mark(streams.compute))
            if i + 1 < len(chunks):
                x, n = receive(i + 1, *chunks[i + 1]) if receive else chunks[i + 1]
            outs.append(send(i, y, ready[-1]) if send else y)
        return outs, ready


class TokenLevelMoE(MoE):
    """TorchTitan's MoE (same parameters, buffers and init) with a token-level forward under EP."""

    def __init__(self, moe_args: MoEArgs, dim: int, hidden_dim: int):
        super().__init__(moe_args, dim, hidden_dim)
        self.experts = TokenLevelExperts(
            dim=dim, hidden_dim=hidden_dim, num_experts=moe_args.num_experts, use_grouped_mm=moe_args.use_grouped_mm
        )
        # Set by moe_comm.titan.expert_parallel.apply_backend_ep (every EP degree).
        self.comm_backend: CommBackend | None = None
        # Set by moe_comm.titan.parallelize under an overlap across microbatches (TorchTitan's
        # sync points: DualPipeV's EP overlap, or overlap "microbatch").
        self.sync_points = False
        self._fsdp_chunks_registered = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.comm_backend is None:
            return super().forward(x)

        bs, slen, dim = x.shape
        x_TD = x.view(-1, dim)
        topk_w_TK, topk_idx_TK, num_tokens_per_expert_E = self.router(x_TD, self.expert_bias)

        # Expert usage for the load-balancing bias, exactly as MoE.forward counts it.
        with torch.no_grad():
            self.tokens_per_expert.add_(num_tokens_per_expert_E)

        chunked = self.comm_backend.config.overlap == "chunked"
        if chunked or self.sync_points:
            self._register_fsdp_chunks()
            # decided by the forward, replayed by its recompute (which may run in another pair state)
            chunks = recompute.choice("chunks", lambda: overlap.chunks_for(chunked, self.sync_points))
            out_TD = overlap.overlapped_moe(
                self, x_TD, topk_idx_TK, topk_w_TK, chunks=chunks, sync_points=self.sync_points,
            )
            return out_TD.reshape(bs, slen, dim)

        # recv_x_RD: this rank's experts' rows, expert-major, each segment padded for grouped_mm
        # (under activation checkpointing, the recompute replays what the forward's calls returned)
        dispatched = recompute.dispatch(self.comm_backend, x_TD, topk_idx_TK, topk_w_TK)
        y_RD = self.experts(dispatched.recv_x_RD, dispatched.tokens_per_expert_L, dispatched.recv_fp8)
        # back to token order, weighted by topk_w_TK (fp32 accumulation)
        routed_out_TD = recompute.combine(self.comm_backend, y_RD, dispatched.handle)

        if self.shared_experts is None:
            return routed_out_TD.reshape(bs, slen, dim)
        return (self.shared_experts(x_TD) + routed_out_TD).reshape(bs, slen, dim)

    def _register_fsdp_chunks(self) -> None:
        """Make `forward_chunks` run FSDP's forward hooks, as `forward` does (a no-op without
        FSDP). Done at the first overlapped call: FSDP wraps the experts after the model is built."""
        if not self._fsdp_chunks_registered:
            from torch.distributed.fsdp import register_fsdp_forward_method

            register_fsdp_forward_method(self.experts, "forward_chunks")
            self._fsdp_chunks_registered = True


class MoECommDeepSeekV3Model(DeepSeekV3Model):
    """TorchTitan's DeepSeekV3Model whose MoE layers are `TokenLevelMoE`, and whose attention can
    also be variable-length block-causal (attn_type "varlen": moe_comm.titan.attention).

    The MoE (and varlen attention) modules are rebuilt in the same slots with the same arguments,
    so parameter names, order and initialisation (and hence checkpoints and the seeded loss) match
    TorchTitan's.
    """

    def __init__(self, model_args: DeepSeekV3ModelArgs):
        super().__init__(attention.buildable_args(model_args))
        self.model_args = model_args
        if model_args.attn_type == attention.VARLEN:
            attention.use_varlen(self, model_args)
        for block in self.layers.values():
            if block.moe_enabled:
                block.moe = TokenLevelMoE(
                    model_args.moe_args, dim=model_args.dim, hidden_dim=model_args.moe_inter_dim
                )

    def get_attention_masks(self, input_batch: torch.Tensor, tokenizer, extra_inputs=None):
        if self.model_args.attn_type == attention.VARLEN:
            return attention.varlen_documents(self.model_args, input_batch, tokenizer)
        return super().get_attention_masks(input_batch, tokenizer, extra_inputs)
