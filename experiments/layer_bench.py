"""One DeepSeek-V3-671B decoder layer as one rank of the flagship runs it, timed part by part on
one GPU: forward, backward, and backward under full activation checkpointing (which re-runs the
forward), each part as time and as efficiency against the GPU's peaks, datasheet and measured.

    python experiments/layer_bench.py run       # one H200, < 4 min: the model's input, results/model_inputs/
                                                # layer_bench_h200x1.json (then update its MANIFEST.json entry)
    python experiments/layer_bench.py report results/model_inputs/layer_bench_h200x1.json   # the markdown table
    python experiments/layer_bench.py run --device cpu --tiny --out /tmp/lb.json  # CPU smoke (tests/)

What one rank runs, per microbatch and layer (the shapes come from the recipe and the anchor, not
from constants here; see `cases`):
  * "flagship": recipes/deepseek_v3_671b_b200.toml - one microbatch of its sequence length, TP 1,
    EP 32 (8 of 256 experts per rank), TorchTitan's node-limited router;
  * "nebius": the Nebius anchors' layout (results/model_inputs/scale_model_validation.json: TP 2, seq 8192,
    EP 32, forced balanced routing) - under TP 2 a rank runs the attention projections and
    kernel for half the heads over the whole sequence (wq_a / wkv_a and the q/kv norms are
    replicated, TorchTitan's TP plan), the norms, residuals and the reorderer/dispatch on half
    the tokens (sequence parallel), the router and the shared expert (half its width) on the
    whole sequence.
Every part is TorchTitan's own module or function at the 671B flavor's shape, in bf16 (FSDP's
param dtype), with weights from the modules' own init_weights: MLA (`Attention`) with the
attention kernel the flavor names (FlexAttention through TorchTitan's compiled
`FlexAttentionWrapper`, block-causal mask), variable-length attention (moe_comm.titan.attention:
TorchTitan's `VarlenAttentionWrapper` with v padded to q's head dim) and SDPA beside it; the two
block-causal kernels alone at one document, at 512-token documents and at the document lengths of
the recipes' data (DOC_DISTRIBUTIONS: c4 stated, the staged real text measured; sequences packed
as TorchTitan packs them, moe_comm.predict.documents, fixed seed); the router
(`TokenChoiceTopKRouter`); `TokenReorderer`; the shared expert and dense FFN (`FeedForward`);
the routed experts' grouped GEMM (`_run_experts_grouped_mm`, the call ExpertParallel makes) over
the rows one rank receives at EP 32, drawn by moe_comm.predict.routing_plan (balanced, and node-limited:
the slowest rank), in bf16 and in float8 rowwise through TorchTitan's
`quantize.grouped_mm.float8` converter (torchao), eager and compiled as TorchTitan's
apply_compile compiles it, and through this project's FP8 experts (`[moe_comm] expert_dtype =
"fp8"`, moe_comm.fp8_experts: rows already in e4m3 as dispatch hands them, FP8 wgrad, and apart
with bf16 wgrad; each step of their forward and backward timed too, in "breakdown"; on CPU the
GEMMs are emulated, so only the wiring is exercised there); ExpertParallel's receive-side `_permute` / `_unpermute`; RMSNorm,
rope, SiLU-mul, residual adds; the embedding and the output projection + loss (first and last
pipeline stage; the loss eager and as TorchTitan compiles it with [compile] components "loss").
Two composites at TP 1: TorchTitan's `MoE` forward and the whole MoE
`TransformerBlock`, each with the all-to-all replaced by an identity (the rank's own T x K
routed rows stand in for the rows it receives; their counts are read in ExpertParallel's
[source rank, local expert] layout), so their time is the layer's local work of TorchTitan's
standard path without communication. Full AC wraps the callable in torch.utils.checkpoint
(non-reentrant, no RNG state: what TorchTitan's full AC does per block).

Timing: CUDA events around each forward and backward after warm-up, median of --iters; the
first call's wall time is reported apart (for compiled parts it is the compile). A torch.profiler
pass of the composite block sums its kernel time, so the launch gaps of eager mode show as
wall - kernel. FLOPs are counted in closed form (matmuls and attention; a backward counts 2 x
its forward; causal attention counts the half it executes, documents the blocks inside them);
bytes are the part's inputs, outputs and parameters once each (the floor a fused kernel moves).
Ceilings measured in the same run: a large bf16 GEMM, a float8 rowwise GEMM (torch._scaled_mm,
rowwise scales, as torchao's rowwise recipe calls it) and a device copy. The run rewrites its
JSON after every part and stops starting compile-bearing parts past --budget-s.
"""

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

START = time.monotonic()
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from moe_comm.predict import documents  # noqa: E402
from moe_comm.predict.layer_compute import LOSS_COMPILED, part_ms  # noqa: E402

SCHEMA = "layer_bench/1"
FLAGSHIP_RECIPE = "recipes/deepseek_v3_671b_b200.toml"
ANCHOR_ID = "anchor/nebius_671b_256xb200/standard"
VALIDATION = "results/model_inputs/scale_model_validation.json"
# Priorities: eager parts first, then what needs a compile, the least needed last; the budget
# stops only compile-bearing parts (priority >= COMPILE_PRIORITY).
P_CEILING, P_EAGER, P_FLEX_FLAGSHIP, P_COMPOSITE, P_FLEX_OTHER, P_COMPILED = range(6)
COMPILE_PRIORITY = P_FLEX_FLAGSHIP
DOC_TOKENS = 512  # the block-causal sensitivity point: documents of this many tokens (an assumption)
# Document-length distributions the block-causal kernels are measured at (moe_comm.predict.documents):
# c4 "en", what the flagship and the Nebius anchors train on (stated), and the staged real text the
# one-GPU runs train on (measured); sequences packed as TorchTitan packs them, with this seed.
DOC_DISTRIBUTIONS = ("c4_en", "nltk_en")
DOC_SEED = 0
BLOCK_CAUSAL = ("flex", "varlen")  # the kernels that run block-causal masks


