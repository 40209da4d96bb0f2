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
    the attention kernel ((query, key) pairs the causal mask keeps x heads x head dims; the
    routed experts' grouped GEMM by the rows the slowest rank receives, from
    moe_comm.predict.routing_plan at the workload's EP and routing), tokens x dim for the
    memory-bound ones. At the benchmark's own layer shapes that is tokens, pairs and rows; for
    another flavor (16B, ...) it assumes the part runs at the measured part's efficiency;
  * GPU: a time measured on one GPU scales to another by the ratio of their datasheet peaks
    of the resource the part is bound by - dense bf16 (or 8-bit) TFLOPS for GEMMs and the
    attention kernel, HBM TB/s for memory-bound parts - that is, the other GPU is assumed to
    reach the same share of its peak;
  * float8 and MXFP8 GEMMs: every recipe that converts them compiles the model (torchao's
    converters need it for speed). The float8 rowwise grouped GEMM is the benchmark's compiled
    one (as TorchTitan's apply_compile runs it); where that was not measured, the bf16 part's
    time x the measured bf16 / fp8 rowwise GEMM ceiling ratio (torch.mm against
    torch._scaled_mm, same run). The eager float8 grouped GEMM is measured (slower still: its
    quantisation is not fused) and never used. MXFP8 (B200 only) is a different kernel, block
    scales inside the tensor cores, that no H200 can run: it takes the ceiling-ratio rule at
    the B200's 8-bit rate (MXFP8_ASSUMPTION);
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
from pathlib import Path

from moe_comm import gpus
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
MXFP8_ASSUMPTION = Assumption(
    "B200 runs MXFP8 grouped GEMMs at its FP8 dense peak: the bf16 grouped GEMM's time x the measured bf16 / fp8 "
    "dense GEMM ceiling ratio, at the 8-bit peak ratio", 4500.0, "TFLOPS",
    "NVIDIA HGX B200 datasheet (FP8/FP6 tensor core: one rate, 9 PFLOPS with sparsity, 4.5 dense); MX block "
    "scales are applied in Blackwell's 5th-generation tensor cores (NVIDIA Blackwell architecture technical "
    "brief); no B200 was measured here. Not the H200's compiled float8 rowwise grouped GEMM (layer bench "
    "experts.fp8.compiled.*, slower than bf16 there): its per-row scales are applied outside the tensor cores")
FP8_GROUPED_NOTE = ("float8 grouped GEMM: the compiled kernel (as the float8 recipes run it) not measured; bf16 time x "
                    "the measured bf16 / fp8 rowwise GEMM ceiling ratio")
FLEX_NOTE = "attention kernel: {impl} not measured at case {case!r}: SDPA's time stands in, at the same shape"


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
    shared-expert and routed-expert forward (the compute overlapped communication hides behind)."""

    terms: dict = field(default_factory=lambda: {t: [0.0, 0.0, 0.0] for t in TERMS})
    recompute: dict = field(default_factory=lambda: dict.fromkeys(TERMS, 0.0))
    parts: dict = field(default_factory=dict)
    moe_layer_fwd: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(sum(v) for v in self.terms.values())

    def seconds(self) -> dict:
        return {t: tuple(x / 1e3 for x in v) for t, v in self.terms.items()}


def _ms(p: dict, phase: str) -> float:
    return p["ms"][phase]["median"] if phase in ("fwd", "bwd") else p["ms"][phase]


def _flavor_case_args(case: dict):
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    from moe_comm.layout import flavors

    flavors.register()
    return deepseekv3_args[case["flavor"]]


def _causal_pairs(seq_len: int) -> float:
    return seq_len * (seq_len + 1) / 2


def fp8_gemm_gain(bench: LayerBench) -> float:
    """The measured bf16 / fp8 rowwise GEMM ceiling ratio (torch.mm vs torch._scaled_mm, same run)."""
    bf16, fp8 = (bench.ceilings.get(k, {}).get("tflops") for k in ("bf16_gemm", "fp8_rowwise_gemm"))
    if not (bf16 and fp8):
        raise ValueError(f"layer bench {bench.path}: no bf16 and fp8 rowwise GEMM ceilings (peaks.measured) to price "
                         "float8 GEMMs; run experiments/layer_bench.py on a GPU with fp8 (SM89+)")
    return bf16 / fp8


def part_work(a, part: str, sequences: int, seq_len: int, tp: int, rows: float) -> float:
    """A part's work on one rank for one microbatch of `sequences` x `seq_len` tokens at TP `tp`,
    in the unit its time scales with (only ratios of it are used): flops for the GEMM parts and
    the attention kernel, tokens x dim for the memory-bound parts; `rows` are the routed rows the
    rank's experts receive. As experiments/layer_bench.py shapes them: the norms and residuals
    see the sequence-parallel share of the tokens, the router, attention, FFNs, embedding and
    output every token, with heads and hidden sizes split over TP."""
    tokens = sequences * seq_len
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    heads = a.n_heads / tp
    m = a.moe_args
    if part in ("rmsnorm", "residual_add"):
        return tokens / tp * a.dim
    if part in ("embedding", "router"):  # the router's kernels are launch-bound at these sizes: tokens, not experts
        return tokens * a.dim
    if part == "attention.projections":
        q = a.dim * a.q_lora_rank + a.q_lora_rank * heads * qk if a.q_lora_rank else a.dim * heads * qk
        kv = a.dim * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim)
        return tokens * (q + kv + heads * a.v_head_dim * a.dim)
    if part == "attention.core":
        return sequences * _causal_pairs(seq_len) * heads * (qk + a.v_head_dim)
    if part == "shared_expert":
        return tokens * a.dim * a.moe_inter_dim * m.num_shared_experts / tp
    if part == "dense_ffn":
        return tokens * a.dim * a.inter_dim / tp
    if part == "experts":
        return rows * a.dim * a.moe_inter_dim
    if part == "output_loss":
        return tokens * a.dim * a.vocab_size / tp
    raise KeyError(part)


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


def rank_ms(bench: LayerBench, w, gpu: str, layers, embedding: bool, output: bool) -> RankCompute:
    """Compute of one microbatch on the pipeline rank holding `layers` (and the embedding or the
    output projection + loss) of workload `w` (moe_comm.predict.scale_model.Workload: args, layout,
    seq_len, microbatch / local_batch, ac_mode, converters, routing, ranks_per_node) on `gpu`.
    Computed once per bench and question (a plan asks the same for every backend and overlap):
    the answer is shared, so callers read it and never change it."""
    # the memo holds w.args, so the id in the key cannot be reused by another flavor's args
    key = (id(w.args), tuple(vars(w.layout).values()), w.seq_len, w.microbatch, w.local_batch, w.ac_mode, tuple(w.converters),
           w.routing, w.ranks_per_node, gpu, tuple(layers), embedding, output)
    if key not in bench.memo:
        bench.memo[key] = (w.args, _rank_ms(bench, w, gpu, layers, embedding, output))
    return bench.memo[key][1]


def _rank_ms(bench: LayerBench, w, gpu: str, layers, embedding: bool, output: bool) -> RankCompute:
    a, lay = w.args, w.layout
    if lay.cp > 1:
        raise NotCovered("context parallel: the layer benchmark has no CP case (FlexAttention has no CP in TorchTitan)")
    out = RankCompute()
    name, out.notes = _choose_case(bench, a, lay.tp, w.seq_len)
    case = bench.cases[name]
    ref = _flavor_case_args(case)
    here, there = peaks(bench.device), peaks(gpu)
    sequences = w.microbatch if lay.pp > 1 else w.local_batch
    m = a.moe_args
    st = routing_statistics(w.routing, lay.ep, w.ranks_per_node, m.num_experts, m.top_k,
                            m.num_expert_groups or 8, m.num_limited_groups or 4)
    routing = "balanced" if w.routing == "balanced" else "node_limited"
    rows = st.max["expert_rows"] * sequences * w.seq_len / lay.tp
    case_rows = case["received_rows"][routing]["rows"]
    converters = tuple(w.converters)
    mx = "quantize.grouped_mm.mx" in converters
    expert_dtype = "fp8" if mx or "quantize.grouped_mm.float8" in converters else "bf16"
    if mx and there.gpu != "B200":
        raise ValueError(f"MXFP8 grouped GEMMs (quantize.grouped_mm.mx) need a B200 (SM100), not {there.gpu}")
    linear_fp8 = "quantize.linear.float8" in converters
    fp8_gain = fp8_gemm_gain(bench) if expert_dtype == "fp8" or linear_fp8 else 1.0
    impl = a.attn_type if a.attn_type in ("flex", "varlen") else "sdpa"

    def note(text: str) -> None:
        if text not in out.notes:
            out.notes.append(text)

    def measured(part: str) -> tuple[dict | None, float]:
        """The measured part and the factor its times take for the workload's dtype."""
        if part == "attention.core":
            p = bench.part(name, f"attention.core.{impl}") or bench.part(name, "attention.core.sdpa")
            if p and not p["name"].endswith(impl):
                note(FLEX_NOTE.format(impl=impl, case=name))
            return p, 1.0
        if part == "attention.projections":  # the module less its kernel, same implementation
            mod = bench.part(name, f"attention.module.{impl}") or bench.part(name, "attention.module.sdpa")
            core = mod and bench.part(name, mod["name"].replace("module", "core"))
            if not (mod and core):
                return None, 1.0
            fwd, bwd = (_ms(mod, k) - _ms(core, k) for k in ("fwd", "bwd"))
            return {"name": part, "ms": {"fwd": {"median": fwd}, "bwd": {"median": bwd},
                                         "recompute": _ms(mod, "recompute") - _ms(core, "recompute")}}, 1.0
        if part == "experts":
            if mx:  # not the H200's float8 rowwise kernel: MXFP8_ASSUMPTION
                return bench.part(name, f"experts.bf16.{routing}"), fp8_gain
            if expert_dtype == "fp8":
                compiled = bench.part(name, f"experts.fp8.compiled.{routing}")
                if compiled:
                    return compiled, 1.0
                note(FP8_GROUPED_NOTE)
                return bench.part(name, f"experts.bf16.{routing}"), fp8_gain
            return bench.part(name, f"experts.bf16.{routing}"), 1.0
        if part in LINEAR_GEMMS and linear_fp8:  # the converter leaves the output projection bf16
            return bench.part(name, part), fp8_gain
        return bench.part(name, part), 1.0

    n = len(layers)
    n_moe = sum(1 for i in layers if i >= a.n_dense_layers)
    count = {"rmsnorm": 2 * n, "residual_add": 2 * n, "attention.projections": n, "attention.core": n,
             "router": n_moe, "shared_expert": n_moe, "experts": n_moe, "dense_ffn": n - n_moe,
             "embedding": int(embedding), "output_loss": int(output)}
    for part, term in PARTS.items():
        if not count[part] and part not in ("shared_expert", "experts"):
            continue
        p, dtype_scale = measured(part)
        if p is None:
            raise ValueError(f"layer bench {bench.path}: {part} not measured at case {name!r}; run "
                             "experiments/layer_bench.py run --resume on the GPU")
        fwd, bwd, rec = (_ms(p, k) for k in ("fwd", "bwd", "recompute"))
        if part in OUTSIDE_BLOCKS or w.ac_mode == "none":
            rec = 0.0
        elif w.ac_mode == "selective":
            rec = 0.5 * fwd if part in LINEAR_GEMMS else (0.0 if part == "attention.core" else fwd)
        else:
            rec = max(rec, 0.0)
        scale = dtype_scale * (part_work(a, part, sequences, w.seq_len, lay.tp, rows)
                               / part_work(ref, part, case["sequences"], case["seq_len"], case["tp"], case_rows))
        if term == "memory-bound":
            scale *= here.hbm_tbs / there.hbm_tbs
        elif dtype_scale != 1.0 or (part == "experts" and expert_dtype == "fp8"):
            scale *= here.fp8_tflops / there.fp8_tflops
        else:
            scale *= here.bf16_tflops / there.bf16_tflops
        fwd, bwd, rec = fwd * scale, bwd * scale, rec * scale
        if part in ("shared_expert", "experts"):
            out.moe_layer_fwd[part] = fwd
        k = count[part]
        split = (fwd, bwd / 2 + rec, bwd / 2) if term == "gemm" else (fwd, bwd + rec, 0.0)
        for i, x in enumerate(split):
            out.terms[term][i] += k * x
        out.recompute[term] += k * rec
        out.parts[part] = k * (fwd + bwd + rec)
    if mx:
        note(MXFP8_ASSUMPTION.name)
    return out


def assumptions(bench: LayerBench) -> list[Assumption]:
    """The rules above as listed assumptions, with the file their figures come from."""
    rel = bench.path.relative_to(REPO) if bench.path.is_relative_to(REPO) else bench.path
    here = peaks(bench.device)
    # the parts pricing looks for that the file lacks or did not run (their stand-ins are the rules below)
    wanted = [f"attention.{k}.flex" for k in ("module", "core")] + [f"experts.fp8.compiled.{r}" for r in
                                                                    ("balanced", "node_limited")]
    missing = sorted({f"{n} ({c})" for c in bench.cases for n in wanted if not bench.part(c, n)})
    return [
        Assumption("compute per microbatch: TorchTitan's layer parts measured at the layout's per-rank shape",
                   len([p for p in bench.parts.values() if p.get("status") == "ok"]), "parts",
                   f"{rel} (experiments/layer_bench.py on one {bench.device}); not run: "
                   f"{', '.join(missing) if missing else 'none'}"),
        Assumption("another GPU reaches the measured share of its own datasheet peak (bf16 / 8-bit TFLOPS for "
                   "GEMMs and attention, HBM TB/s for memory-bound parts)", 1.0, "",
                   f"assumption: {here.gpu} times scaled by datasheet ratios (moe_comm/metrics/peaks.py, "
                   "moe_comm/predict/assumptions.py); no B200 was measured here"),
        Assumption("another flavor's or TP degree's parts: the measured part's time x the ratio of their work "
                   "(flops, or tokens x dim for memory-bound parts)", 1.0, "",
                   "assumption: the part runs at the measured part's efficiency (moe_comm.predict.layer_compute."
                   "part_work)"),
        MXFP8_ASSUMPTION,
        Assumption("float8 rowwise linear GEMMs, MXFP8 grouped GEMMs"
                   + (", and the float8 grouped GEMM (its compiled part not measured)" if any(
                       "compiled" in m for m in missing) else "")
                   + ": bf16 time x measured bf16 / fp8 rowwise GEMM ceilings", fp8_gemm_gain(bench), "x",
                   f"{rel} peaks.measured (torch.mm and torch._scaled_mm, 8192^3, same run); the eager float8 "
                   "grouped GEMM there (unfused quantisation, slower than bf16) is not what the compiled recipes run"),
    ] + ([
        Assumption("FlexAttention's kernel, where not measured: SDPA's time at the same shape", 1.0, "",
                   f"assumption: {rel} attention.*.flex not run at "
                   + ", ".join(m for m in missing if "flex" in m)),
    ] if any("flex" in m for m in missing) else []) + [
        Assumption("selective AC re-runs the grouped GEMMs, the memory-bound ops and every second linear mm", 0.5,
                   "of linear forward", "TorchTitan 0.2.2 op SAC policy (distributed/activation_checkpoint.py; "
                   "deepseek_v3 _op_sac_save_list has no grouped mm)"),
        Assumption("attention kernel priced at one document per sequence (causal)", 1.0, "",
                   f"{rel} attention.core.*; block-causal masks over real documents do less (the bench's docs "
                   "sensitivity part)"),
    ]
