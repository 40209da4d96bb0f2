"""The planner: every layout a recipe could run on a cluster, the ones that fit in memory, ranked
by the scale model's tokens/s per GPU for each backend.

The search space (TorchTitan 0.2.2 with our EP hook, which takes no TP; no CP, no HSDP):
  * PP degree: 1, 2, 4, 8, 16 where it divides the world; FSDP (dp_shard) takes the rest;
  * the schedule (moe_comm.predict.schedule's five) and its stages per rank: every count
    `pipeline_parallel_layers_per_stage` can give it;
  * the microbatch size (1, 2, 4 sequences) and count, from the local batch: every power-of-two
    local batch whose global batch (local batch x seq_len x dp_shard tokens) lies in the range
    asked for (by default the recipe's own global batch up to 4 times it: a larger batch buys
    throughput at the optimiser's expense, so the plan does not reach for it unasked);
  * AC none / selective / full;
  * the EP degree (a divisor of dp_shard and of the experts, at least one node's GPUs or the
    recipe's own), which sets the EP / FSDP split of the experts (efsdp = dp_shard / ep);
  * the MoE overlap: none, chunked and microbatch ([moe_comm] overlap; microbatch with
    Interleaved1F1B), and DualPipeV's own, alone or with the chunked overlap in the
    microbatch-stages outside its pairs, with every AC mode (TorchTitan refuses AC there; our
    recompute is comm-free, and moe_comm.titan.parallelize lifts the refusal).
A layout is kept for a backend when its `check_run` accepts it (moe_comm.predict.scale_model's
refusal) and the memory estimate (moe_comm.predict.scale_model.memory: the pipeline rank that
holds the most, with what the backend's comm-free recompute keeps) plus the backend's symmetric
heap, where it has one, leaves the headroom asked for: 15% by default, issue 23's bound (memory
in use at most 85% of the GPU), wider than `check`'s 10% fit verdict because the estimate's
pipeline terms have not met a multi-node measurement yet.
Backends: every one the scale model prices, with each dispatch dtype it takes
(moe_comm.predict.scale_model.choices).
Layouts are ranked by their central prediction; the rows shown carry the range the unmeasured
inputs give (scale_model.predict_range), and a row whose range meets the best row's is one the
model cannot tell apart from it.
Every figure is a model prediction, with the model's assumptions (results/scale_model.md).
"""

import itertools
import math
from dataclasses import dataclass, field, replace

from moe_comm import gpus
from moe_comm.backends import backend_class
from moe_comm import layout as run_layout
from moe_comm.predict import estimate, schedule, scale_model
from moe_comm.predict.calibration import Calibration

PP_DEGREES = (1, 2, 4, 8, 16)
MICROBATCH_SIZES = (1, 2, 4)
AC_MODES = ("none", "selective", "full")
BATCH_RANGE = (1.0, 4.0)  # the global batch searched, as multiples of the recipe's
KEEP_KEYS = {
    "ep": "expert_parallel_degree", "pp": "pipeline_parallel_degree", "schedule": "pipeline_parallel_schedule",
    "stages": "stages per rank (from pipeline_parallel_layers_per_stage)",
    "microbatch": "pipeline_parallel_microbatch_size",
    "local_batch": "local_batch_size", "ac": "activation_checkpoint mode", "overlap": "[moe_comm] overlap",
}
@dataclass(frozen=True)
class Reference:
    """A published run `--explain` measures a prediction against, in tokens/s per GPU (its
    TFLOPS figure counts its own way; the comparison puts both on one convention)."""

    name: str
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float  # as published
    gpu: str
    layout: str
    source: str


# The same-hardware anchor (issue 34 item 5): its published performance summary.
MEGATRON_BRIDGE_B200 = Reference(
    "Megatron-Bridge DeepSeek-V3", 3328.0, 864.0, "B200",
    "256 B200, MXFP8, TP 1, PP 8, VPP 2, EP 32, forced-balanced routing",
    "Megatron-Bridge performance summary, release 26.04.01")


class PlanError(ValueError):
    """A request the planner cannot answer: a bad --keep, or a cluster nothing fits on."""