def log(msg: str) -> None:
    print(f"[layer_bench {time.monotonic() - START:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------ shapes


@dataclass(frozen=True)
class Case:
    """One rank's per-microbatch shape of a layout."""

    name: str
    source: str
    flavor: str
    seq_len: int
    sequences: int  # sequences per microbatch (per MoE call)
    tp: int
    ep: int
    routing: str  # the routing statistic this layout's run sees

    @property
    def tokens(self) -> int:
        """Tokens the attention module, the router and the shared expert see (replicated under TP)."""
        return self.sequences * self.seq_len

    @property
    def tokens_sp(self) -> int:
        """Tokens of the sequence-parallel parts: norms, residuals, reorderer, dispatch."""
        return self.tokens // self.tp


def _toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(path.read_text())


def cases(tiny: bool) -> list[Case]:
    """The flagship recipe's microbatch and the Nebius anchors' layout; --tiny shrinks both."""
    r = _toml(REPO / FLAGSHIP_RECIPE)
    t, p = r["training"], r["parallelism"]
    pp = p.get("pipeline_parallel_degree", 1)
    sequences = p.get("pipeline_parallel_microbatch_size", 1) if pp > 1 else t["local_batch_size"]
    routing = "balanced" if r.get("debug", {}).get("moe_force_load_balance") else "node_limited"
    flagship = Case("flagship", f"{FLAGSHIP_RECIPE}: [training] seq_len, [parallelism] microbatch size (PP {pp}), "
                    "tensor/expert parallel degrees", r["model"]["flavor"], t["seq_len"], sequences,
                    p.get("tensor_parallel_degree", 1), p["expert_parallel_degree"], routing)
    fig = next(f for f in json.loads((REPO / VALIDATION).read_text())["figures"] if f["id"] == ANCHOR_ID)
    wl = fig["predict"]["workload"]  # the published layout only; the anchor's figure is not read
    nebius = Case("nebius", f"{VALIDATION} {ANCHOR_ID} workload ({fig['predict']['workload_source']})",
                  wl["flavor"], wl["seq_len"], wl.get("microbatch", 1), wl.get("tp", 1), wl["ep"], wl["routing"])
    if tiny:
        return [replace(c, flavor="tiny", seq_len=c.seq_len // 64, ep=4, source="--tiny: " + c.source)
                for c in (flagship, nebius)]
    return [flagship, nebius]


def flavor_args(case: Case):
    """The flavor's DeepSeekV3ModelArgs at the case's sequence length (TorchTitan sets
    max_seq_len = seq_len from the config, which picks rope's YaRN branch and the softmax scale)."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs, deepseekv3_args
    from torchtitan.models.moe import MoEArgs

    from moe_comm.layout import flavors

    flavors.register()
    if case.flavor == "tiny":
        a = DeepSeekV3ModelArgs(
            vocab_size=512, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=2, n_dense_layers=1, n_heads=4,
            moe_args=MoEArgs(num_experts=16, num_shared_experts=1, top_k=4, num_expert_groups=4,
                             num_limited_groups=2, score_func="sigmoid", route_norm=True, route_scale=2.5,
                             score_before_experts=False),
            q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            attn_type="flex", attn_mask_type="block_causal")  # as the 671B flavor
    else:
        a = deepseekv3_args[case.flavor]
    return with_changes(a, max_seq_len=case.seq_len)


def with_changes(a, **changes):
    """A copy of model args with fields changed, and the field TorchTitan's update_from_config
    adds from [parallelism] expert_parallel_comm_backend ("standard": the all-to-all MoE)."""
    a = replace(a, **changes)
    a.moe_impl = "standard"
    return a


def received_rows(case: Case, a, routing: str) -> dict:
    """Rows the slowest rank receives at the case's EP under a routing statistic, per local
    expert and per (source rank, local expert), from moe_comm.predict.routing_plan's drawn routing."""
    from moe_comm.predict.routing_plan import draw_topk, plan

    m = a.moe_args
    L = m.num_experts // case.ep
    idx_WTK = draw_topk(routing, case.ep, case.tokens_sp, m.num_experts, m.top_k,
                        num_groups=m.num_expert_groups or 8, limited_groups=m.num_limited_groups or 4)
    p = plan(idx_WTK, m.num_experts, min(8, case.ep))
    rank = int(p.expert_rows_WL.sum(1).argmax())
    src_WTK = torch.arange(case.ep).view(-1, 1, 1).expand_as(idx_WTK)
    mine = (idx_WTK // L) == rank
    from_SL = torch.bincount((src_WTK[mine] * L + idx_WTK[mine] % L), minlength=case.ep * L).view(case.ep, L)
    return {"routing": routing, "rank": rank, "rows": int(p.expert_rows_WL[rank].sum()),
            "mean_rows": float(p.expert_rows_WL.sum(1).double().mean()),
            "rows_L": p.expert_rows_WL[rank].tolist(), "rows_from_SL": from_SL.tolist()}


# ------------------------------------------------------------------------------ timing


class Clock:
    """CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in (x if isinstance(x, (tuple, list)) else (x,)) if isinstance(t, torch.Tensor)]


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _stats(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "mean": statistics.fmean(samples), "min": min(samples),
            "max": max(samples), "samples": [round(s, 4) for s in samples]}


@dataclass
class Built:
    """What a part's builder returns: the callable, its inputs and the parameters it trains."""

    fn: Callable
    args: tuple
    params: list = field(default_factory=list)
    flops_fwd: float = 0.0
    shape: dict = field(default_factory=dict)
    note: str = ""
    bytes: dict | None = None  # instead of inputs + outputs + parameters once each, where that misleads
    breakdown: Callable[[], dict] | None = None  # ms per step of the part's forward and backward
    # > 1: each call is one of `microbatches` microbatches of an optimizer step, and `new_step`
    # starts the next step (its weights change); the part's time is the mean over whole steps
    microbatches: int = 1
    new_step: Callable[[], None] | None = None


def measure(built: Built, clock: Clock, warmup: int, iters: int, ac: bool) -> dict:
    """Median forward and backward ms (after `warmup` calls), and the first call's wall seconds.
    A part of several microbatches per step runs whole steps (warm-up and timed calls rounded up
    to them), so its mean is the time per microbatch with the step's one-off work shared out."""
    fn, args = built.fn, built.args
    m = built.microbatches
    warmup, iters = -(-warmup // m) * m, -(-iters // m) * m
    grads: list | None = None
    leaves = [t for t in (*args, *built.params) if isinstance(t, torch.Tensor) and t.requires_grad]
    marks, first = [], {}
    for i in range(warmup + iters):
        if m > 1 and i % m == 0:
            built.new_step()
        for t in leaves:
            t.grad = None
        if i == 0:
            clock.sync()
            t0 = time.perf_counter()
        a = clock.mark()
        out = checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False) if ac else fn(*args)
        b = clock.mark()
        outs = [o for o in _tensors(out) if o.requires_grad]
        if grads is None:
            grads = [torch.randn_like(o) for o in outs]
            shapes = {"out_bytes": _nbytes(outs)}
        if i == 0:
            clock.sync()
            first["fwd_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
        c = clock.mark()
        torch.autograd.backward(outs, grads)
        d = clock.mark()
        if i == 0:
            clock.sync()
            first["bwd_s"] = time.perf_counter() - t0
        if i >= warmup:
            marks.append((a, b, c, d))
        del out, outs
    clock.sync()
    fwd = [clock.ms(a, b) for a, b, _, _ in marks]
    bwd = [clock.ms(c, d) for _, _, c, d in marks]
    return {"fwd": _stats(fwd), "bwd": _stats(bwd), "first_call_s": first, **shapes}


def kernel_ms(built: Built, device: torch.device, iters: int = 3) -> dict | None:
    """Kernel time per forward + backward (torch.profiler), against the same span's wall time:
    the difference is time the GPU waited for the host (eager launch gaps)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    leaves = [t for t in (*built.args, *built.params) if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            for t in leaves:
                t.grad = None
            out = built.fn(*built.args)
            outs = [o for o in _tensors(out) if o.requires_grad]
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        end.record()
        torch.cuda.synchronize()
    busy_us = sum(e.self_device_time_total for e in prof.key_averages())
    return {"kernel_ms": busy_us / 1e3 / iters, "wall_ms": start.elapsed_time(end) / iters,
            "note": "fwd + bwd per iteration, no AC; ones as upstream gradient"}


# ------------------------------------------------------------------------------ parts


@dataclass
class Part:
    case: str
    name: str
    bound: str  # "compute" (efficiency against TFLOPS) or "memory" (against HBM bandwidth); "mixed"
    dtype: str  # which dense peak a compute part is held against
    build: Callable[[], Built]
    priority: int = P_EAGER
    requires: tuple = ()  # "cuda", "fp8", "flex": why a part may not run here
    profile: bool = False
    count_per_layer: int = 1  # how many times one MoE layer runs it (norms, residuals: 2)


def _randn(shape, device, dtype=torch.bfloat16, grad=True, scale=1.0):
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_(grad)


def _bf16_params(module: nn.Module) -> nn.Module:
    """Parameters in bf16 (FSDP's param dtype), buffers (router bias, counts) left in fp32."""
    for p in module.parameters():
        p.data = p.data.to(torch.bfloat16)
    return module


def _init(factory: Callable[[], nn.Module], device, *init_args) -> nn.Module:
    """A TorchTitan module built on the device and initialised by its own init_weights."""
    with torch.device(device):
        module = factory()
    with torch.no_grad():  # as TorchTitan's trainer calls it
        module.init_weights(*init_args)
    return _bf16_params(module)


def _attention_args(a, case: Case, impl: str):
    return with_changes(a, n_heads=a.n_heads // case.tp, attn_type=impl,
                        attn_mask_type="block_causal" if impl in BLOCK_CAUSAL else "causal")


def document_distribution(name: str):
    """A distribution of moe_comm.predict.documents by name: c4_en (stated) or a measured one."""
    return documents.C4_EN if name == documents.C4_EN.name else documents.load_measured()[name]


def pieces_for(case: Case, docs) -> list[list[tuple[int, bool]]]:
    """Per sequence of the case's microbatch, its document pieces as (tokens, ends with EOS):
    one document (None), documents of `docs` tokens (int), or TorchTitan's packing of a named
    distribution (str, moe_comm.predict.documents, seed DOC_SEED)."""
    S, B = case.seq_len, case.sequences
    if docs is None:
        return [[(S, False)]] * B
    if isinstance(docs, int):
        full, rest = divmod(S, docs)
        return [[(docs, True)] * full + ([(rest, False)] if rest else [])] * B
    return documents.packed(document_distribution(docs), B, S, seed=DOC_SEED)


def _docs_label(docs) -> str:
    return "" if docs is None else (f".docs{docs}" if isinstance(docs, int) else f".{docs}")


class DocumentMask:
    """The flavor's block-causal mask (causal within each document) for FlexAttention, built with
    TorchTitan's compiled create_block_mask from the same rule as its document mask (document ids
    that change after each EOS). The ids live in one buffer refilled in place, so every variant is
    the same mask function and the compiled kernel is reused."""

    def __init__(self, sequences: int, seq_len: int, device):
        self.doc_ids_BS = torch.zeros(sequences, seq_len, dtype=torch.int32, device=device)
        self.sequences, self.seq_len = sequences, seq_len
        ids = self.doc_ids_BS

        def block_causal(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (ids[b, q_idx] == ids[b, kv_idx])

        self.mask_mod = block_causal

    def block_mask(self, pieces: list[list[tuple[int, bool]]]):
        from torchtitan.models.attention import create_attention_mask

        ids = [[i for i, (d, _) in enumerate(p) for _ in range(d)] for p in pieces]
        self.doc_ids_BS.copy_(torch.tensor(ids, dtype=torch.int32))
        return create_attention_mask(self.mask_mod, self.sequences, None, self.seq_len, self.seq_len)


def varlen_documents(pieces: list[list[tuple[int, bool]]], device):
    """The same documents for the variable-length kernel, cut by TorchTitan's
    create_varlen_metadata_for_document from a token batch with EOS where each document ends."""
    from torchtitan.models.attention import create_varlen_metadata_for_document

    eos = 1
    return create_varlen_metadata_for_document(documents.token_batch(pieces, eos, 0).to(device), eos)


def causal_pairs(seq_len: int, doc_tokens: int | None) -> float:
    """(query, key) pairs a causal mask keeps per sequence, documents of doc_tokens each."""
    d = doc_tokens or seq_len
    full, rest = divmod(seq_len, d)
    return full * d * (d + 1) / 2 + rest * (rest + 1) / 2


def attention_core_flops(a, case: Case, doc_tokens: int | None = None, pieces=None) -> float:
    """2 x heads x kept (query, key) pairs x (qk + v head dims): documents of doc_tokens each, or
    the pieces given (moe_comm.predict.documents.kept_pairs)."""
    heads = a.n_heads // case.tp
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    pairs = (sum(documents.kept_pairs(p) for p in pieces) if pieces is not None
             else case.sequences * causal_pairs(case.seq_len, doc_tokens))
    return 2 * heads * pairs * (qk + a.v_head_dim)


def attention_projection_flops(a, case: Case) -> float:
    h = a.n_heads // case.tp
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    per_token = (a.dim * a.q_lora_rank + a.q_lora_rank * h * qk + a.dim * (a.kv_lora_rank + a.qk_rope_head_dim)
                 + a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim) + h * a.v_head_dim * a.dim)
    return 2 * case.tokens * per_token


def _padded(rows_L: list[int], align: int) -> list[int]:
    return [(r + align - 1) // align * align for r in rows_L]


class ExpertParallelStandIn(nn.Module):
    """TorchTitan's ExpertParallel around the rank's GroupedExperts with the all-to-all an
    identity: the rank's own T x K routed rows (sorted by global expert) stand in for the rows it
    receives, their [E] counts read as the [EP source, local expert] counts ExpertParallel gets
    back from its counts exchange; then its `_permute`, the grouped GEMM and `_unpermute`, as in
    `_token_dispatch` / `_token_combine`. Exact under balanced routing (every source sends each
    local expert T x K / E rows); no host sync (the real hook's .tolist() of split sizes is
    communication, priced by the comm model)."""

    def __init__(self, dim: int, hidden: int, num_experts: int, ep: int):
        super().__init__()
        from torchtitan.models.moe.moe import GroupedExperts

        self.num_experts = num_experts  # MoE sizes its buffers by it
        self.ep = ep
        self.local = GroupedExperts(dim, hidden, num_experts // ep, use_grouped_mm=True)

    def forward(self, routed_input: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        from torchtitan.models.moe import utils as moe_utils
        from torchtitan.models.moe.moe import _run_experts_grouped_mm

        input_shape, x, permuted, counts_L = moe_utils._permute(
            routed_input, num_tokens_per_expert, self.ep, self.local.num_experts)
        y = _run_experts_grouped_mm(self.local.w1, self.local.w2, self.local.w3, x, counts_L)
        return moe_utils._unpermute(y, input_shape, permuted)

    def init_weights(self, init_std: float) -> None:
        self.local.init_weights(init_std)


def build_parts(case: Case, device: torch.device, state: dict) -> list[Part]:
    """Every part of one rank's layer for a case; builders allocate only when run."""
    from torchtitan.models.deepseek_v3.model.model import Attention, apply_rotary_emb, precompute_freqs_cis
    from torchtitan.models.moe.moe import FeedForward, TokenChoiceTopKRouter, TokenReorderer

    a = flavor_args(case)
    m = a.moe_args
    D, T, Tsp, S, B = a.dim, case.tokens, case.tokens_sp, case.seq_len, case.sequences
    heads = a.n_heads // case.tp
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    L = m.num_experts // case.ep
    drawn = state.setdefault("drawn", {})  # cases of the same tokens and EP share a draw
    rows = {}
    for routing in ("balanced", "node_limited"):
        key = (routing, case.ep, case.tokens_sp, case.flavor)
        if key not in drawn:
            drawn[key] = received_rows(case, a, routing)
        rows[routing] = drawn[key]
    state.setdefault("rows", {})[case.name] = rows
    freqs = lambda: precompute_freqs_cis(a).to(device)  # noqa: E731
    parts: list[Part] = []

    def add(name, bound, build, dtype="bf16", **kw):
        parts.append(Part(case.name, name, bound, dtype, build, **kw))

    # -- norms, residuals, rope, SiLU-mul: memory-bound
    def rmsnorm():
        with torch.device(device):
            norm = _bf16_params(nn.RMSNorm(D, eps=a.norm_eps))
        return Built(norm, (_randn((Tsp, D), device),), list(norm.parameters()), shape={"tokens": Tsp, "dim": D})

    add("rmsnorm", "memory", rmsnorm, count_per_layer=2)

    def residual():
        return Built(torch.add, (_randn((Tsp, D), device), _randn((Tsp, D), device)), shape={"tokens": Tsp, "dim": D})

    add("residual_add", "memory", residual, count_per_layer=2)

    def rope():
        f = freqs()
        q_pe = _randn((B, S, heads, a.qk_rope_head_dim), device)
        k_pe = _randn((B, S, 1, a.qk_rope_head_dim), device)
        return Built(lambda q, k: (apply_rotary_emb(q, f), apply_rotary_emb(k, f)), (q_pe, k_pe),
                     shape={"q_pe": list(q_pe.shape), "k_pe": list(k_pe.shape)})

    add("rope", "memory", rope, count_per_layer=0)  # inside attention.module

    def silu_mul():
        R = sum(_padded(rows["balanced"]["rows_L"], 8))
        return Built(lambda g, u: F.silu(g) * u, (_randn((R, a.moe_inter_dim), device), _randn((R, a.moe_inter_dim), device)),
                     shape={"rows": R, "hidden": a.moe_inter_dim}, note="inside the experts' grouped GEMM part")

    add("silu_mul.experts", "memory", silu_mul, count_per_layer=0)

    # -- attention: SDPA causal over one document; FlexAttention and variable-length attention
    # block-causal over one document, fixed 512-token documents and the DOC_DISTRIBUTIONS
    doc_variants = (None, DOC_TOKENS, *DOC_DISTRIBUTIONS)
    documents_seen = state.setdefault("documents", {}).setdefault(case.name, {})
    for docs in doc_variants:
        pcs = pieces_for(case, docs)
        documents_seen[_docs_label(docs).lstrip(".") or "one"] = {
            "pieces": sum(len(x) for x in pcs), "kept_pairs": sum(documents.kept_pairs(x) for x in pcs),
            "longest": max(d for x in pcs for d, _ in x), "seed": DOC_SEED if isinstance(docs, str) else None}
    for impl in ("sdpa", *BLOCK_CAUSAL):
        req = () if impl == "sdpa" else ("cuda", impl)
        prio = P_EAGER if impl == "sdpa" else (P_FLEX_FLAGSHIP if case.name == "flagship" else P_FLEX_OTHER)

        def module(impl=impl):
            from moe_comm.titan.attention import VarlenMLA

            aa = _attention_args(a, case, impl)
            attn = _init(lambda: VarlenMLA(aa) if impl == "varlen" else Attention(aa), device, 0.02)
            f = freqs()
            one = pieces_for(case, None)
            mask = {"flex": lambda: _document_mask(state, B, S, device).block_mask(one),
                    "varlen": lambda: varlen_documents(one, device)}.get(impl, lambda: None)()
            x = _randn((B, S, D), device)
            return Built(lambda x: attn(x, f, mask), (x,), list(attn.parameters()),
                         attention_projection_flops(a, case) + attention_core_flops(a, case),
                         {"sequences": B, "seq": S, "heads": heads, "dim": D},
                         "MLA: projections, q/kv norms, rope, the attention kernel (one document)")

        add(f"attention.module.{impl}", "compute", module, priority=prio, requires=req,
            count_per_layer=1 if impl == (a.attn_type if a.attn_type in BLOCK_CAUSAL else "sdpa") else 0)

        for docs in (doc_variants if impl in BLOCK_CAUSAL else (None,)):
            def core(impl=impl, docs=docs):
                from torchtitan.models.attention import FlexAttentionWrapper, ScaledDotProductAttentionWrapper

                from moe_comm.titan.attention import DocumentVarlenAttention

                with torch.device("meta"):  # TorchTitan's softmax scale (YaRN mscale past 4096)
                    scale = Attention(_attention_args(a, case, "sdpa")).softmax_scale
                # leaves laid out as the module lays out q, k and v (same strides: one compile)
                q = _randn((B, S, heads, qk), device)
                k = _randn((B, S, heads, qk), device)
                kv = _randn((B, S, heads, a.qk_nope_head_dim + a.v_head_dim), device)
                pieces = pieces_for(case, docs)
                if impl == "flex":
                    kernel, mask = FlexAttentionWrapper(), _document_mask(state, B, S, device).block_mask(pieces)
                    call = lambda q, k, v: kernel(q, k, v, block_mask=mask, scale=scale)  # noqa: E731
                elif impl == "varlen":  # v padded to q's head dim inside, as VarlenMLA runs it
                    kernel = DocumentVarlenAttention()
                    kernel.documents = varlen_documents(pieces, device)
                    call = lambda q, k, v: kernel(q, k, v, scale=scale)  # noqa: E731
                else:
                    kernel = ScaledDotProductAttentionWrapper()
                    call = lambda q, k, v: kernel(q, k, v, scale=scale)  # noqa: E731

                def fn(q, k, kv):
                    v = kv[..., a.qk_nope_head_dim:]
                    return call(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))

                lengths = [d for x in pieces for d, _ in x]
                what = {None: "one document per sequence", DOC_TOKENS: f"documents of {DOC_TOKENS} tokens (a "
                        "sensitivity point, not a measured length)"}.get(
                    docs, f"documents drawn from {docs} (moe_comm.predict.documents, seed {DOC_SEED}), packed as "
                    "TorchTitan packs them")
                return Built(fn, (q, k, kv), flops_fwd=attention_core_flops(a, case, pieces=pieces),
                             shape={"sequences": B, "seq": S, "heads": heads, "qk_dim": qk, "v_dim": a.v_head_dim,
                                    "documents": docs or ("one" if docs is None else docs),
                                    "pieces": len(lengths), "longest_piece": max(lengths),
                                    "kept_pairs": sum(documents.kept_pairs(x) for x in pieces)},
                             note=f"the attention kernel alone; {what}")

            add(f"attention.core.{impl}{_docs_label(docs)}", "compute", core, priority=prio, requires=req,
                count_per_layer=0)

    # -- MoE
    def router():
        r = _init(lambda: TokenChoiceTopKRouter(D, m.num_experts, m.num_expert_groups, m.num_limited_groups,
                                                m.top_k, m.score_func, m.route_norm, m.route_scale, m.gate_bias),
                  device, 0.02)
        bias = torch.zeros(m.num_experts, device=device)
        return Built(lambda x: r(x, bias)[0], (_randn((T, D), device),), list(r.parameters()),
                     2 * T * D * m.num_experts, {"tokens": T, "experts": m.num_experts, "top_k": m.top_k},
                     "gate GEMM, sigmoid, node-limited group top-k, top-k, gather, normalise, histc")

    add("router", "memory", router)

    def reorderer():
        re = TokenReorderer(m.num_experts, m.top_k)
        scores = _randn((Tsp, m.top_k), device, torch.float32)
        idx = torch.randint(0, m.num_experts, (Tsp, m.top_k), device=device)
        return Built(lambda s: re(s, idx)[0], (scores,), shape={"tokens": Tsp, "top_k": m.top_k},
                     note="histc, argsort, score gather (the standard path's sort by expert)")

    add("reorderer", "memory", reorderer, count_per_layer=0)  # the standard path's own

    def shared():
        ff = _init(lambda: FeedForward(D, a.moe_inter_dim * m.num_shared_experts // case.tp), device, 0.02)
        return Built(ff, (_randn((T, D), device),), list(ff.parameters()),
                     2 * T * 3 * D * a.moe_inter_dim * m.num_shared_experts // case.tp,
                     {"tokens": T, "hidden": a.moe_inter_dim * m.num_shared_experts // case.tp})

    add("shared_expert", "compute", shared)

    def dense():
        ff = _init(lambda: FeedForward(D, a.inter_dim // case.tp), device, 0.02)
        return Built(ff, (_randn((T, D), device),), list(ff.parameters()), 2 * T * 3 * D * a.inter_dim // case.tp,
                     {"tokens": T, "hidden": a.inter_dim // case.tp}, "the dense layers' FFN (not in a MoE layer)")

    add("dense_ffn", "compute", dense, count_per_layer=0)

    def recv_permute():
        from torchtitan.models.moe import utils as moe_utils

        rr = rows["balanced"]
        counts = torch.tensor(rr["rows_from_SL"], device=device, dtype=torch.int64).flatten()
        x = _randn((rr["rows"], D), device)

        def fn(x):
            shape, xp, perm, _ = moe_utils._permute(x, counts, case.ep, L)
            return moe_utils._unpermute(xp * 1, shape, perm)  # *1: the experts' output stands in

        return Built(fn, (x,), shape={"rows": rr["rows"], "ep": case.ep, "local_experts": L},
                     note="ExpertParallel's _permute (generate_permute_indices + gather) and _unpermute (scatter)")

    add("recv_permute", "memory", recv_permute, count_per_layer=0)  # the standard path's own

    for dtype in ("bf16", "fp8"):
        for compiled in (False, True):
            if dtype == "bf16" and compiled:
                continue
            for routing in ("balanced", "node_limited"):
                def experts(dtype=dtype, compiled=compiled, routing=routing):
                    return _experts(a, case, rows[routing], dtype, compiled, device)

                add(f"experts.{dtype}{'.compiled' if compiled else ''}.{routing}", "compute", experts, dtype=dtype,
                    priority=P_COMPILED if compiled else P_EAGER,
                    requires=("cuda", "fp8") if dtype == "fp8" else (),
                    count_per_layer=1 if (dtype, compiled, routing) == ("bf16", False, case.routing) else 0)

    for wgrad in ("fp8", "bf16"):
        for routing in ("balanced", "node_limited"):
            def ours(wgrad=wgrad, routing=routing):
                return _moe_comm_fp8_experts(a, case, rows[routing], device, wgrad == "fp8", Clock(device))

            add(f"experts.{FP8_OURS}{'' if wgrad == 'fp8' else '_bf16_wgrad'}.{routing}", "compute", ours,
                dtype="fp8", requires=("cuda", "hopper") if device.type == "cuda" else (), count_per_layer=0)
    for routing in ("balanced", "node_limited"):
        def cached(routing=routing):
            return _moe_comm_fp8_experts(a, case, rows[routing], device, True, Clock(device),
                                         microbatches=2 if case.flavor == "tiny" else FP8_CACHED_MICROBATCHES)

        add(f"experts.{FP8_OURS}_cached.{routing}", "compute", cached, dtype="fp8",
            requires=("cuda", "hopper") if device.type == "cuda" else (), count_per_layer=0)

    # -- composites (TP 1 only: under TP a rank splits tokens between sequence-parallel and
    # replicated parts, which one module on one GPU cannot reproduce; the sum of parts stands in)
    if case.tp == 1:
        def moe_local():
            moe = _moe_standin(a, case, device)
            return Built(moe, (_randn((B, S, D), device),), list(moe.parameters()),
                         2 * T * D * m.num_experts + 2 * T * m.top_k * 3 * D * a.moe_inter_dim
                         + 2 * T * 3 * D * a.moe_inter_dim * m.num_shared_experts,
                         {"tokens": T, "local_experts": L}, "TorchTitan's MoE.forward, all-to-all as identity")

        add("moe.standard_local", "mixed", moe_local, priority=P_COMPOSITE, count_per_layer=0, profile=True)

        def block():
            from torchtitan.models.deepseek_v3.model.model import TransformerBlock

            impl = "flex" if state.get("flex_ok") and a.attn_type == "flex" else "sdpa"
            aa = _attention_args(a, case, impl)
            with torch.device("meta"):
                blk = TransformerBlock(a.n_dense_layers, aa)
                blk.moe.experts = ExpertParallelStandIn(D, a.moe_inter_dim, m.num_experts, case.ep)
            blk.to_empty(device=device)
            with torch.no_grad():
                blk.init_weights(buffer_device=device)
            _bf16_params(blk)
            f = freqs()
            mask = _document_mask(state, B, S, device).block_mask(pieces_for(case, None)) if impl == "flex" else None
            flops = (attention_projection_flops(a, case) + attention_core_flops(a, case) + 2 * T * D * m.num_experts
                     + 2 * T * m.top_k * 3 * D * a.moe_inter_dim + 2 * T * 3 * D * a.moe_inter_dim * m.num_shared_experts)
            return Built(lambda x: blk(x, f, mask), (_randn((B, S, D), device),), list(blk.parameters()), flops,
                         {"sequences": B, "seq": S, "attention": impl, "local_experts": L},
                         f"TorchTitan's MoE TransformerBlock, attention {impl}, all-to-all as identity")

        add("layer.moe_block", "mixed", block, priority=P_COMPOSITE, count_per_layer=0, profile=True)

    # -- first and last stage
    def embedding():
        with torch.device(device):
            emb = _bf16_params(nn.Embedding(a.vocab_size // case.tp, D))
        tokens = torch.randint(0, a.vocab_size // case.tp, (B, S), device=device)
        out_bytes = T * D * 2
        return Built(lambda: emb(tokens), (), list(emb.parameters()),
                     shape={"tokens": T, "vocab_per_rank": a.vocab_size // case.tp},
                     note="first stage only (TP: the rank's vocabulary shard for every token, then a "
                          "reduce-scatter); bytes: rows read + written forward, the dense table gradient backward",
                     bytes={"fwd": 2 * out_bytes + tokens.numel() * 8,
                            "bwd": out_bytes + tokens.numel() * 8 + a.vocab_size // case.tp * D * 2})

    add("embedding", "memory", embedding, count_per_layer=0)

    def output_loss(loss_compiled: bool = False):
        from torchtitan.components.loss import build_cross_entropy_loss
        from torchtitan.config import JobConfig

        jc = JobConfig()  # the loss as the trainer builds it: eager, or [compile] components "loss"
        jc.compile.enable, jc.compile.components = loss_compiled, ["loss"]
        loss_fn = build_cross_entropy_loss(jc)
        with torch.device(device):
            norm = _bf16_params(nn.RMSNorm(D))
            out = nn.Linear(D, a.vocab_size // case.tp, bias=False)
        with torch.no_grad():
            nn.init.trunc_normal_(out.weight, std=D**-0.5)
        _bf16_params(out)
        labels = torch.randint(0, a.vocab_size // case.tp, (B, S), device=device)
        what = "compiled by torch.compile ([compile] components \"loss\")" if loss_compiled else "eager"
        return Built(lambda h: loss_fn(out(norm(h)), labels), (_randn((B, S, D), device),),
                     [*norm.parameters(), *out.parameters()], 2 * T * D * a.vocab_size // case.tp,
                     {"tokens": T, "vocab_per_rank": a.vocab_size // case.tp},
                     f"last stage only: final norm, output projection, fp32 cross-entropy (TorchTitan's loss, {what})")

    add("output_loss", "compute", output_loss, count_per_layer=0)
    # the same with TorchTitan's compiled loss: inductor fuses the fp32 upcast of the logits, the
    # log-softmax and their backward (eager: 4 + 4 bytes a logit written forward, more backward)
    add(LOSS_COMPILED, "compute", lambda: output_loss(loss_compiled=True),
        priority=P_COMPILED, count_per_layer=0)
    return parts


def _document_mask(state: dict, sequences: int, seq_len: int, device) -> DocumentMask:
    masks = state.setdefault("masks", {})
    if (sequences, seq_len) not in masks:
        masks[(sequences, seq_len)] = DocumentMask(sequences, seq_len, device)
    return masks[(sequences, seq_len)]


def _experts(a, case: Case, rows: dict, dtype: str, compiled: bool, device) -> Built:
    """The rank's local experts' grouped GEMM over the rows it receives, each expert's segment
    padded to the grouped GEMM's alignment, as ExpertParallel hands them over."""
    from torchtitan.components.quantization import FP8_GROUP_ALIGNMENT_SIZE
    from torchtitan.models.moe import moe as moe_module
    from torchtitan.models.moe.moe import GroupedExperts

    m = a.moe_args
    L = m.num_experts // case.ep
    holder = nn.Module()
    holder.experts = _init(lambda: GroupedExperts(a.dim, a.moe_inter_dim, L, use_grouped_mm=True), device, 0.02)
    align = 8
    if dtype == "fp8":
        _convert_float8_grouped_mm(holder)
        align = FP8_GROUP_ALIGNMENT_SIZE
    padded = _padded(rows["rows_L"], align)
    x = torch.zeros(sum(padded), a.dim, device=device, dtype=torch.bfloat16)
    start = 0
    for r, p in zip(rows["rows_L"], padded):  # real rows, then the segment's zero padding
        x[start:start + r] = torch.randn(r, a.dim, device=device, dtype=torch.bfloat16)
        start += p
    x.requires_grad_(True)
    counts = torch.tensor(padded, device=device, dtype=torch.int32)
    run = moe_module._run_experts_grouped_mm
    if compiled:  # as TorchTitan's apply_compile compiles it under EP: fullgraph, dynamic rows
        torch._dynamo.config.capture_scalar_outputs = True
        compiled_run = torch.compile(moe_module._run_experts_grouped_mm, fullgraph=True)

        def run(w1, w2, w3, x, n):
            torch._dynamo.mark_dynamic(x, 0)
            return compiled_run(w1, w2, w3, x, n)

    e = holder.experts
    return Built(lambda x: run(e.w1, e.w2, e.w3, x, counts), (x,), list(e.parameters()),
                 2 * rows["rows"] * 3 * a.dim * a.moe_inter_dim,
                 {"rows": rows["rows"], "padded_rows": sum(padded), "rows_per_expert": rows["rows_L"],
                  "local_experts": L, "align": align, "routing": rows["routing"], "mean_rows_per_rank": rows["mean_rows"]},
                 f"{rows['routing']} routing at EP {case.ep}, the rank with the most rows (of a drawn routing)")


FP8_OURS = "moe_comm_fp8"  # the part name of this project's FP8 experts
# Microbatches per optimizer step of the "_cached" part, over which moe_comm.fp8_experts'
# WeightCache quantises each MoE layer's weights once: the flagship's count when it was measured
# (recipes/deepseek_v3_671b_b200.toml ran 32 per step through PP 8 until 2026-12-03 and runs 64
# since, where one quantisation serves twice the microbatches).
FP8_CACHED_MICROBATCHES = 32
# Steps of moe_comm.fp8_experts by kind, for the breakdown's totals.
FP8_STEP_KINDS = {"quantise": ("weights", "gate", "quantise_dy", "weights_t_2", "gate_backward", "weights_t_13"),
                  "gemm_fwd": ("gemm_13", "gemm_2"), "gemm_dgrad": ("dgrad_h", "dgrad_x"),
                  "wgrad_operands": ("wgrad_operands",), "gemm_wgrad": ("wgrad_gemm",)}


class _RowsGrad(torch.autograd.Function):
    """Stands in for dispatch_fp8_rows: the zero-stride carrier of the rows' gradient, whose
    backward takes that gradient as dispatch's would (here: drops it) without reducing it."""

    @staticmethod
    def forward(ctx, anchor, rows, dim):
        return anchor.new_zeros(()).expand(rows, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.new_zeros(()), None, None


def _moe_comm_fp8_experts(a, case: Case, rows: dict, device, wgrad_fp8: bool, clock: Clock,
                          microbatches: int = 1) -> Built:
    """This project's FP8 experts over the rows one rank receives, each expert's segment padded
    to their alignment. The rows are already e4m3 with one scale per row, exactly as dispatch hands
    them (quantised by the sender or by the layout kernel, so not timed here). With one microbatch
    the weights are quantised from the bf16 parameters at every call, as a run with one forward per
    step does; with `microbatches` > 1 through a WeightCache, as a run with that many microbatches
    per step does: each step starts with the weights changed in place (as the optimizer changes
    them), so its first microbatch quantises them and the others reuse the copies."""
    from torchtitan.models.moe.moe import GroupedExperts

    from moe_comm import fp8_experts
    from moe_comm.kernels import fp8_reference

    if device.type == "cuda":
        from moe_comm.kernels.runtime import load_library

        load_library()  # csrc/'s kernels (built on first use)
    m = a.moe_args
    L = m.num_experts // case.ep
    e = _init(lambda: GroupedExperts(a.dim, a.moe_inter_dim, L, use_grouped_mm=True), device, 0.02)
    padded = _padded(rows["rows_L"], fp8_experts.ROW_ALIGN)
    x = torch.zeros(sum(padded), a.dim, device=device, dtype=torch.bfloat16)
    start = 0
    for r, p in zip(rows["rows_L"], padded):
        x[start:start + r] = torch.randn(r, a.dim, device=device, dtype=torch.bfloat16)
        start += p
    q, scale = fp8_reference.quantise_rows(x, fp8_reference.MIN_AMAX_ROWS)
    fp8_rows = fp8_experts.Fp8Rows(q, scale)
    counts = torch.tensor(padded, device=device, dtype=torch.int32)
    anchor = torch.zeros((), device=device, dtype=torch.bfloat16, requires_grad=True)
    del x

    cache = fp8_experts.WeightCache() if microbatches > 1 else None

    def run(anchor, marks=None):
        carrier = _RowsGrad.apply(anchor, q.shape[0], q.shape[1])
        # the breakdown (marks) times each step alone: nothing of the backward beside its GEMMs
        return fp8_experts.grouped_experts(e.w1, e.w2, e.w3, carrier, fp8_rows, counts, wgrad_fp8, marks, cache,
                                           beside_gemms=marks is None)

    def new_step():
        for w in (e.w1, e.w2, e.w3):
            torch.autograd.graph.increment_version(w)  # what the optimizer's in-place update does

    def breakdown(iters: int = 5) -> dict:
        """Median ms of each step (moe_comm.fp8_experts marks them), and their kinds' totals."""
        steps: dict[str, list[float]] = {}
        for _ in range(iters + 1):
            marks: list = []
            y = run(anchor, marks)
            y.backward(torch.ones_like(y))
            clock.sync()
            prev = None
            for name, stamp in marks:
                if name != "start" and prev is not None:
                    steps.setdefault(name, []).append(clock.ms(prev, stamp))
                prev = stamp
        step_ms = {k: statistics.median(v[1:]) for k, v in steps.items()}  # the first call warms up
        kinds = {kind: sum(step_ms.get(s, 0.0) for s in names) for kind, names in FP8_STEP_KINDS.items()}
        out = {"steps_ms": step_ms, "kinds_ms": kinds,
               "note": "CUDA events between the steps of one forward and backward (moe_comm.fp8_experts), median "
                       f"of {iters} after one warm-up; a step's time includes its launch gap; every step on one "
                       "stream (beside_gemms off), so each is timed alone; the part's own time runs the backward's "
                       "transposes and widening beside its GEMMs"}
        if cache is not None:  # the breakdown's calls reuse the last step's copies: what a hit costs
            out["note"] += "; weights unchanged between these calls, so every one of them reuses the cached copies"
            out["weight_cache_made"] = dict(cache.made)  # quantisations over the whole part, timing included
        return out

    return Built(run, (anchor,), list(e.parameters()), 2 * rows["rows"] * 3 * a.dim * a.moe_inter_dim,
                 {"rows": rows["rows"], "padded_rows": sum(padded), "rows_per_expert": rows["rows_L"],
                  "local_experts": L, "align": fp8_experts.ROW_ALIGN, "routing": rows["routing"],
                  "wgrad": "fp8" if wgrad_fp8 else "bf16", "microbatches_per_step": microbatches},
                 f"{rows['routing']} routing at EP {case.ep}; [moe_comm] expert_dtype = \"fp8\" (moe_comm.fp8_experts), "
                 f"{'FP8' if wgrad_fp8 else 'bf16'} wgrad" + ("" if device.type == "cuda" else "; CPU: GEMMs emulated")
                 + (f"; weights quantised once per step of {microbatches} microbatches (WeightCache): the mean per "
                    "microbatch over whole steps" if cache else ""),
                 breakdown=breakdown, microbatches=microbatches, new_step=new_step)


def _convert_float8_grouped_mm(model: nn.Module) -> None:
    """TorchTitan's quantize.grouped_mm.float8 converter, applied as the float8 recipes apply it
    (fqns ["experts"]); it also sets the token-group alignment to 16, which is set back after."""
    import torchtitan.components.quantization  # noqa: F401 - registers the quantize.* converters
    from torchtitan.config import JobConfig
    from torchtitan.models.moe import utils as moe_utils
    from torchtitan.protocols.model_converter import build_model_converters

    jc = JobConfig()
    jc.model.converters = ["quantize.grouped_mm.float8"]
    jc.quantize.grouped_mm.float8.fqns = ["experts"]
    jc.compile.enable, jc.compile.components = True, ["model"]
    before = moe_utils.TOKEN_GROUP_ALIGN_SIZE_M
    build_model_converters(jc, None).convert(model)
    moe_utils.set_token_group_alignment_size_m(before)


def _moe_standin(a, case: Case, device) -> nn.Module:
    from torchtitan.models.moe.moe import MoE

    m = a.moe_args
    with torch.device("meta"):
        moe = MoE(m, a.dim, a.moe_inter_dim)
        moe.experts = ExpertParallelStandIn(a.dim, a.moe_inter_dim, m.num_experts, case.ep)
    moe.to_empty(device=device)
    with torch.no_grad():
        moe.init_weights(0.02, device)
    return _bf16_params(moe)


# ------------------------------------------------------------------------------ ceilings


def ceilings(device: torch.device, tiny: bool, clock: Clock, iters: int) -> dict:
    """What this GPU reaches: a large bf16 GEMM, a float8 rowwise GEMM, a device copy."""
    n = 256 if tiny else 8192
    out = {}

    def timed(fn, k=iters):
        for _ in range(3):
            fn()
        marks = []
        for _ in range(k):
            a = clock.mark()
            fn()
            marks.append((a, clock.mark()))
        clock.sync()
        return statistics.median(clock.ms(a, b) for a, b in marks)

    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = timed(lambda: torch.mm(x, y))
    out["bf16_gemm"] = {"shape": [n, n, n], "ms": ms, "tflops": 2 * n**3 / ms / 1e9,
                        "call": "torch.mm, bf16 in and out"}
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        a8 = x.to(torch.float8_e4m3fn)
        b8 = y.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major, as _scaled_mm needs
        sa = torch.ones(n, 1, device=device)
        sb = torch.ones(1, n, device=device)
        ms = timed(lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True))
        out["fp8_rowwise_gemm"] = {"shape": [n, n, n], "ms": ms, "tflops": 2 * n**3 / ms / 1e9,
                                   "call": "torch._scaled_mm, e4m3 x e4m3, fp32 rowwise scales, bf16 out, fast accum"}
    else:
        out["fp8_rowwise_gemm"] = {"status": "not run", "reason": "float8 GEMMs need a CUDA GPU of SM 8.9 or later"}
    elems = (1 << 20) if tiny else (1 << 29)  # 1 GiB of bf16 on the GPU
    src = torch.empty(elems, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src))
    out["copy"] = {"bytes": 2 * src.numel() * 2, "ms": ms, "tbs": 2 * src.numel() * 2 / ms / 1e9,
                   "call": "dst.copy_(src), bytes read + written"}
    del x, y, src, dst
    return out


def datasheet_peaks(device_name: str) -> dict:
    from moe_comm.metrics.peaks import table_peaks
    from moe_comm.predict.assumptions import READ

    peaks = table_peaks(device_name) or {}
    gpu = next((g for g in ("B200", "H200", "H100") if g in device_name), None)
    hbm = READ.get(f"hbm_tbs.{gpu}") if gpu else None
    return {"bf16_tflops": peaks.get("bf16"), "fp8_tflops": peaks.get("fp8"),
            "hbm_tbs": hbm.value if hbm else None,
            "source": "dense tensor-core peaks: moe_comm/metrics/peaks.py (NVIDIA datasheets); HBM: "
                      + (hbm.source if hbm else "unknown for this device")}


def machine(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": sys.version.split()[0]}
    for mod in ("torchtitan", "torchao", "triton"):
        try:
            info[mod] = __import__(mod).__version__
        except (ImportError, AttributeError):
            info[mod] = None
    if device.type != "cuda":
        return {**info, "device": "CPU", "cpus": os.cpu_count()}
    props = torch.cuda.get_device_properties(device)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        driver = None
    return {**info, "device": torch.cuda.get_device_name(device), "sms": props.multi_processor_count,
            "memory_gib": props.total_memory / 2**30, "capability": list(torch.cuda.get_device_capability(device)),
            "driver": driver, "cuda": torch.version.cuda}


# ------------------------------------------------------------------------------ run


def efficiency(rec: dict, peaks: dict, ceil: dict) -> dict:
    """Achieved rates of a measured part, against the datasheet and the measured ceilings."""
    out = {}
    for phase, work in (("fwd", rec["flops"]["fwd"]), ("bwd", rec["flops"]["bwd"])):
        ms = rec["ms"][phase]["median"]
        if rec["bound"] in ("compute", "mixed") and work:
            tflops = work / ms / 1e9
            peak = peaks.get(f"{rec['dtype']}_tflops")
            c = ceil.get("fp8_rowwise_gemm" if rec["dtype"] == "fp8" else "bf16_gemm", {}).get("tflops")
            out[phase] = {"tflops": tflops, "of_datasheet": tflops / peak if peak else None,
                          "of_measured_gemm": tflops / c if c else None}
        else:
            tbs = rec["bytes"][phase] / ms / 1e9
            hbm, copy = peaks.get("hbm_tbs"), ceil.get("copy", {}).get("tbs")
            out[phase] = {"tbs": tbs, "of_datasheet": tbs / hbm if hbm else None,
                          "of_measured_copy": tbs / copy if copy else None}
    return out


def run_part(part: Part, device, clock, args, state, peaks, ceil) -> dict:
    rec = {"case": part.case, "name": part.name, "bound": part.bound, "dtype": part.dtype,
           "count_per_layer": part.count_per_layer, "status": "ok"}
    built = part.build()
    arg_bytes = _nbytes(_tensors(built.args))
    grad_arg_bytes = _nbytes([t for t in _tensors(built.args) if t.requires_grad])
    param_bytes = _nbytes(built.params)
    plain = measure(built, clock, args.warmup, args.iters, ac=False)
    ac = measure(built, clock, args.warmup, args.iters, ac=True)
    out_bytes = plain.pop("out_bytes")
    ac.pop("out_bytes")
    rec["shape"], rec["note"] = built.shape, built.note
    rec["flops"] = {"fwd": built.flops_fwd, "bwd": 2 * built.flops_fwd}
    rec["bytes"] = built.bytes or {"fwd": arg_bytes + out_bytes + param_bytes,
                                   "bwd": out_bytes + arg_bytes + grad_arg_bytes + 2 * param_bytes}
    rec["ms"] = {"fwd": plain["fwd"], "bwd": plain["bwd"], "fwd_ac": ac["fwd"], "bwd_ac": ac["bwd"],
                 "recompute": ac["bwd"]["median"] - plain["bwd"]["median"]}
    rec["first_call_s"] = {"plain": plain["first_call_s"], "ac": ac["first_call_s"]}
    if built.breakdown is not None:
        rec["breakdown"] = built.breakdown()
    if part.profile:
        try:
            rec["kernels"] = kernel_ms(built, device)
        except Exception as e:  # the profiler is an extra: its failure leaves the timings standing
            rec["kernels"] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:300]}
    rec["efficiency"] = efficiency(rec, peaks, ceil)
    del built
    return rec


def _unmet(part: Part, device: torch.device, state: dict) -> str:
    if "cuda" in part.requires and device.type != "cuda":
        why = {"flex": "FlexAttention's backward does not run on CPU; the SDPA parts stand in",
               "varlen": "FlashAttention's variable-length kernel is CUDA only",
               "fp8": "float8 grouped GEMMs need a CUDA GPU of SM 8.9 or later"}
        return next((why[r] for r in part.requires if r in why), "needs a CUDA GPU")
    if "fp8" in part.requires and torch.cuda.get_device_capability(device) < (8, 9):
        return "float8 grouped GEMMs need SM 8.9 or later"
    if "hopper" in part.requires and torch.cuda.get_device_capability(device) != (9, 0):
        return "the FP8 experts' rowwise grouped GEMM is Hopper's (SM 9.0)"
    if "flex" in part.requires and state.get("flex_error"):
        return f"FlexAttention failed earlier in this run: {state['flex_error']}"
    return ""


def _expected_s(part: Part, state: dict) -> float:
    """Seconds a part is expected to take, compile included: the first such compile of this run
    where one was measured, else a guess (FlexAttention's max-autotune compile, forward and
    backward, is the longest)."""
    if "flex" in part.name:
        seen = state.setdefault("flex_shapes", set())
        new_shape = part.case not in seen
        seen.add(part.case)
        return state.get("flex_compile_s", 90.0) if new_shape else 5.0
    if "varlen" in part.name:  # TorchTitan compiles varlen_attn (one op, max-autotune-no-cudagraphs)
        seen = state.setdefault("varlen_shapes", set())
        new_shape = part.case not in seen
        seen.add(part.case)
        return 30.0 if new_shape else 5.0
    if ".compiled." in part.name:
        return state.get("experts_compile_s", 60.0)
    if part.name == LOSS_COMPILED:  # the loss's forward and backward graphs
        return 30.0
    return 10.0


def run(args) -> int:
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # set_device needs an index: the first GPU
    else:
        from moe_comm.titan import cpu

        cpu.apply()
    # static shapes for the compiled kernels (a run compiles each for one shape); enough room
    # for one graph per shape before dynamo would fall back to eager
    torch._dynamo.config.automatic_dynamic_shapes = False
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    torch.manual_seed(0)
    clock = Clock(device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info = machine(device)
    peaks = datasheet_peaks(info["device"])
    log(f"{info['device']}: datasheet {peaks}")
    ceil = ceilings(device, args.tiny, clock, args.iters)
    log("ceilings: " + ", ".join(f"{k} {v.get('tflops') or v.get('tbs') or v.get('reason')}" for k, v in ceil.items()))
    state: dict = {}
    all_cases = [c for c in cases(args.tiny) if not args.cases or c.name in args.cases]
    parts = [p for c in all_cases for p in build_parts(c, device, state)]
    if args.parts:
        parts = [p for p in parts if any(p.name.startswith(s) for s in args.parts)]
    order = {c.name: i for i, c in enumerate(all_cases)}
    parts.sort(key=lambda p: (p.priority, order[p.case]))
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    doc = {
        "schema": SCHEMA, "command": args.command, "date": now,
        "machine": info, "settings": {"iters": args.iters, "warmup": args.warmup, "budget_s": args.budget_s,
                                      "tiny": args.tiny, "doc_tokens_sensitivity": DOC_TOKENS},
        "peaks": {"datasheet": peaks, "measured": ceil},
        "cases": {c.name: {**asdict(c), "tokens": c.tokens, "tokens_sp": c.tokens_sp,
                           "received_rows": state["rows"][c.name], "documents": state["documents"][c.name]}
                  for c in all_cases},
        "documents": {name: document_distribution(name).summary() for name in DOC_DISTRIBUTIONS},
        "resumed_by": [],
        "parts": [],
    }
    run_index = 0
    if args.resume and out.is_file():  # keep what was measured; this run's figures name their run
        prev = json.loads(out.read_text())
        if prev.get("schema") != SCHEMA or prev["settings"]["tiny"] != args.tiny:
            raise SystemExit(f"--resume: {out} is not a layer_bench JSON of the same shape (schema, --tiny)")
        kept = {(q["case"], q["name"]) for q in prev["parts"] if q.get("status") == "ok"}
        prev["parts"] = [q for q in prev["parts"] if (q["case"], q["name"]) in kept]
        prev["cases"].update(doc["cases"])
        prev["documents"] = doc["documents"]
        prev["resumed_by"].append({"command": args.command, "date": now, "machine": info, "ceilings": ceil})
        run_index = len(prev["resumed_by"])
        doc = prev
        parts = [q for q in parts if (q.case, q.name) not in kept]
        log(f"--resume: {len(kept)} parts kept from {out}, {len(parts)} to run")
    for part in parts:
        rec = {"case": part.case, "name": part.name, "bound": part.bound, "dtype": part.dtype,
               "count_per_layer": part.count_per_layer}
        why = _unmet(part, device, state)
        elapsed = time.monotonic() - START
        expect = _expected_s(part, state)
        if not why and part.priority >= COMPILE_PRIORITY and elapsed + expect > args.budget_s:
            why = (f"time budget: {elapsed:.0f} s spent, about {expect:.0f} s more expected, past --budget-s "
                   f"{args.budget_s:g}")
        if why:
            rec.update(status="not run", reason=why)
            log(f"{part.case} {part.name}: not run ({why})")
        else:
            try:
                rec = run_part(part, device, clock, args, state, peaks, ceil)
                rec["run"] = run_index
                first = rec["first_call_s"]["plain"]
                if "flex" in part.name:
                    state["flex_ok"] = True
                    state.setdefault("flex_compile_s", first["fwd_s"] + first["bwd_s"])
                if ".compiled." in part.name:
                    state.setdefault("experts_compile_s", first["fwd_s"] + first["bwd_s"])
                log(f"{part.case} {part.name}: fwd {rec['ms']['fwd']['median']:.3f} ms, bwd "
                    f"{rec['ms']['bwd']['median']:.3f} ms, recompute +{rec['ms']['recompute']:.3f} ms; first call "
                    f"{first['fwd_s']:.1f} + {first['bwd_s']:.1f} s")
            except Exception as e:  # recorded, and the run goes on (an OOM, a compile failure)
                msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:500]
                rec.update(status="failed", reason=msg)
                if "flex" in part.name:
                    state["flex_error"] = msg
                log(f"{part.case} {part.name}: FAILED {msg}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        doc["parts"].append(rec)
        out.write_text(json.dumps(doc, indent=1) + "\n")
    log(f"wrote {out} ({sum(p.get('status') == 'ok' for p in doc['parts'])} of {len(doc['parts'])} parts measured)")
    return 0


# ------------------------------------------------------------------------------ report


def _f(x, nd=2):
    return "-" if x is None else f"{x:,.{nd}f}"


def _ok(doc: dict, case: str, name: str) -> dict | None:
    return next((p for p in doc["parts"] if p["case"] == case and p["name"] == name and p.get("status") == "ok"), None)


def layer_sums(doc: dict) -> dict:
    """Per case, the work every backend runs in one MoE layer, as the sum of its parts (each times
    its count per layer; the routed experts at the case's routing): fwd, bwd and the full-AC
    recompute in ms. The layout work around dispatch and combine differs by backend (the
    standard path's sort, gather, permute and unsort; our expand and reduce) and is left to the
    comm model. Where the flavor's attention kernel was not measured, SDPA's stands in, named."""
    sums = {}
    for p in doc["parts"]:
        if not p["count_per_layer"]:
            continue
        s = sums.setdefault(p["case"], {"fwd": 0.0, "bwd": 0.0, "recompute": 0.0, "parts": [], "missing": []})
        q = p if p.get("status") == "ok" else None
        label = p["name"]
        if q is None and p["name"].startswith("attention.module."):
            q = _ok(doc, p["case"], "attention.module.sdpa")
            label = f"attention.module.sdpa (for {p['name']}: {p['status']})"
        if q is None:
            s["missing"].append(f"{p['name']} ({p.get('status')})")
            continue
        n = p["count_per_layer"]
        for k in ("fwd", "bwd"):
            s[k] += n * q["ms"][k]["median"]
        s["recompute"] += n * q["ms"]["recompute"]
        s["parts"].append(f"{n} x {label}" if n > 1 else label)
    return sums


def standard_path_layout(doc: dict, case: str) -> dict | None:
    """The standard path's sort, gather, permute, unsort and weighting in one MoE layer: TorchTitan's
    MoE forward measured whole less its router, shared expert and grouped GEMM (derived)."""
    whole = _ok(doc, case, "moe.standard_local")
    parts = [_ok(doc, case, n) for n in ("router", "shared_expert", "experts.bf16.balanced")]
    if whole is None or None in parts:
        return None
    return {k: whole["ms"][k]["median"] - sum(q["ms"][k]["median"] for q in parts) for k in ("fwd", "bwd")}


def attention_choice(doc: dict) -> list[dict]:
    """Per case and document variant measured for both block-causal kernels: their fwd / bwd ms
    and which is faster under full AC (fwd + bwd + the recomputed fwd), with the slower's time over
    the faster's."""
    out = []
    for p in doc["parts"]:
        if not (p["name"].startswith("attention.core.flex") and p.get("status") == "ok"):
            continue
        v = _ok(doc, p["case"], p["name"].replace(".flex", ".varlen", 1))
        if v is None:
            continue
        ms = {k: (q["ms"]["fwd"]["median"], q["ms"]["bwd"]["median"]) for k, q in (("flex", p), ("varlen", v))}
        full = {k: 2 * f + b for k, (f, b) in ms.items()}
        faster = min(full, key=full.get)
        out.append({"case": p["case"], "documents": p["shape"].get("documents"), "pieces": p["shape"].get("pieces"),
                    **ms, "faster": faster, "full_ac_ratio": max(full.values()) / full[faster]})
    return out
FP8_TARGET = 0.75  # FP8 experts' forward + backward against bf16's, at the flagship rank's rows (issue 35)


def fp8_experts_against_bf16(doc: dict) -> list[str]:
    """Per case and routing: this project's FP8 experts' forward + backward against the bf16
    grouped GEMM's measured in the same run, and where the FP8 time goes."""
    lines = []
    for case in doc["cases"]:
        for routing in ("balanced", "node_limited"):
            bf16 = _ok(doc, case, f"experts.bf16.{routing}")
            for suffix, label in (("", "FP8 wgrad"), ("_bf16_wgrad", "bf16 wgrad"), ("_cached", None)):
                ours = _ok(doc, case, f"experts.{FP8_OURS}{suffix}.{routing}")
                if not (bf16 and ours):
                    continue
                if label is None:
                    label = (f"FP8 wgrad, weights quantised once per {ours['shape']['microbatches_per_step']} "
                             "microbatches, mean per microbatch")
                t_bf16, t_ours = (part_ms(q, "fwd") + part_ms(q, "bwd") for q in (bf16, ours))
                ratio = t_ours / t_bf16
                kinds = ours.get("breakdown", {}).get("kinds_ms", {})
                verdict = "met" if ratio <= FP8_TARGET else "missed"
                lines.append(f"- {case}, {routing}: FP8 experts ({label}) fwd + bwd {t_ours:.2f} ms, {ratio:.2f}x bf16's "
                             f"{t_bf16:.2f} ms (target <= {FP8_TARGET}x: {verdict})"
                             + (f"; steps: " + ", ".join(f"{k} {v:.2f}" for k, v in kinds.items()) + " ms" if kinds else ""))
    return lines


def report(doc: dict) -> str:
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"not a layer_bench JSON (schema {doc.get('schema')!r}, expected {SCHEMA!r})")
    m, pk = doc["machine"], doc["peaks"]
    ds, ms_ = pk["datasheet"], pk["measured"]
    lines = [
        f"Machine: {m['device']}" + (f", {m['sms']} SMs, driver {m.get('driver')}" if "sms" in m else "")
        + f"; torch {m['torch']}, torchtitan {m.get('torchtitan')}, torchao {m.get('torchao')}; {doc['date'][:10]}.",
        f"Command: `{doc['command']}`" + "".join(f"; then `{r['command']}` ({r['date'][:10]}, ceilings of its own)"
                                                  for r in doc.get("resumed_by", [])),
        "",
        f"Peaks: datasheet bf16 {_f(ds['bf16_tflops'], 0)} / fp8 {_f(ds['fp8_tflops'], 0)} TFLOPS dense, HBM "
        f"{_f(ds['hbm_tbs'], 1)} TB/s ({ds['source']}). Measured here: bf16 GEMM "
        f"{_f(ms_['bf16_gemm'].get('tflops'), 0)} TFLOPS, fp8 rowwise GEMM {_f(ms_['fp8_rowwise_gemm'].get('tflops'), 0)}"
        f" TFLOPS, copy {_f(ms_['copy'].get('tbs'), 2)} TB/s.",
        "",
    ]
    for name, c in doc["cases"].items():
        rb, rn = c["received_rows"]["balanced"], c["received_rows"]["node_limited"]
        lines.append(f"- **{name}**: {c['sequences']} x {c['seq_len']} tokens per microbatch, TP {c['tp']}, EP "
                     f"{c['ep']}; rows received per rank: {rb['rows']:,} balanced, {rn['rows']:,} node-limited "
                     f"(slowest rank; mean {rn['mean_rows']:,.0f}). Source: {c['source']}.")
    lines += ["", "Efficiency: compute parts in TFLOPS against the datasheet peak of their dtype (and the measured "
              "GEMM), memory-bound parts in TB/s against datasheet HBM (and the measured copy); fwd / bwd. "
              "\"recompute\" is the backward's extra time under full AC.", "",
              "| case | part | x/layer | fwd ms | bwd ms | recompute ms | rate fwd / bwd | of datasheet | of measured | "
              "first call s |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    case_order = list(doc["cases"])
    for p in sorted(doc["parts"], key=lambda q: case_order.index(q["case"]) if q["case"] in case_order else 99):
        if p.get("status") != "ok":
            lines.append(f"| {p['case']} | {p['name']} | {p['count_per_layer']} | {p['status']}: {p.get('reason', '')} "
                         "| | | | | | |")
            continue
        e = p["efficiency"]
        unit = "tflops" if "tflops" in e["fwd"] else "tbs"
        other = "of_measured_gemm" if unit == "tflops" else "of_measured_copy"
        pct = lambda k: " / ".join("-" if e[ph][k] is None else f"{100 * e[ph][k]:.0f}%" for ph in ("fwd", "bwd"))  # noqa: E731
        first = p["first_call_s"]["plain"]
        lines.append(
            f"| {p['case']} | {p['name']} | {p['count_per_layer']} | {_f(p['ms']['fwd']['median'], 3)} | "
            f"{_f(p['ms']['bwd']['median'], 3)} | {_f(p['ms']['recompute'], 3)} | "
            f"{_f(e['fwd'][unit], 1 if unit == 'tflops' else 2)} / {_f(e['bwd'][unit], 1 if unit == 'tflops' else 2)} "
            f"{'TFLOPS' if unit == 'tflops' else 'TB/s'} | {pct('of_datasheet')} | {pct(other)} | "
            f"{first['fwd_s']:.1f} + {first['bwd_s']:.1f} |")
    lines += ["", "One MoE layer, the work every backend runs, as the sum of its parts (x/layer counts; the routed "
              "experts at the case's routing; dispatch/combine and their layout work are the comm model's):", ""]
    for case, s in layer_sums(doc).items():
        lines.append(f"- {case}: fwd {s['fwd']:.2f} ms, bwd {s['bwd']:.2f} ms, full-AC recompute +{s['recompute']:.2f} ms "
                     f"({' + '.join(s['parts'])})" + (f"; not measured: {', '.join(s['missing'])}" if s["missing"] else ""))
        lay = standard_path_layout(doc, case)
        if lay:
            lines.append(f"- {case}: the standard path's own layout work (sort, gather, permute, unsort, weighting; "
                         f"moe.standard_local less router, shared expert and grouped GEMM, derived): fwd "
                         f"{lay['fwd']:.2f} ms, bwd {lay['bwd']:.2f} ms")
    choice = attention_choice(doc)
    if choice:
        lines += ["", "Block-causal attention kernels alone at the data's documents (fwd / bwd ms; \"full AC\" adds the "
                  "forward's recompute): FlexAttention against variable-length attention, the faster under full AC "
                  "named:", "", "| case | documents | pieces | flex fwd / bwd | varlen fwd / bwd | faster (full AC) |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for c in choice:
            lines.append(f"| {c['case']} | {c['documents']} | {c['pieces']} | {c['flex'][0]:.3f} / {c['flex'][1]:.3f} | "
                         f"{c['varlen'][0]:.3f} / {c['varlen'][1]:.3f} | {c['faster']} "
                         f"({c['full_ac_ratio']:.2f}x) |")
    fp8 = fp8_experts_against_bf16(doc)
    if fp8:
        lines += ["", "The routed experts through `[moe_comm] expert_dtype = \"fp8\"` against bf16, same run:", ""] + fp8
    for p in doc["parts"]:
        if p.get("status") == "ok" and p.get("kernels") and "kernel_ms" in p["kernels"]:
            k = p["kernels"]
            lines.append(f"- {p['case']} {p['name']} (measured whole): fwd {p['ms']['fwd']['median']:.2f} ms, bwd "
                         f"{p['ms']['bwd']['median']:.2f} ms; kernels {k['kernel_ms']:.2f} of {k['wall_ms']:.2f} ms "
                         "wall per fwd + bwd (the rest: the GPU waiting on the host)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("run", help="measure and write the JSON")
    r.add_argument("--out", default=str(REPO / "results" / "model_inputs" / "layer_bench_h200x1.json"))
    r.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    r.add_argument("--tiny", action="store_true", help="a tiny shape (the CPU smoke test)")
    r.add_argument("--iters", type=int, default=None, help="timed iterations per mode (default 10; --tiny 2)")
    r.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 3; --tiny 1)")
    r.add_argument("--budget-s", type=float, default=210.0,
                   help="start no compile-bearing part after this many seconds since start (default 210)")
    r.add_argument("--cases", nargs="+", help="only these cases (flagship, nebius)")
    r.add_argument("--parts", nargs="+", help="only parts whose names start with one of these")
    r.add_argument("--resume", action="store_true",
                   help="keep the parts --out already measured (status ok), run the rest, append this command")
    rep = sub.add_parser("report", help="print the markdown table of a layer_bench JSON")
    rep.add_argument("json")
    args = p.parse_args(argv)
    if args.verb == "report":
        print(report(json.loads(Path(args.json).read_text())))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu --tiny for the smoke path)")
    if args.device == "cpu" and not args.tiny:
        p.error("--device cpu needs --tiny: the 671B shapes are GPU work")
    args.iters = args.iters or (2 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.command = shlex.join(["python", "experiments/layer_bench.py", *argv])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
