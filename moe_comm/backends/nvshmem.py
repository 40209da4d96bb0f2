"""The "nvshmem" backend: this project's CUDA kernels (csrc/), on one node or across nodes.

Dispatch sends each token over the network once per other node it goes to (to the rank with
the same local index there), and over NVLink once per rank of a node that holds one of its
experts; the receiver lays the rows out expert-major for the grouped GEMM. Combine reduces on
the way back: each rank's share, then each node's, then home. On one node only the NVLink hop
exists. Only the communication kernels run on the recipe's `num_sms` (`network_sms` of them
drive the network hop); the plan, staging and expert-major layout run as local kernels over
the whole GPU. There is no host synchronisation on the path: buffers and capacities are sized
from the recipe, so a step can be captured in a CUDA graph, and each call replays from a graph
of its own (moe_comm.kernels.call_graphs; [moe_comm] cuda_graphs = false turns that off). Nothing is
dropped silently: a call that overflows a buffer, routes badly or waits past `wait_timeout_s`
for a peer raises at the next call (or at `check_errors`), naming the field to change or the
peer that did not answer.
from the recipe, so a step can be captured in a CUDA graph. Nothing is dropped silently: a
call that overflows a buffer, routes badly or waits past `wait_timeout_s` for a peer raises at
the next call (or at `check_errors`), naming the field to change or the peer that did not answer.

It feeds the FP8 experts ([moe_comm] expert_dtype = "fp8", moe_comm.fp8_experts): its layout
kernel writes e4m3 rows with one fp32 scale per row, expert-major and padded as ever, straight
from an FP8 wire (each row quantised once, by its sender, with one scale) or quantised once from a
bf16 one; nothing is dequantised and quantised again. With combine_grad_dtype = "fp8" combine's
backward sends the output gradient in FP8 dispatch's wire format.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_comm import fp8_experts
from moe_comm.backends.base import (
    CommBackend, CostTraits, DispatchResult, MoELayerSpec, rows_in_compute_dtype, tokens_per_call,
)
from moe_comm.config import MoEComm
from moe_comm.errors import RecipeError
from moe_comm.fp8_experts import Fp8Rows
from moe_comm.kernels import call_graphs, emulated_link
from moe_comm.kernels.limits import LIMITS
from moe_comm.kernels.runtime import NvshmemRuntime, RuntimeRequest, load_library
from moe_comm.layout import RunPlan


@dataclass
class NvshmemHandle:
    """What combine (and both backwards) need from one dispatch: torch.ops.moe_comm's handle."""

    topk_w_TK: torch.Tensor
    tensors: tuple  # rank_pos, send_idx, rail_counts, net_route, recv_info, slot_rows, slot_w, slot_origin


def token_group_alignment() -> int:
    """TorchTitan's per-expert row alignment for grouped GEMMs (8 bf16, 16 fp8, 32 mxfp8),
    read at call time because the low-precision converters change it after model build."""
    from torchtitan.models.moe import utils

    return utils.TOKEN_GROUP_ALIGN_SIZE_M


