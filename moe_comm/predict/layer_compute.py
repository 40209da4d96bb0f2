"""One rank's compute per microbatch, priced from the one-GPU layer benchmark
(experiments/layer_bench.py -> results/model_inputs/layer_bench_h200x1.json): each part of a DeepSeek-V3-671B
layer measured at the per-rank shape a layout runs, forward, backward and full-AC recompute. It is
the step model's only source of GEMM, attention and memory-bound times: nothing here is fitted to
an end-to-end figure, and the public anchors are never read (their table is
results/model_inputs/scale_model_validation.json, read only by moe_comm.predict.validation).

How a measured part becomes a predicted time (each rule is listed in `assumptions`):
  * shape: a workload is priced from the measured case of its TP degree (the flagship's TP 1
    microbatch, the Nebius anchors' TP 2 one; the nearest TP otherwise), the closest in sequence
    length; a part scales by its work on the rank (`part_work`) - flops for the GEMM parts and
    the attention kernel, tokens x dim for the memory-bound ones. At the benchmark's own layer
    shapes that is tokens, pairs and rows; for another flavor (16B, ...) it assumes the part runs
    at the measured part's efficiency;
  * attention as the data has it: a block-causal flavor attends within each document, so the
    kernel's work is the (query, key) pairs the recipe's documents keep in a packed sequence
    (moe_comm.predict.documents: TorchTitan's packing of the dataset's lengths) x heads x head
    dims. It is priced from the kernel the flavor runs (FlexAttention or variable-length
    attention) measured at the same distribution where the bench ran it, else at 512-token
    documents, else at one document, by the ratio of kept pairs x heads (the measured part's
    own, from its flop count): a case the bench did not run at all (the Nebius anchors' TP 2 x
    8192, when only the flagship's case ran) takes the flagship's part by that rule. A causal
    flavor keeps one document per sequence;
  * the routed experts' grouped GEMM scales by the rows the busiest rank receives: the mean
    rank's rows at the workload's EP and routing (moe_comm.predict.routing_plan) times the
    busiest-rank factor the step model passes (the measured routing's, at the recipe's EP), or
    the drawn routing's own busiest rank;
  * the router is launch-bound at these sizes (its measured forward takes about as long at 4096
    as at 8192 tokens): its measured time stands as it is, on any GPU, up to the measured case's
    tokens, and grows with the tokens beyond them;
  * GPU: a time measured on one GPU scales to another by the ratio of their datasheet peaks
    of the resource the part is bound by - dense bf16 (or 8-bit) TFLOPS for GEMMs and the
    attention kernel, HBM TB/s for memory-bound parts - that is, the other GPU is assumed to
    reach the same share of its peak, times `peak_share` (an unmeasured input with a range);
  * FP8 experts ([moe_comm] expert_dtype = "fp8", Hopper): the benchmark's part of this
    project's FP8 experts (experts.moe_comm_fp8.*: e4m3 GEMMs with their quantisation steps, the
    rows arriving in e4m3 from dispatch). A B200 runs MXFP8 instead (torchao's converter
    quantize.grouped_mm.mx, block scales inside its tensor cores, no H200 can run it): priced as
    that measured part with its GEMM steps at the 8-bit peak ratio and its quantisation steps at
    the HBM ratio, plus the rows' own quantisation the sender does in ours (MXFP8_ASSUMPTION);
    where the part was not measured, the bf16 grouped GEMM x the measured bf16 / fp8 dense GEMM
    ceiling ratio at the 8-bit peak ratio;
  * float8 (torchao's rowwise recipe, Hopper): every recipe that converts them compiles the
    model. The float8 rowwise grouped GEMM is the benchmark's compiled one (as TorchTitan's
    apply_compile runs it); where that was not measured, the bf16 part's time x the measured bf16
    / fp8 rowwise GEMM ceiling ratio (torch.mm against torch._scaled_mm, same run). The eager
    float8 grouped GEMM is measured (slower still: its quantisation is not fused) and never used;
  * AC: "full" adds each block part's measured recompute (backward under checkpoint less
    backward); "selective" is TorchTitan's op-level SAC, which saves the attention kernel's
    output and every second mm (torchtitan/distributed/activation_checkpoint.py, and
    deepseek_v3's _op_sac_save_list, which has no grouped mm): it re-runs the grouped GEMMs
    and the memory-bound ops, and half the linear GEMMs' forward. The embedding and the output
    projection + loss sit outside the checkpointed blocks;
  * a part the benchmark did not run (FlexAttention, should its compile run out of time) takes
    a stated stand-in (SDPA's time at the same shape), and `RankCompute.notes` says so.
A pipeline rank is priced for the layers it holds (moe_comm.predict.estimate.pipeline_ranks),
with the embedding on the first stage and the output projection + loss on the last.
"""

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from moe_comm import fp8_experts, gpus
from moe_comm.predict import documents
from moe_comm.predict.assumptions import MODEL_INPUTS, REPO, Assumption
from moe_comm.predict.routing_plan import routing_statistics

