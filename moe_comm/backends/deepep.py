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

import importlib
import importlib.util

import torch
import torch.distributed as dist

from moe_comm import gpus
from moe_comm.backends.base import CommBackend, CostTraits, DispatchResult, MoELayerSpec, rows_in_compute_dtype
from moe_comm.config import MoEComm
from moe_comm.errors import RecipeError
from moe_comm.layout import RunPlan

PIN = "v1.2.1"  # the last DeepEP release with the V1 `Buffer` API that TorchTitan 0.2.2 calls
# EP group sizes DeepEP v1.2.1 has kernel configurations for (`Buffer.get_dispatch_config` and
# `get_combine_config` assert on any other, TorchTitan's DeepEP path asks for them every call).
EP_SIZES = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)
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


def _check_deep_ep_importable() -> list[str]:
    """deep_ep is installed here and has the V1 API (`Buffer.get_dispatch_layout`); DeepEP's main
    branch (V2) has `ElasticBuffer` instead, which TorchTitan 0.2.2's DeepEP path cannot call."""
    if importlib.util.find_spec("deep_ep") is None:
        raise RecipeError(INSTALL_HINT)
    try:
        deep_ep = importlib.import_module("deep_ep")
    except Exception as e:  # its CUDA extension cannot load without a GPU driver
        if gpus.this_machine() is None:
            return [f"deep_ep is installed but does not import on this machine ({type(e).__name__}: {e}); "
                    "its API is checked again before the ranks start"]
        raise RecipeError(f"deep_ep is installed but does not import ({type(e).__name__}: {e}); rebuild it. {INSTALL_HINT}") from e
    buffer = getattr(deep_ep, "Buffer", None)
    if buffer is None or not hasattr(buffer, "get_dispatch_layout"):
        where = getattr(deep_ep, "__file__", "?")
        kind = "DeepEP V2 (ElasticBuffer)" if hasattr(deep_ep, "ElasticBuffer") else "not DeepEP's V1 API"
        raise RecipeError(
            f"deep_ep at {where} is {kind}: TorchTitan 0.2.2's DeepEP path needs the V1 "
            f"`deep_ep.Buffer.get_dispatch_layout`. Install the pinned release {PIN} "
            "with `python -m moe_comm build-deepep`, or choose backend "
            '"nccl" or "nvshmem"'
        )
    return []


class DeepEPBackend(CommBackend):
    name = "deepep"
    cuda_only = True
    overlap = ("none", "chunked", "microbatch")
    sends_once_per_rank = True
    IDENTITY_OPTIONS = ("num_sms",)
    color = "#2ca02c"
    # TorchTitan 0.2.2's DeepEP path waits on the host about five times per forward dispatch
    # (torchtitan/distributed/deepep/deepep.py: DeepEP's CPU wait for the received counts, two mask
    # gathers, repeat_interleave, a blocking copy); experiments/host_syncs.py's deepep_2pe case
    # measures how often and at what cost
    costs = CostTraits(hierarchical=True, transport="DeepEP kernels", host_syncs_per_dispatch=5,
                       layout="TorchTitan DeepEP", host_syncs_case="deepep_2pe")

    @classmethod
    def check_run(cls, run: RunPlan) -> list[str]:
        """DeepEP's own limits, which it enforces with device asserts that break the CUDA context
        (so they must never be reached): bf16 rows, an even SM count, no padding."""
        notes = super().check_run(run) + cls.check_num_sms(run)
        if run.ep == 1:
            raise RecipeError(
                "[parallelism] expert_parallel_degree = 1: DeepEP has no one-rank configuration (its Buffer "
                f"serves EP groups of {', '.join(map(str, EP_SIZES))} ranks), so at EP 1 use [moe_comm] backend = "
                '"nvshmem" (our kernels, on one GPU too) or "nccl" (TorchTitan\'s local path)'
            )
        if run.ep not in EP_SIZES:
            raise RecipeError(
                f"[parallelism] expert_parallel_degree = {run.ep}: DeepEP {PIN} has kernel configurations for "
                f"EP groups of {', '.join(map(str, EP_SIZES))} ranks only; pick one of those or another backend"
            )
        if run.options.num_sms % 2:
            raise RecipeError(
                f"[moe_comm] num_sms = {run.options.num_sms}: DeepEP needs an even SM count "
                f"(it asserts it); use {run.options.num_sms + 1} or {run.options.num_sms - 1}"
            )
        if run.param_dtype == "float32":
            raise RecipeError(
                '[training] mixed_precision_param = "float32": DeepEP\'s combine asserts on fp32 rows '
                'and leaves the GPU unusable; use "bfloat16" with backend = "deepep", or backend '
                '"nccl" or "nvshmem" for fp32'
            )
        grouped = [c for c in run.converters if c.startswith("quantize.grouped_mm")]
        if grouped:
            raise RecipeError(
                f'[moe_comm] backend = "deepep" does not pad expert segments, which [model] '
                f'converters {grouped} need; use backend "nccl" or "nvshmem", or drop them'
            )
        if run.python_env:
            notes.append(f"deep_ep not checked here: the ranks run in {run.python_env}; the start-up checks it there")
        else:
            notes += _check_deep_ep_importable()
        return notes

    @classmethod
    def ignored_options(cls, run: RunPlan) -> dict[str, str]:
        """DeepEP takes its SM budget from us (Buffer.set_num_sms); it sizes its buffers, waits
        and dispatch dtype through TorchTitan's DeepEP path, which reads none of our options."""
        ignored = super().ignored_options(run)
        ignored.pop("num_sms")
        return {k: 'backend "deepep" runs TorchTitan\'s DeepEP path, which does not read it' for k in ignored}

    def __init__(self, layer: MoELayerSpec, ep_group: dist.ProcessGroup, config: MoEComm):
        super().__init__(layer, ep_group, config)
        self._deepep = _import_titan_deepep()
        from deep_ep import Buffer

        Buffer.set_num_sms(config.num_sms)

    @staticmethod
    def check_rows(rows: torch.Tensor, op: str) -> None:
        """DeepEP's kernels take bf16 rows only; anything else trips a device assert in combine
        (intranode.cu:235) that breaks the CUDA context for the rest of the process. The recipe
        check refuses fp32 params; this refuses the call itself (a layer used outside a recipe)."""
        if rows.dtype != torch.bfloat16:
            raise ValueError(
                f"deepep backend {op}: rows are {rows.dtype}; DeepEP's kernels take torch.bfloat16 only "
                '(an fp32 combine hits its device assert and kills the CUDA context): cast to bfloat16, '
                'or use backend "nccl" or "nvshmem" for other dtypes'
            )

    def dispatch(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_w_TK: torch.Tensor
    ) -> DispatchResult:
        x_TD = rows_in_compute_dtype(x_TD)
        self.check_rows(x_TD, "dispatch")
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
        self.check_rows(y_RD, "combine")
        state, out_dtype = handle
        out_TD = self._deepep.combine_tokens(y_RD, state)
        self._deepep.sync_combine()
        return out_TD.to(out_dtype)