@dataclass(frozen=True)
class Layout:
    """One point of the search space."""

    pp: int
    schedule: str
    layers_per_stage: int | None
    v: int
    microbatch: int
    local_batch: int
    ac: str
    ep: int
    overlap: str

    @property
    def microbatches(self) -> int:
        return self.local_batch // self.microbatch


@dataclass
class Row:
    choice: scale_model.Choice
    layout: Layout
    prediction: scale_model.StepPrediction
    memory_gib: float  # in use at the peak, plus the backend's symmetric heap
    memory_limit_gib: float
    overrides: list[str]
    range: scale_model.PredictionRange | None = None  # the rows shown: every scenario of the unmeasured inputs

    @property
    def label(self) -> str:
        return self.choice.label

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.prediction.tokens_per_s_per_gpu

    @property
    def span(self) -> tuple[float, float, float]:
        """(low, central, high) tokens/s per GPU."""
        return self.range.span() if self.range else (self.tokens_per_s_per_gpu,) * 3

    @property
    def bounds(self) -> dict[str, float]:
        """What holds the row back: the bubble's and the exposed MoE communication's shares of
        the step, and the memory's share of what may be used."""
        t, step = self.prediction.terms_ms, self.prediction.step_ms
        exposed = t["moe comm"] + t["comm SM contention"] + t["chunked weight work"]
        return {"bubble": t["pp bubble"] / step, "exposed comm": exposed / step,
                "memory": self.memory_gib / self.memory_limit_gib}


@dataclass
class Request:
    """What the plan searches: the recipe's model and settings, the cluster, what is kept."""

    base: scale_model.Workload
    gpu: str
    nodes: int
    gpus_per_node: int
    recv_capacity_factor: float
    recipe_values: dict  # the recipe's own choices, to write only the overrides that differ
    keep: dict = field(default_factory=dict)
    backends: tuple = field(default_factory=lambda: tuple(scale_model.choices()))  # of scale_model.Choice
    global_tokens: tuple[float, float] = (0.0, 0.0)  # 0: BATCH_RANGE x the recipe's
    headroom: float = 0.15


def parse_keep(items: list[str]) -> dict:
    """`--keep ep=32 --keep schedule=Interleaved1F1B`: a PlanError names a bad one."""
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in KEEP_KEYS or not value:
            raise PlanError(f"--keep {item!r}: write KEY=VALUE with KEY one of {sorted(KEEP_KEYS)}")
        if key in ("schedule",):
            try:
                out[key] = schedule.canonical(value)
            except ValueError as e:
                raise PlanError(f"--keep {item!r}: {e}") from None
        elif key == "ac":
            if value not in AC_MODES:
                raise PlanError(f"--keep {item!r}: ac is one of {list(AC_MODES)}")
            out[key] = value
        elif key == "overlap":
            if value not in scale_model.OVERLAPS:
                raise PlanError(f"--keep {item!r}: overlap is one of {list(scale_model.OVERLAPS)}")
            out[key] = value
        else:
            try:
                out[key] = int(value)
            except ValueError:
                raise PlanError(f"--keep {item!r}: {key} takes a whole number") from None
            if out[key] < 1:
                raise PlanError(f"--keep {item!r}: {key} must be >= 1")
    return out


def backend_choices(labels) -> tuple[scale_model.Choice, ...]:
    """The scale model's choices named by `labels` (--backend: a class's label, with the dispatch
    dtype unless bf16); every one when `labels` is empty."""
    known = {c.label: c for c in scale_model.choices()}
    for label in labels:
        if label not in known:
            raise PlanError(f"--backend {label!r}: choose from {list(known)}")
    return tuple(known[label] for label in labels) if labels else tuple(known.values())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pow2_between(lo: float, hi: float) -> list[int]:
    out, k = [], 1
    while k <= hi:
        if k >= lo:
            out.append(k)
        k *= 2
    return out