BENCH = MODEL_INPUTS / "layer_bench_h200x1.json"


class NotCovered(ValueError):
    """The benchmark cannot price this workload (context parallelism: no case splits the
    sequence); the step model refuses it, naming why."""


SCHEMA = "layer_bench/1"
# The layer-shape fields a workload's flavor is compared on with the benchmark case's: where
# they differ its parts scale by work (`part_work`) and the notes say so.
SHAPE_FIELDS = ("dim", "inter_dim", "moe_inter_dim", "n_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "vocab_size")
# part -> step-model term
PARTS = {
    "rmsnorm": "memory-bound",
    "residual_add": "memory-bound",
    "router": "memory-bound",
    "embedding": "memory-bound",
    "attention.projections": "gemm",
    "attention.core": "attention",
    "shared_expert": "gemm",
    "dense_ffn": "gemm",
    "experts": "gemm",
    "output_loss": "gemm",
}
TERMS = ("gemm", "attention", "memory-bound")
LINEAR_GEMMS = ("attention.projections", "shared_expert", "dense_ffn")
OUTSIDE_BLOCKS = ("embedding", "output_loss")
LAUNCH_BOUND = ("router",)
BLOCK_CAUSAL = ("flex", "varlen")  # the kernels TorchTitan runs block-causal masks with
DOC_SENSITIVITY = "docs512"  # the bench's fixed-length documents (experiments/layer_bench.py DOC_TOKENS)
FP8_EXPERTS = "moe_comm_fp8"  # the bench's part name of this project's FP8 experts (FP8 wgrad)
# Steps of the FP8 experts' breakdown (experiments/layer_bench.py FP8_STEP_KINDS) bound by HBM
# rather than by the tensor cores: their quantisation.
FP8_MEMORY_KINDS = ("quantise", "wgrad_operands")
MXFP8_ASSUMPTION = Assumption(
    "B200 runs MXFP8 grouped GEMMs (torchao) as the FP8 experts measured on one H200 run (experts.moe_comm_fp8: "
    "e4m3 GEMMs and their quantisation steps): GEMM steps at the 8-bit dense peak ratio, quantisation steps at "
    "the HBM ratio, plus the rows' own quantisation (read bf16, write e4m3) at the measured copy rate", 4500.0,
    "TFLOPS",
    "NVIDIA HGX B200 datasheet (FP8/FP6 tensor core: one rate, 9 PFLOPS with sparsity, 4.5 dense); MX block "
    "scales are applied in Blackwell's 5th-generation tensor cores (NVIDIA Blackwell architecture technical "
    "brief); no B200 was measured here. Where experts.moe_comm_fp8 was not measured: the bf16 grouped GEMM x "
    "the measured bf16 / fp8 dense GEMM ceiling ratio at the 8-bit peak ratio. Not the H200's compiled float8 "
    "rowwise grouped GEMM (layer bench experts.fp8.compiled.*): its per-row scales are applied outside the "
    "tensor cores and each row is quantised again")
FP8_GROUPED_NOTE = ("float8 grouped GEMM: the compiled kernel (as the float8 recipes run it) not measured; bf16 time x "
                    "the measured bf16 / fp8 rowwise GEMM ceiling ratio")
FP8_EXPERTS_NOTE = ("FP8 experts (experts.moe_comm_fp8) not measured at case {case!r}: bf16 time x the measured bf16 / "
                    "fp8 rowwise GEMM ceiling ratio")
FLEX_NOTE = "attention kernel: {impl} not measured at case {case!r}: SDPA's time stands in, at the same shape"
DOCS_NOTE = ("attention kernel: {impl} at {dist} not measured at case {case!r}: {used} scaled by kept pairs x heads")
LOSS_COMPILED = "output_loss.loss_compiled"  # the bench's output + loss with TorchTitan's compiled loss
LOSS_COMPILED_NOTE = ("loss: compiled ([compile] components \"loss\") but output_loss.loss_compiled not measured at "
                      "case {case!r}: the eager loss's time stands in")


@dataclass(frozen=True)
class Peaks:
    gpu: str
    bf16_tflops: float
    fp8_tflops: float  # float8 and MXFP8 share the 8-bit tensor-core rate (MXFP8_ASSUMPTION)
    hbm_tbs: float


def peaks(gpu: str) -> Peaks:
    """Datasheet peaks of a GPU by model name (H100, H200, B200, or a device name): moe_comm.gpus'
    first GPU that `gpu` names and whose HBM rate is known."""
    known = gpus.lookup(gpu, "hbm_tbs")
    if known is None or known.fp8_tflops is None:
        raise ValueError(f"GPU {gpu!r}: no datasheet peaks for the layer model; use one of H100, H200, B200")
    return Peaks(known.model, known.bf16_tflops, known.fp8_tflops, known.hbm_tbs)


@dataclass(frozen=True)
class LayerBench:
    """The measured parts of the layer benchmark (BENCH), by (case, part name)."""

    path: Path
    device: str
    cases: dict
    parts: dict
    ceilings: dict
    # rank_ms's answers: a plan prices one layout's compute for every backend and overlap
    memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def part(self, case: str, name: str) -> dict | None:
        p = self.parts.get((case, name))
        return p if p and p.get("status") == "ok" else None


def load(path: Path | None = None) -> LayerBench:
    path = Path(path or BENCH)
    doc = json.loads(path.read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a layer_bench JSON (schema {doc.get('schema')!r}, expected {SCHEMA!r})")
    if doc["settings"].get("tiny"):
        raise ValueError(f"{path}: a --tiny smoke run, not the 671B shapes; run experiments/layer_bench.py on a GPU")
    return LayerBench(path, doc["machine"]["device"], doc["cases"],
                      {(p["case"], p["name"]): p for p in doc["parts"]}, doc["peaks"]["measured"])


@dataclass
class RankCompute:
    """One microbatch's compute on one pipeline rank, ms: per step-model term its forward f, input
    gradient bi (with the AC recompute) and weight gradient bw - a GEMM part's backward splits
    evenly into the two (dgrad and wgrad have the same flops), the attention kernel's and the
    memory-bound parts' is all bi - the recompute alone, each part's total, and one MoE layer's
    parts as the overlaps hide communication behind them (`moe_layer`: per part, (forward,
    backward, recompute) of one layer)."""

    terms: dict = field(default_factory=lambda: {t: [0.0, 0.0, 0.0] for t in TERMS})
    recompute: dict = field(default_factory=lambda: dict.fromkeys(TERMS, 0.0))
    parts: dict = field(default_factory=dict)
    moe_layer: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(sum(v) for v in self.terms.values())

    @property
    def moe_layer_fwd(self) -> dict:
        """Forward ms of one MoE layer's shared and routed experts."""
        return {p: self.moe_layer[p][0] for p in ("shared_expert", "experts") if p in self.moe_layer}

    def seconds(self) -> dict:
        return {t: tuple(x / 1e3 for x in v) for t, v in self.terms.items()}


def part_ms(p: dict, phase: str) -> float:
    """A part's ms in `phase`: the median call, or for a part timed over whole optimizer steps of
    several microbatches (the FP8 experts with their WeightCache) the mean, which carries each
    step's one quantisation of the weights."""
    if phase not in ("fwd", "bwd"):
        return p["ms"][phase]
    stat = "mean" if p.get("shape", {}).get("microbatches_per_step", 1) > 1 else "median"
    return p["ms"][phase][stat]


def _flavor_case_args(case: dict):
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    from moe_comm.layout import flavors

    flavors.register()
    return deepseekv3_args[case["flavor"]]


def _causal_pairs(seq_len: int) -> float:
    return seq_len * (seq_len + 1) / 2


@lru_cache(maxsize=32)
def kept_pairs_per_sequence(dist: documents.DocumentLengths | None, seq_len: int) -> float:
    """(query, key) pairs the attention mask keeps in one sequence: block-causal over the
    documents of `dist` packed as TorchTitan packs them, or causal over one document (None)."""
    if dist is None:
        return _causal_pairs(seq_len)
    return documents.pairs_per_sequence(dist, seq_len)


def fp8_gemm_gain(bench: LayerBench) -> float:
    """The measured bf16 / fp8 rowwise GEMM ceiling ratio (torch.mm vs torch._scaled_mm, same run)."""
    bf16, fp8 = (bench.ceilings.get(k, {}).get("tflops") for k in ("bf16_gemm", "fp8_rowwise_gemm"))
    if not (bf16 and fp8):
        raise ValueError(f"layer bench {bench.path}: no bf16 and fp8 rowwise GEMM ceilings (peaks.measured) to price "
                         "float8 GEMMs; run experiments/layer_bench.py on a GPU with fp8 (SM89+)")
    return bf16 / fp8


def part_work(a, part: str, sequences: int, seq_len: int, tp: int, rows: float, pairs: float | None = None) -> float:
    """A part's work on one rank for one microbatch of `sequences` x `seq_len` tokens at TP `tp`,
    in the unit its time scales with (only ratios of it are used): flops for the GEMM parts and
    the attention kernel (`pairs`: the (query, key) pairs its mask keeps per sequence, causal over
    one document when None), tokens x dim for the memory-bound parts; `rows` are the routed rows
    the rank's experts receive. As experiments/layer_bench.py shapes them: the norms and residuals
    see the sequence-parallel share of the tokens, the router, attention, FFNs, embedding and
    output every token, with heads and hidden sizes split over TP."""
    tokens = sequences * seq_len
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    heads = a.n_heads / tp
    m = a.moe_args
    if part in ("rmsnorm", "residual_add"):
        return tokens / tp * a.dim
    if part in ("embedding", "router"):
        return tokens * a.dim
    if part == "attention.projections":
        q = a.dim * a.q_lora_rank + a.q_lora_rank * heads * qk if a.q_lora_rank else a.dim * heads * qk
        kv = a.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim)
        return tokens * (q + kv + heads * a.v_head_dim * a.dim)
    if part == "attention.core":
        return sequences * (_causal_pairs(seq_len) if pairs is None else pairs) * heads * (qk + a.v_head_dim)
    if part == "shared_expert":
        return tokens * a.dim * a.moe_inter_dim * m.num_shared_experts / tp
    if part == "dense_ffn":
        return tokens * a.dim * a.inter_dim / tp
    if part == "experts":
        return rows * a.dim * a.moe_inter_dim
    if part == "output_loss":
        return tokens * a.dim * a.vocab_size / tp
    raise KeyError(part)


def _measured_core_work(p: dict, ref, case: dict) -> float:
    """An attention kernel part's own work in part_work's unit: its forward flop count / 2
    (2 x heads x kept pairs x head dims, experiments/layer_bench.py), which names the documents it
    ran; one causal document per sequence where the part has no count."""
    flops = (p.get("flops") or {}).get("fwd")
    if flops:
        return flops / 2
    return part_work(ref, "attention.core", case["sequences"], case["seq_len"], case["tp"], 0.0)


def _choose_case(bench: LayerBench, args, tp: int, seq_len: int) -> tuple[str, list[str]]:
    """The case of the workload's TP degree (else the nearest), the closest in sequence length,
    and what differs from it (the notes)."""
    name = min(bench.cases, key=lambda n: (abs(bench.cases[n]["tp"] - tp), abs(bench.cases[n]["seq_len"] - seq_len)))
    case, notes = bench.cases[name], []
    if case["tp"] != tp:
        notes.append(f"TP {tp} not measured: case {name!r} (TP {case['tp']}) scaled by work")
    ref = _flavor_case_args(case)
    differ = [f for f in SHAPE_FIELDS if getattr(ref, f) != getattr(args, f)]
    if differ or ref.moe_args.top_k != args.moe_args.top_k:
        notes.append(f"layer shapes differ from {case['flavor']}'s ({', '.join(differ or ['top_k'])}): its parts "
                     "scaled by work, at their measured efficiency")
    return name, notes


def attention_impl(a) -> str:
    """The attention kernel a flavor runs: FlexAttention or variable-length attention where it
    names one, SDPA otherwise."""
    return a.attn_type if a.attn_type in BLOCK_CAUSAL else "sdpa"


def documents_for(a, dist: documents.DocumentLengths | None) -> documents.DocumentLengths | None:
    """The documents the flavor's mask cuts at: the dataset's where the mask is block-causal,
    none (one document per sequence) where it is causal."""
    return dist if getattr(a, "attn_mask_type", "causal") == "block_causal" else None


def rank_ms(bench: LayerBench, w, gpu: str, layers, embedding: bool, output: bool, *, peak_share: float = 1.0,
            imbalance: float | None = None) -> RankCompute:
    """Compute of one microbatch on the pipeline rank holding `layers` (and the embedding or the
    output projection + loss) of workload `w` (moe_comm.predict.scale_model.Workload: args, layout,
    seq_len, microbatch / local_batch, ac_mode, converters, routing, documents, expert_dtype,
    ranks_per_node, loss_compiled) on `gpu`. `peak_share` scales every part priced on another GPU than the
    bench's (its share of peak over the measured one's); `imbalance` is the busiest rank's routed
    rows over the mean rank's (None: the drawn routing's own busiest rank). Computed once per bench
    and question (a plan asks the same for every backend and overlap): the answer is shared, so
    callers read it and never change it."""
    # the memo holds w.args and w.documents, so the ids in the key cannot be reused by other objects
    key = (id(w.args), id(w.documents), tuple(vars(w.layout).values()), w.seq_len, w.microbatch, w.local_batch,
           w.ac_mode, tuple(w.converters), w.routing, w.expert_dtype, w.ranks_per_node, w.loss_compiled, gpu,
           tuple(layers), embedding, output, peak_share, imbalance)
    if key not in bench.memo:
        bench.memo[key] = ((w.args, w.documents),
                           _rank_ms(bench, w, gpu, layers, embedding, output, peak_share=peak_share, imbalance=imbalance))
    return bench.memo[key][1]


def _rank_ms(bench: LayerBench, w, gpu: str, layers, embedding: bool, output: bool, *, peak_share: float,
             imbalance: float | None) -> RankCompute:
    a, lay = w.args, w.layout
    if lay.cp > 1:
        raise NotCovered("context parallel: the layer benchmark has no CP case (FlexAttention has no CP in TorchTitan)")
    out = RankCompute()
    name, out.notes = _choose_case(bench, a, lay.tp, w.seq_len)
    case = bench.cases[name]
    ref = _flavor_case_args(case)
    here, there = peaks(bench.device), peaks(gpu)
    other_gpu = here.gpu != there.gpu
    sequences = w.microbatch if lay.pp > 1 else w.local_batch
    tokens = sequences * w.seq_len
    m = a.moe_args
    st = routing_statistics(w.routing, lay.ep, w.ranks_per_node, m.num_experts, m.top_k,
                            m.num_expert_groups or 8, m.num_limited_groups or 4)
    routing = "balanced" if w.routing == "balanced" else "node_limited"
    per_token_rows = st.max["expert_rows"] if imbalance is None else st.mean["expert_rows"] * imbalance
    rows = per_token_rows * tokens / lay.tp
    case_rows = case["received_rows"][routing]["rows"]
    converters = tuple(w.converters)
    mx = "quantize.grouped_mm.mx" in converters
    float8 = "quantize.grouped_mm.float8" in converters
    ours_fp8 = getattr(w, "expert_dtype", "bf16") == "fp8"
    # ours keeps its e4m3 weights over the step; torchao's MXFP8 quantises them at every call
    cached_fp8 = ours_fp8 and fp8_experts.caches_weights(w.microbatches, w.ac_mode, w.layout.experts_sharded)
    if mx and there.gpu != "B200":
        raise ValueError(f"MXFP8 grouped GEMMs (quantize.grouped_mm.mx) need a B200 (SM100), not {there.gpu}")
    linear_fp8 = "quantize.linear.float8" in converters
    fp8_gain = fp8_gemm_gain(bench) if mx or float8 or ours_fp8 or linear_fp8 else 1.0
    impl = attention_impl(a)
    dist = documents_for(a, getattr(w, "documents", None))

    def note(text: str) -> None:
        if text not in out.notes:
            out.notes.append(text)

    def core_part(case_name: str) -> dict | None:
        """The attention kernel the flavor runs, measured at the workload's documents where the
        bench ran them (else the nearest it ran), at `case_name`."""
        tried = ([f"attention.core.{impl}.{dist.name}", f"attention.core.{impl}.{DOC_SENSITIVITY}"] if dist else [])
        for part_name in tried + [f"attention.core.{impl}"]:
            p = bench.part(case_name, part_name)
            if p:
                if dist and part_name != tried[0]:
                    note(DOCS_NOTE.format(impl=impl, dist=dist.name, case=case_name, used=part_name))
                return p
        return None

    def measured(part: str) -> tuple[dict | None, str, float | None]:
        """The measured part, the case it was measured at, and its own work where that is not
        part_work's at the case's shape (the attention kernel: its documents)."""
        if part == "attention.core":
            for case_name in [name] + [c for c in bench.cases if c != name]:  # another case by the rule
                p = core_part(case_name)
                if p:
                    if case_name != name:
                        note(f"attention kernel: not measured at case {name!r}: case {case_name!r}'s, scaled by "
                             "kept pairs x heads")
                    c = bench.cases[case_name]
                    return p, case_name, _measured_core_work(p, _flavor_case_args(c), c)
            p = bench.part(name, "attention.core.sdpa")
            if p and impl != "sdpa":
                note(FLEX_NOTE.format(impl=impl, case=name))
            return p, name, p and _measured_core_work(p, ref, case)
        if part == "attention.projections":  # the module less its kernel (one document), same implementation
            for case_name in [name] + [c for c in bench.cases if c != name]:  # another case, scaled by work
                mod = bench.part(case_name, f"attention.module.{impl}") or bench.part(case_name, "attention.module.sdpa")
                core = mod and bench.part(case_name, mod["name"].replace("module", "core"))
                if mod and core:
                    if case_name != name:
                        note(f"attention projections: not measured at case {name!r}: case {case_name!r}'s, scaled by "
                             "work")
                    fwd, bwd = (part_ms(mod, k) - part_ms(core, k) for k in ("fwd", "bwd"))
                    return {"name": part, "ms": {"fwd": {"median": fwd}, "bwd": {"median": bwd},
                                                 "recompute": part_ms(mod, "recompute") - part_ms(core, "recompute")}}, \
                        case_name, None
            return None, name, None
        if part == "experts":
            if mx or ours_fp8:
                # where the run caches its e4m3 weights (moe_comm.fp8_experts.caches_weights), they
                # are quantised once per step, outside the experts' calls: the part timed that way
                p = (cached_fp8 and bench.part(name, f"experts.{FP8_EXPERTS}_cached.{routing}")) \
                    or bench.part(name, f"experts.{FP8_EXPERTS}.{routing}")
                if p:
                    return p, name, None
                note(FP8_EXPERTS_NOTE.format(case=name))
                return bench.part(name, f"experts.bf16.{routing}"), name, None
            if float8:
                compiled = bench.part(name, f"experts.fp8.compiled.{routing}")
                if compiled:
                    return compiled, name, None
                note(FP8_GROUPED_NOTE)
            return bench.part(name, f"experts.bf16.{routing}"), name, None
        if part == "output_loss" and w.loss_compiled:
            p = bench.part(name, LOSS_COMPILED)
            if p:
                return p, name, None
            note(LOSS_COMPILED_NOTE.format(case=name))
        return bench.part(name, part), name, None

    n = len(layers)
    n_moe = sum(1 for i in layers if i >= a.n_dense_layers)
    count = {"rmsnorm": 2 * n, "residual_add": 2 * n, "attention.projections": n, "attention.core": n,
             "router": n_moe, "shared_expert": n_moe, "experts": n_moe, "dense_ffn": n - n_moe,
             "embedding": int(embedding), "output_loss": int(output)}
    for part, term in PARTS.items():
        if not count[part] and part not in ("shared_expert", "experts"):
            continue
        p, at, p_work = measured(part)
        if p is None:
            raise ValueError(f"layer bench {bench.path}: {part} not measured at case {name!r}; run "
                             "experiments/layer_bench.py run --resume on the GPU")
        at_case = bench.cases[at]
        at_ref = _flavor_case_args(at_case)
        fwd, bwd, rec = (part_ms(p, k) for k in ("fwd", "bwd", "recompute"))
        if part in OUTSIDE_BLOCKS or w.ac_mode == "none":
            rec = 0.0
        elif w.ac_mode == "selective":
            rec = 0.5 * fwd if part in LINEAR_GEMMS else (0.0 if part == "attention.core" else fwd)
        else:
            rec = max(rec, 0.0)
        if part in LAUNCH_BOUND:  # its launches, not its bytes: the time as measured, longer only beyond its tokens
            scale = max(1.0, tokens / (at_case["sequences"] * at_case["seq_len"]))
            fwd, bwd, rec = fwd * scale, bwd * scale, rec * scale
        else:
            pairs = kept_pairs_per_sequence(dist, w.seq_len) if part == "attention.core" else None
            work = part_work(a, part, sequences, w.seq_len, lay.tp, rows, pairs)
            ref_work = p_work or part_work(at_ref, part, at_case["sequences"], at_case["seq_len"], at_case["tp"],
                                           case_rows)
            scale = work / ref_work
            if part == "experts" and (mx or ours_fp8):
                fwd, bwd, rec = _fp8_experts_ms(p, (fwd, bwd, rec), scale, here, there, mx, fp8_gain,
                                                bench, rows, a.dim)
                scale = 1.0
            elif term == "memory-bound":
                scale *= here.hbm_tbs / there.hbm_tbs
            elif part == "experts" and float8:
                scale *= (fp8_gain if p["name"].startswith("experts.bf16") else 1.0) * here.fp8_tflops / there.fp8_tflops
            elif part in LINEAR_GEMMS and linear_fp8:  # the converter leaves the output projection bf16
                scale *= fp8_gain * here.fp8_tflops / there.fp8_tflops
            else:
                scale *= here.bf16_tflops / there.bf16_tflops
            if other_gpu:
                scale /= peak_share
            fwd, bwd, rec = fwd * scale, bwd * scale, rec * scale
        if part in ("shared_expert", "experts", "router", "attention.core", "attention.projections", "rmsnorm",
                    "residual_add"):
            out.moe_layer[part] = (fwd, bwd, rec)
        k = count[part]
        split = (fwd, bwd / 2 + rec, bwd / 2) if term == "gemm" else (fwd, bwd + rec, 0.0)
        for i, x in enumerate(split):
            out.terms[term][i] += k * x
        out.recompute[term] += k * rec
        out.parts[part] = k * (fwd + bwd + rec)
    if mx:
        note(MXFP8_ASSUMPTION.name)
    return out


def _fp8_experts_ms(p: dict, times: tuple, work_scale: float, here: Peaks, there: Peaks, mx: bool, fp8_gain: float,
                    bench: LayerBench, rows: float, dim: int) -> tuple:
    """The FP8 experts' (fwd, bwd, recompute) on `there`: this project's measured FP8 experts part
    (its GEMM steps at the 8-bit peak ratio, its quantisation steps at the HBM ratio, by the
    breakdown's shares), or the bf16 part at the measured ceiling ratio where it was not measured;
    for MXFP8 (B200) plus the rows' quantisation at the measured copy rate (MXFP8_ASSUMPTION)."""
    if p["name"].startswith("experts.bf16"):
        k = work_scale * fp8_gain * here.fp8_tflops / there.fp8_tflops
        return tuple(t * k for t in times)
    kinds = (p.get("breakdown") or {}).get("kinds_ms") or {}
    total = sum(kinds.values())
    memory = sum(kinds.get(k, 0.0) for k in FP8_MEMORY_KINDS) / total if total else 0.0
    k = work_scale * ((1 - memory) * here.fp8_tflops / there.fp8_tflops + memory * here.hbm_tbs / there.hbm_tbs)
    fwd, bwd, rec = (t * k for t in times)
    if mx:  # the sender quantises the rows in ours (not in the part); MXFP8 quantises them in the forward
        copy_tbs = bench.ceilings.get("copy", {}).get("tbs") or here.hbm_tbs
        quantise = rows * dim * 3 / (copy_tbs * there.hbm_tbs / here.hbm_tbs * 1e12) * 1e3
        fwd, rec = fwd + quantise, rec + (quantise if rec else 0.0)
    return fwd, bwd, rec


def assumptions(bench: LayerBench) -> list[Assumption]:
    """The rules above as listed assumptions, with the file their figures come from."""
    rel = bench.path.relative_to(REPO) if bench.path.is_relative_to(REPO) else bench.path
    here = peaks(bench.device)
    # the parts pricing looks for that the file lacks or did not run (their stand-ins are the rules below)
    wanted = ([f"attention.{k}.flex" for k in ("module", "core")] + ["attention.core.flex.c4_en"]
              + [f"experts.fp8.compiled.{r}" for r in ("balanced", "node_limited")]
              + [f"experts.{FP8_EXPERTS}.{r}" for r in ("balanced", "node_limited")] + [LOSS_COMPILED])
    missing = sorted({f"{n} ({c})" for c in bench.cases for n in wanted if not bench.part(c, n)})
    return [
        Assumption("compute per microbatch: TorchTitan's layer parts measured at the layout's per-rank shape",
                   len([p for p in bench.parts.values() if p.get("status") == "ok"]), "parts",
                   f"{rel} (experiments/layer_bench.py on one {bench.device}); not run: "
                   f"{', '.join(missing) if missing else 'none'}"),
        Assumption("another GPU reaches the measured share of its own datasheet peak (bf16 / 8-bit TFLOPS for "
                   "GEMMs and attention, HBM TB/s for memory-bound parts), times peak_share", 1.0, "",
                   f"assumption: {here.gpu} times scaled by datasheet ratios (moe_comm/gpus.py); no B200 was "
                   "measured here"),
        Assumption("another flavor's or TP degree's parts: the measured part's time x the ratio of their work "
                   "(flops, or tokens x dim for memory-bound parts)", 1.0, "",
                   "assumption: the part runs at the measured part's efficiency (moe_comm.predict.layer_compute."
                   "part_work)"),
        Assumption("block-causal attention: the kernel the flavor runs, measured at the dataset's documents (else "
                   "512-token ones), x the ratio of kept (query, key) pairs x heads", 1.0, "",
                   f"{rel} attention.core.{{flex,varlen}}.{{c4_en,nltk_en,docs512}}; the pairs from "
                   "moe_comm.predict.documents (TorchTitan's packing of the recipe's dataset's lengths)"),
        Assumption("the router: launch-bound, its measured time on any GPU up to the measured tokens", 1.0, "",
                   f"{rel} router at 4096 and 8192 tokens: about the same time (moe_comm.predict.layer_compute)"),
        MXFP8_ASSUMPTION,
        Assumption("float8 rowwise linear GEMMs"
                   + (", and the float8 grouped GEMM (its compiled part not measured)" if any(
                       m.startswith("experts.fp8.compiled") for m in missing) else "")
                   + ": bf16 time x measured bf16 / fp8 rowwise GEMM ceilings", fp8_gemm_gain(bench), "x",
                   f"{rel} peaks.measured (torch.mm and torch._scaled_mm, 8192^3, same run); the eager float8 "
                   "grouped GEMM there (unfused quantisation, slower than bf16) is not what the compiled recipes run"),
    ] + ([
        Assumption("FlexAttention's kernel, where not measured: SDPA's time at the same shape", 1.0, "",
                   f"assumption: {rel} attention.*.flex not run at "
                   + ", ".join(m for m in missing if "flex" in m and "c4_en" not in m)),
    ] if any("flex" in m and "c4_en" not in m for m in missing) else []) + ([
        Assumption("a loss compiled by TorchTitan ([compile] components \"loss\"), where not measured: the eager "
                   "loss's time (output_loss)", 1.0, "",
                   f"assumption: {rel} has not run "
                   + ", ".join(m for m in missing if m.startswith(LOSS_COMPILED))),
    ] if any(m.startswith(LOSS_COMPILED) for m in missing) else []) + [
        Assumption("selective AC re-runs the grouped GEMMs, the memory-bound ops and every second linear mm", 0.5,
                   "of linear forward", "TorchTitan 0.2.2 op SAC policy (distributed/activation_checkpoint.py; "
                   "deepseek_v3 _op_sac_save_list has no grouped mm)"),
    ]