class NvshmemBackend(CommBackend):
    name = "nvshmem"
    cuda_only = True
    dispatch_dtypes = ("bf16", "fp8")
    feeds_fp8_experts = True
    fp8_combine_grad = True
    overlap = ("none", "chunked", "microbatch")
    sends_once_per_rank = True
    IDENTITY_OPTIONS = ("num_sms", "dispatch_dtype", "virtual_node_size", "network_sms")
    symmetric_heap = True
    call_graphs = True
    color = "#d62728"
    costs = CostTraits(hierarchical=True, transport="our kernels", host_syncs_per_dispatch=0, layout="our kernels",
                       host_syncs_case="nvshmem_ep1")
    # What the kernels run (csrc/common/limits.h, read by moe_comm.kernels.limits).
    max_ranks = LIMITS.max_ranks  # ranks in one EP group
    max_ranks_per_node = LIMITS.max_ranks_per_node  # EP ranks per (virtual) node
    max_nodes = LIMITS.max_nodes  # (virtual) nodes one EP group spans
    max_top_k = LIMITS.max_top_k
    max_experts = LIMITS.max_experts
    fp8_block = 128  # channels per fp32 scale of an FP8 row

    @classmethod
    def ignored_options(cls, run: RunPlan) -> dict[str, str]:
        """It reads every backend option (at EP 1 too: it serves the MoE layers' local layout),
        but the network hop only exists when the EP group spans (virtual) nodes: network_sms
        drives it, and virtual_node_size matters only where it splits the group further than
        the real nodes do."""
        vns = run.options.virtual_node_size
        per_node = min(run.ep, run.ranks_per_node)  # ranks of one EP group on one real node
        virtual_nodes = max(1, run.ep // vns) if vns else run.ep_nodes
        ignored = {}
        if vns and virtual_nodes <= run.ep_nodes:
            ignored["virtual_node_size"] = (
                f"the EP group of {run.ep} ranks has {per_node} on each node already, so virtual nodes of {vns} "
                "ranks split it no further"
            )
        if virtual_nodes == 1:
            ignored["network_sms"] = (
                f"the EP group of {run.ep} rank(s) stays within one node, so there is no network hop to drive "
                "(set virtual_node_size below the ranks per node to test the inter-node path on one)"
            )
        return ignored

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
        if o.combine_grad_dtype == "fp8":
            if run.param_dtype and run.param_dtype != "bfloat16":
                raise RecipeError(
                    f'[moe_comm] combine_grad_dtype = "fp8" quantises the bf16 output gradient; [training] '
                    f'mixed_precision_param is "{run.param_dtype}": set it to "bfloat16" or use combine_grad_dtype = '
                    '"bf16"'
                )
            if run.hidden % cls.fp8_block:
                raise RecipeError(
                    f'[moe_comm] combine_grad_dtype = "fp8" scales rows per {cls.fp8_block} channels; the flavor\'s '
                    f'hidden size {run.hidden} is not a multiple of it: use combine_grad_dtype = "bf16"'
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
        super().__init__(layer, ep_group, config)  # check_run: what the kernels cannot run is refused here
        if config.expert_dtype == "fp8":
            fp8_experts.require_device(torch.device("cuda", torch.cuda.current_device()))
        load_library(ep_group)
        self.runtime: NvshmemRuntime | None = None
        self.capacity = 0  # expert rows of the last dispatch
        # this layer's calls replayed from CUDA graphs (moe_comm.kernels.call_graphs), unless off
        off = call_graphs.reason_off(torch.device("cuda"), self.config.cuda_graphs)
        self.graphs = None if off else call_graphs.CallGraphs(f"nvshmem backend, EP rank {self.ep_rank}")
        # a benchmark's emulated network link at EP 1 (moe_comm.kernels.emulated_link), else None
        self.emulated_link = emulated_link.for_backend(self.ep_size)

    @property
    def network_sms(self) -> int:
        """SMs of num_sms that drive the network hop (0 on one node)."""
        if self.runtime is None or self.runtime.sizes.nodes == 1:
            return 0
        return self.config.network_sms or max(1, self.config.num_sms // 2)

    def _start(self, x_TD: torch.Tensor) -> None:
        # Buffers and capacities hold one call: under overlap = "chunked" a call is half a
        # rank's tokens (the first call is already one).
        tokens = x_TD.shape[0]
        if self.config.max_tokens_per_rank:
            tokens = tokens_per_call(self.config.max_tokens_per_rank, self.config.overlap)
        request = RuntimeRequest(
            tokens=tokens,
            num_experts=self.layer.num_experts,
            top_k=self.layer.top_k,
            row_bytes=x_TD.shape[1] * x_TD.element_size(),
            recv_capacity_factor=self.config.recv_capacity_factor,
            virtual_node_size=self.config.virtual_node_size,
            wait_timeout_s=self.config.wait_timeout_s,
        )
        self.runtime = NvshmemRuntime.start(self.ep_group, request)

    def check_errors(self, synchronize: bool = False) -> None:
        """Raise if an earlier call overflowed, routed badly or gave up waiting. Without
        `synchronize` it reads what the GPU has written so far (no host sync); with it,
        everything issued so far."""
        if synchronize:
            torch.cuda.current_stream().synchronize()
        e = NvshmemRuntime.errors()
        if not e.any:
            return
        where = f"nvshmem backend, EP rank {self.ep_rank} of {self.ep_size}"
        if e.timeout_kernel:
            sizes = self.runtime.sizes if self.runtime else None
            peer = e.timeout_peer
            node = f" (node {peer // sizes.ranks_per_node}, local rank {peer % sizes.ranks_per_node})" if sizes else ""
            raise RuntimeError(
                f"{where}: the {e.timeout_kernel} kernel waited {self.config.wait_timeout_s:g} s for {e.timeout_phase} "
                f"- EP rank {peer}{node} - and gave up. That rank stopped answering or never made this call (every rank "
                "must make the same MoE calls in the same order); with several ranks on one GPU, ranks x num_sms must "
                "not exceed its SMs. Raise [moe_comm] wait_timeout_s only if the peer is merely slow. This process's "
                "NVSHMEM state is no longer usable: the run stops here."
            )
        if e.rows_needed or e.slots_buffer:
            needed = (f"{e.rows_needed} expert rows (capacity {self.capacity})" if e.rows_needed
                      else f"{e.slots_needed} slots of {e.slots_buffer}")
            raise RuntimeError(
                f"{where}: a dispatch needed {needed}: raise [moe_comm] recv_capacity_factor (now "
                f"{self.config.recv_capacity_factor}; 0 sizes every buffer for the exact worst case). No rows were "
                "dropped silently: this step's results are invalid and the run stops here."
            )
        if e.bad_expert_index:
            raise RuntimeError(f"{where}: the router produced an expert index outside [0, {self.layer.num_experts})")
        raise RuntimeError(f"{where}: a token picked the same expert twice (topk indices must be distinct per token)")

    def dispatch(self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor) -> DispatchResult:
        x_TD = rows_in_compute_dtype(x_TD)
        if self.runtime is None:
            self._start(x_TD)
        self.check_errors()
        sizes = self.runtime.sizes
        if x_TD.shape[0] > sizes.tokens:
            raise ValueError(
                f"{x_TD.shape[0]} tokens in one call exceed the {sizes.tokens} that [moe_comm] max_tokens_per_rank = "
                f"{self.config.max_tokens_per_rank} allows per call (overlap = {self.config.overlap!r})"
            )
        fp8_rows = self.config.expert_dtype == "fp8"
        align = fp8_experts.rows_alignment(token_group_alignment(), self.config.expert_dtype)
        self.capacity = fp8_experts.expert_rows(sizes.tokens, self.layer.num_experts, self.layer.top_k, self.ep_size,
                                                self.config.recv_capacity_factor, token_group_alignment(),
                                                self.config.expert_dtype)
        topk_idx_TK = topk_idx_TK.to(torch.int64).contiguous()
        topk_w_TK = topk_w_TK.to(torch.float32).contiguous()
        args = (x_TD.contiguous(), topk_idx_TK, topk_w_TK, self.layer.num_experts, self.capacity, align,
                self.config.dispatch_dtype == "fp8")
        if fp8_rows:  # an autograd Function of its own (ops.dispatch_fp8_rows says why): eager, not graphed
            from moe_comm.kernels.ops import dispatch_fp8_rows

            rows_grad_RD, recv_q_RD, recv_scale_R, tokens_per_expert_L, *handle = dispatch_fp8_rows(
                *args, self.config.num_sms, self.network_sms, sizes.shape)
            rows_grad_RD = emulated_link.hold(rows_grad_RD, self.emulated_link, "dispatch", x_TD.shape[0],
                                              self.config.num_sms)
            return DispatchResult(rows_grad_RD, tokens_per_expert_L, NvshmemHandle(topk_w_TK, tuple(handle)),
                                  Fp8Rows(recv_q_RD, recv_scale_R))
        recv_x_RD, tokens_per_expert_L, *handle, _ = call_graphs.run(
            self.graphs, "dispatch", (*args, False, self.config.num_sms, self.network_sms, sizes.shape))
        recv_x_RD = emulated_link.hold(recv_x_RD, self.emulated_link, "dispatch", x_TD.shape[0], self.config.num_sms)
        return DispatchResult(recv_x_RD, tokens_per_expert_L, NvshmemHandle(topk_w_TK, tuple(handle)))

    def combine(self, y_RD: torch.Tensor, handle: NvshmemHandle) -> torch.Tensor:
        out_TD = call_graphs.run(self.graphs, "combine", (
            y_RD.contiguous(), handle.topk_w_TK, *handle.tensors, True, self.config.combine_grad_dtype == "fp8",
            self.config.num_sms, self.network_sms,
        ))
        return emulated_link.hold(out_TD, self.emulated_link, "combine", out_TD.shape[0], self.config.num_sms)