def layouts(req: Request) -> list[Layout]:
    """Every layout of the search space TorchTitan and torch would build (before memory)."""
    a, base, keep = req.base.args, req.base, req.keep
    world = req.nodes * req.gpus_per_node
    recipe_tokens = base.local_batch * base.seq_len * base.layout.dp_shard * base.layout.dp_replicate
    lo, hi = req.global_tokens if req.global_tokens[1] else (BATCH_RANGE[0] * recipe_tokens,
                                                             BATCH_RANGE[1] * recipe_tokens)
    experts = a.moe_args.num_experts
    out = []
    for pp in PP_DEGREES:
        if world % pp or pp > a.n_layers:
            continue
        dp = world // pp
        # EP: a divisor of dp_shard and of the experts, at least a node's GPUs (or the recipe's)
        eps = [e for e in _divisors(math.gcd(dp, experts))  # divides both
               if (e >= min(req.gpus_per_node, dp) or e == base.layout.ep)]
        per_dp = base.seq_len * dp
        batches = set(_pow2_between(lo / per_dp, hi / per_dp))
        if lo <= base.local_batch * per_dp <= hi:
            batches.add(base.local_batch)
        pipelines = []  # (schedule, stages per rank, layers_per_stage, microbatch size)
        for name in (schedule.SCHEDULES if pp > 1 else ("1F1B",)):
            options = schedule.layers_per_stage_options(name, pp, a.n_layers) if pp > 1 else {1: None}
            sizes = MICROBATCH_SIZES if pp > 1 else (0,)
            for (v, per_stage), mbs in itertools.product(sorted(options.items()), sizes):
                pipelines.append((name, v, per_stage, mbs))
        for (name, v, per_stage, mbs), lb, ac, ep in itertools.product(pipelines, sorted(batches), AC_MODES, eps):
            mb = mbs or lb  # without PP one "microbatch" is the local batch
            if lb % mb or not _pipeline_ok(name, pp, lb // mb, v):
                continue
            overlaps = (("none", "chunked") + (("microbatch",) if name == "Interleaved1F1B" and ep > 1 else ())
                        + (scale_model.DUALPIPEV if name == "DualPipeV" else ()))
            for ov in overlaps:
                lay = Layout(pp, name, per_stage, v, mb, lb, ac, ep, ov)
                if _kept(lay, keep):
                    out.append(lay)
    return out


def _pipeline_ok(name: str, pp: int, microbatches: int, v: int) -> bool:
    if pp == 1:
        return True
    try:
        schedule.Pipeline(name, pp, microbatches, v).validate()
    except ValueError:
        return False
    return True


def _kept(lay: Layout, keep: dict) -> bool:
    """Whether a layout holds every --keep value."""
    have = {"ep": lay.ep, "pp": lay.pp, "schedule": lay.schedule, "stages": lay.v, "microbatch": lay.microbatch,
            "local_batch": lay.local_batch, "ac": lay.ac, "overlap": lay.overlap}
    # without PP there is no schedule and no microbatching to keep
    return all(have[k] == v for k, v in keep.items() if not (k in ("schedule", "microbatch") and lay.pp == 1))


def _workload(req: Request, lay: Layout) -> scale_model.Workload:
    world = req.nodes * req.gpus_per_node
    dp = world // lay.pp
    layout = run_layout.Layout(world, req.nodes, req.gpus_per_node, 1, dp, 1, 1, lay.pp, lay.ep, 1)
    return replace(req.base, layout=layout, local_batch=lay.local_batch, microbatch=lay.microbatch,
                   ac_mode=lay.ac, pp_schedule=lay.schedule, layers_per_stage=lay.layers_per_stage,
                   overlap=lay.overlap)


def _heap_gib(req: Request, w: scale_model.Workload) -> float:
    """The symmetric heap (outside torch's allocator) a backend that has one holds at this layout."""
    from moe_comm.kernels import capacity

    m = w.args.moe_args
    s = capacity.buffer_sizes(w.tokens_per_call, m.num_experts, m.top_k, w.args.dim * 2, w.layout.ep,
                              w.ranks_per_node, req.recv_capacity_factor)
    return s.symmetric_bytes() / estimate.GiB


def overrides(req: Request, lay: Layout, choice: scale_model.Choice) -> list[str]:
    """The command-line overrides that turn the recipe into this row (only what differs)."""
    r = req.recipe_values
    want = [
        ("--cluster.nodes", req.nodes, r["nodes"]),
        ("--parallelism.pipeline_parallel_degree", lay.pp, r["pp"]),
        ("--parallelism.expert_parallel_degree", lay.ep, r["ep"]),
        ("--training.local_batch_size", lay.local_batch, r["local_batch"]),
        ("--activation_checkpoint.mode", lay.ac, r["ac"]),
        ("--moe_comm.backend", choice.backend, None),  # always: the row is a backend's
    ]
    if len(backend_class(choice.backend).dispatch_dtypes) > 1:  # it reads dispatch_dtype
        want.append(("--moe_comm.dispatch_dtype", choice.dispatch_dtype, r["dispatch_dtype"]))
    if lay.pp > 1:
        want += [("--parallelism.pipeline_parallel_schedule", lay.schedule, r["schedule"]),
                 ("--parallelism.pipeline_parallel_microbatch_size", lay.microbatch, r["microbatch"]),
                 ("--parallelism.pipeline_parallel_layers_per_stage", lay.layers_per_stage, r["layers_per_stage"])]
    if lay.schedule == "DualPipeV" and lay.pp > 1:
        want.append(("--parallelism.pipeline_parallel_expert_parallel_overlap",
                     "true" if lay.overlap in scale_model.DUALPIPEV else "false",
                     "true" if r["dualpipe_overlap"] else "false"))
    want.append(("--moe_comm.overlap", scale_model.moe_comm_overlap(lay.overlap), r["overlap"]))
    out = []
    for flag, value, theirs in want:
        if value != theirs:
            out += [flag, str(value)]
    return out


def plan(req: Request, cal: Calibration, top: int = 10) -> dict[str, list[Row]]:
    """The best `top` feasible layouts per backend (by its choice's label), fastest first
    (PlanError if none fits)."""
    world = req.nodes * req.gpus_per_node
    if req.nodes < 1 or req.gpus_per_node < 1:
        raise PlanError(f"a cluster of {req.nodes} node(s) x {req.gpus_per_node} GPU(s) is empty")
    experts = req.base.args.moe_args.num_experts
    if "ep" in req.keep and (world % req.keep["ep"] or experts % req.keep["ep"]):
        raise PlanError(f"--keep ep={req.keep['ep']}: EP must divide the {world} GPUs and the {experts} experts")
    gpu_mem = _gpu_memory_gib(req.gpu)
    limit = (1 - req.headroom) * gpu_mem
    cluster = scale_model.cluster_for(req.gpu, req.nodes, req.gpus_per_node, cal)
    candidates = layouts(req)
    if not candidates:
        raise PlanError(_no_layout(req))
    rows: dict[str, list[Row]] = {c.label: [] for c in req.backends}
    memo: dict = {}
    least = math.inf
    for lay in candidates:
        w = _workload(req, lay)
        heap = None
        for c in req.backends:
            cls = backend_class(c.backend)
            # what the estimate depends on: the layout, and the backend's kept comm tensors
            key = (lay.pp, lay.schedule, lay.v, lay.microbatch, lay.local_batch, lay.ac, lay.ep, lay.overlap,
                   cls.costs.transport)
            if key not in memo:
                memo[key] = scale_model.memory(w, c.backend).total / estimate.GiB
            if cls.symmetric_heap and heap is None:
                heap = _heap_gib(req, w)
            total = memo[key] + (heap if cls.symmetric_heap else 0.0)
            least = min(least, total)
            if total > limit or not scale_model.runnable(c.backend, w, c.dispatch_dtype):
                continue
            p = scale_model.predict(c.backend, w, cluster, cal, c.dispatch_dtype)
            rows[c.label].append(Row(c, lay, p, total, limit, overrides(req, lay, c)))
    if not any(rows.values()):
        raise PlanError(f"nothing fits on {req.nodes} x {req.gpus_per_node} {req.gpu} ({gpu_mem:.0f} GiB, "
                        f"{req.headroom:.0%} headroom: {limit:.0f} GiB) with {kept_text(req)}: the smallest layout "
                        f"needs {least:.0f} GiB per GPU; add nodes or relax --keep")
    best = {b: sorted(r, key=lambda row: -row.tokens_per_s_per_gpu)[:top] for b, r in rows.items()}
    for top_rows in best.values():  # the rows shown carry their range
        for row in top_rows:
            row.range = scale_model.predict_range(row.choice.backend, _workload(req, row.layout), cluster, cal,
                                                  row.choice.dispatch_dtype)
    return best


def overlaps_best(row: Row, best: Row) -> bool:
    """Whether a row's tokens/s range meets the best row's: the model cannot rank the two."""
    return row is not best and row.range is not None and best.range is not None and row.range.overlaps(best.range)


def _no_layout(req: Request) -> str:
    """Why the search space is empty: a cluster whose smallest global batch (one sequence per
    data-parallel rank) is above the range searched, else the values kept."""
    a, base = req.base.args, req.base
    world = req.nodes * req.gpus_per_node
    where = f"on {req.nodes} x {req.gpus_per_node} {req.gpu} ({world:,} GPUs)"
    recipe_tokens = base.local_batch * base.seq_len * base.layout.dp_shard * base.layout.dp_replicate
    if req.global_tokens[1]:
        lo, hi, searched = *req.global_tokens, "--global-tokens"
    else:
        lo, hi = BATCH_RANGE[0] * recipe_tokens, BATCH_RANGE[1] * recipe_tokens
        searched = f"the recipe's global batch up to {BATCH_RANGE[1]:g}x"
    pps = [pp for pp in PP_DEGREES if world % pp == 0 and pp <= a.n_layers]
    if pps and "pp" not in req.keep:
        pp = max(pps)
        smallest = base.seq_len * world // pp
        if smallest > hi:
            return (f"{where} the smallest global batch is {smallest:,} tokens (one sequence of {base.seq_len:,} "
                    f"on each of {world // pp:,} data-parallel ranks, at PP {pp}), above the range searched, "
                    f"{lo:,.0f}-{hi:,.0f} tokens ({searched}): plan for fewer nodes, or pass --global-tokens "
                    "MIN-MAX to search larger batches")
    return (f"no layout of the search space can run {where} with {kept_text(req)}: the kept values exclude every "
            "PP degree, schedule or batch")


def kept_text(req: Request) -> str:
    return ", ".join(f"{k}={v}" for k, v in req.keep.items()) or "nothing kept"


def _gpu_memory_gib(gpu: str) -> float:
    known = gpus.lookup(gpu)
    if known is None:
        raise PlanError(f"--gpu {gpu!r}: the plan knows {list(gpus.MODELS)}")
    return known.memory_gib


def causal_flops_per_token(a, seq_len: int) -> float:
    """Megatron's count of a token's training flops: TorchTitan's (6 x active parameters less the
    embedding, plus the attention matrix) with the attention halved for the causal mask, which
    executes half of it. One convention for both sides of a comparison with Megatron."""
    p = estimate.count_params(a)
    head_dims = a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim
    return 6 * (p.active - p.embedding) + 6 * a.n_layers * a.n_heads * head_dims * seq_len / 2


# The step's terms as `shortfall` names them: (line, the StepPrediction terms it sums, less the
# recompute's share of the compute terms, which is a line of its own).
SHORTFALL_TERMS = (
    ("memory-bound kernels", ("memory-bound",)),
    ("activation recompute", ()),
    ("exposed MoE transfers", ("moe comm",)),
    ("host synchronisations", ()),
    ("comm SM contention", ("comm SM contention",)),
    ("chunked overlap's weight work", ("chunked weight work",)),
    ("TP communication", ("tp comm",)),
    ("PP sends", ("pp p2p",)),
    ("pipeline bubble", ("pp bubble",)),
    ("exposed FSDP collectives", ("fsdp exposed",)),
    ("optimizer step", ("optimizer",)),
    ("parameter and gradient copies (FSDP, PP accumulation)", ("param copies",)),
    ("GPU idle (launch gaps, host work)", ("idle",)),
)


def shortfall_terms(p: scale_model.StepPrediction) -> list[tuple[str, float]]:
    """(line, ms per step) of every term beyond the matmuls and attention kernels' own time."""
    t, redo = p.terms_ms, p.recompute_ms
    out = []
    for name, keys in SHORTFALL_TERMS:
        ms = sum(t[k] for k in keys)
        if name == "memory-bound kernels":
            ms -= redo["memory-bound"]
        elif name == "activation recompute":
            ms = sum(redo.values())
        elif name == "exposed MoE transfers":
            ms -= p.host_sync_ms
        elif name == "host synchronisations":
            ms = p.host_sync_ms
        out.append((name, ms))
    return out


def shortfall(p: scale_model.StepPrediction, flops_per_token: float,
              reference_tokens_per_s: float) -> list[tuple[str, float]]:
    """Where a prediction's TFLOPS/GPU fall short of a reference's, term by term, both at
    `flops_per_token` (one convention): (line, TFLOPS). The first line is the reference less what
    the step's matmuls and attention kernels alone would reach (at their measured times; negative
    when they alone would beat it). Each later line is that term's Shapley share of the rest: its
    cost (TFLOPS lost by adding its time to the step) averaged over every order of adding the terms
    - exact, over every subset - so no line depends on the order they are listed in, and the
    lines add up to the reference less the prediction."""
    work = p.tokens_per_step * flops_per_token / 1e12  # the step's model TFLOP on this rank
    t, redo = p.terms_ms, p.recompute_ms
    elapsed = t["gemm"] - redo["gemm"] + t["attention"] - redo["attention"]  # ms
    terms = [(n, ms) for n, ms in shortfall_terms(p) if ms > 0]
    n = len(terms)

    def tflops(total_ms: float) -> float:
        return work / (total_ms * 1e-3)

    weight = [math.factorial(k) * math.factorial(n - k - 1) / math.factorial(n) for k in range(n)]
    shares = [0.0] * n
    for mask in range(1 << n):
        base = elapsed + sum(terms[j][1] for j in range(n) if mask >> j & 1)
        k = bin(mask).count("1")
        for i in range(n):
            if not mask >> i & 1:
                shares[i] += weight[k] * (tflops(base) - tflops(base + terms[i][1]))
    reference = reference_tokens_per_s * flops_per_token / 1e12
    return ([("the reference less matmuls and attention alone (at their measured times)", reference - tflops(elapsed))]
            + [(name, share) for (name, _), share in zip(terms, shares)])


def differences(w: scale_model.Workload, ref: Reference = MEGATRON_BRIDGE_B200) -> list[str]:
    """What in a workload's layout differs from the Megatron-Bridge anchor's (issue 34 item 5)."""
    lay = w.layout
    pipe = estimate.pipeline_ranks(w.args, lay, w.local_batch, w.microbatch, w.pp_schedule, w.layers_per_stage)[0].pipe
    out = []
    if (lay.pp, pipe.v) != (8, 2):
        out.append(f"PP {lay.pp} with {pipe.v} stage(s) per rank ({pipe.name}) against PP 8, VPP 2")
    if lay.ep != 32:
        out.append(f"EP {lay.ep} against 32")
    if "quantize.grouped_mm.mx" not in w.converters:
        out.append("bf16 grouped GEMMs against MXFP8 (every GEMM)")
    else:
        out.append("MXFP8 grouped GEMMs only (the dense GEMMs stay bf16) against MXFP8 for every GEMM")
    if w.routing != "balanced":
        out.append(f"the model's own router ({w.routing}, with its busiest-rank skew) against forced-balanced routing")
    out.append({"microbatch": "EP communication behind another microbatch's layer in Interleaved1F1B's overlapped "
                              "pairs (weight gradients not delayed into it)",
                "chunked": "EP communication behind the same layer's experts only (chunked)",
                "dualpipev": "DualPipeV's EP overlap",
                "dualpipev+chunked": "DualPipeV's EP overlap (chunked outside its pairs)",
                "none": "no EP overlap"}[w.overlap]
               + " against Megatron's EP overlap across microbatches with delayed weight gradients")
    out.append(f"AC {w.ac_mode} against Megatron's selective recompute")
    if w.documents is not None:
        out.append(f"block-causal attention over {w.documents.name}'s documents (the anchor's mask is not stated)")
    out.append("DeepSeek-V3's multi-token-prediction layer: Megatron trains it (its 864 TFLOPS count it), TorchTitan "
               "does not")
    return out
