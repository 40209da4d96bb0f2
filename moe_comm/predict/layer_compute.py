"""One rank's compute per microbatch, priced from the one-GPU layer benchmark
(experiments/layer_bench.py -> results/h200x1/layer_bench.json): each part of a DeepSeek-V3-671B
layer measured at the per-rank shape a layout runs, forward, backward and full-AC recompute.

How a measured part becomes a predicted time (each rule is listed in `assumptions`):
  * shape: a workload is priced from the measured case of the same TP degree (the flagship's
    TP 1 microbatch, the Nebius anchors' TP 2 one), the closest in sequence length; a part
    scales by its work - tokens for the linear parts (norms, residuals, router, attention
    projections, FFNs, embedding, output), (query, key) pairs kept by the causal mask for the
    attention kernel, and rows received by the slowest rank (moe_comm.predict.routing_plan,
    the workload's EP and routing) for the routed experts' grouped GEMM;
  * GPU: a time measured on one GPU scales to another by the ratio of their datasheet peaks
    of the resource the part is bound by - dense bf16 (or 8-bit) TFLOPS for GEMMs and the
    attention kernel, HBM TB/s for memory-bound parts - that is, the other GPU is assumed to
    reach the same share of its peak. Nothing is fitted to any end-to-end figure; the public
    anchors are never read here (their table is results/scale_model_validation.json, read
    only by moe_comm.predict.validation);
  * MXFP8 (B200 only, no H200 runs it): the routed experts' float8 rowwise time on the H200,
    scaled by the 8-bit peak ratio - B200 runs MXFP8 at its FP8 tensor-core rate;
  * float8 linears (quantize.linear.float8), which the benchmark does not time: the bf16 time
    of each linear GEMM part times the measured bf16 / fp8 rowwise GEMM ceiling ratio;
  * AC: "full" adds each block part's measured recompute (backward under checkpoint less
    backward); "selective" is TorchTitan's op-level SAC, which saves the attention kernel's
    output and every second mm (torchtitan/distributed/activation_checkpoint.py, and
    deepseek_v3's _op_sac_save_list, which has no grouped mm): it re-runs the grouped GEMMs
    and the memory-bound ops, and half the linear GEMMs' forward. The embedding and the output
    projection + loss sit outside the checkpointed blocks.
A pipeline rank is priced for the layers it holds (moe_comm.predict.estimate.pipeline_ranks),
with the embedding on the first stage and the output projection + loss on the last.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from moe_comm.metrics.peaks import table_peaks
from moe_comm.predict.assumptions import READ, REPO, Assumption
from moe_comm.predict.routing_plan import routing_statistics

BENCH = REPO / "results" / "h200x1" / "layer_bench.json"


class NotCovered(ValueError):
    """The benchmark has no case for this workload's layer shapes or TP degree (the step model
    then prices its compute from the fitted efficiencies, and says so)."""

SCHEMA = "layer_bench/1"
# The layer-shape fields a bench case must share with a workload's flavor for its parts to apply.
SHAPE_FIELDS = ("dim", "inter_dim", "moe_inter_dim", "n_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "vocab_size")
# part -> step-model term; "per" is the work a part's time scales with
PARTS = {
    "rmsnorm": ("memory-bound", "tokens"),
    "residual_add": ("memory-bound", "tokens"),
    "router": ("memory-bound", "tokens"),
    "embedding": ("memory-bound", "tokens"),
    "attention.projections": ("gemm", "tokens"),
    "attention.core": ("attention", "pairs"),
    "shared_expert": ("gemm", "tokens"),
    "dense_ffn": ("gemm", "tokens"),
    "experts": ("gemm", "rows"),
    "output_loss": ("gemm", "tokens"),
}
TERMS = ("gemm", "attention", "memory-bound")
LINEAR_GEMMS = ("attention.projections", "shared_expert", "dense_ffn")
OUTSIDE_BLOCKS = ("embedding", "output_loss")
MXFP8_ASSUMPTION = Assumption(
    "B200 runs MXFP8 grouped GEMMs at its FP8 dense peak, at the share of it that torchao's float8 "
    "rowwise grouped GEMM reaches of the H200's", 4500.0, "TFLOPS",
    "NVIDIA HGX B200 datasheet (FP8/FP6 tensor core: one rate, 9 PFLOPS with sparsity, 4.5 dense); MX block "
    "scales are applied in Blackwell's 5th-generation tensor cores (NVIDIA Blackwell architecture technical "
    "brief); no B200 was measured here")


@dataclass(frozen=True)
class Peaks:
    gpu: str
    bf16_tflops: float
    fp8_tflops: float  # float8 and MXFP8 share the 8-bit tensor-core rate (MXFP8_ASSUMPTION)
    hbm_tbs: float


def peaks(gpu: str) -> Peaks:
    """Datasheet peaks of a GPU by model name (H100, H200, B200, or a device name)."""
    name = next((g for g in ("B200", "H200", "H100") if g in gpu), None)
    dense = table_peaks(f"NVIDIA {name}") if name else None
    if dense is None or "fp8" not in dense or f"hbm_tbs.{name}" not in READ:
        raise ValueError(f"GPU {gpu!r}: no datasheet peaks for the layer model; use one of H100, H200, B200")
    return Peaks(name, dense["bf16"], dense["fp8"], READ[f"hbm_tbs.{name}"].value)


@dataclass(frozen=True)
class LayerBench:
    """The measured parts of results/h200x1/layer_bench.json, by (case, part name)."""

    path: Path
    device: str
    cases: dict
    parts: dict
    ceilings: dict

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

    from moe_comm.titan import flavors

    flavors.register()
    return deepseekv3_args[case["flavor"]]


def _causal_pairs(seq_len: int) -> float:
    return seq_len * (seq_len + 1) / 2


def _choose_case(bench: LayerBench, args, tp: int, seq_len: int) -> str:
    same_tp = [n for n, c in bench.cases.items() if c["tp"] == tp]
    if not same_tp:
        raise NotCovered(f"layer bench {bench.path}: no case at TP {tp} (measured: "
                         f"{sorted({c['tp'] for c in bench.cases.values()})}); add one to experiments/layer_bench.py")
    name = min(same_tp, key=lambda n: abs(bench.cases[n]["seq_len"] - seq_len))
    ref = _flavor_case_args(bench.cases[name])
    differ = [f for f in SHAPE_FIELDS if getattr(ref, f) != getattr(args, f)]
    if differ or ref.moe_args.top_k != args.moe_args.top_k:
        raise NotCovered(f"layer bench case {name!r} measured {bench.cases[name]['flavor']}'s layer shapes; this "
                         f"flavor differs in {differ or ['top_k']}: the benchmark does not price it")
    return name


def rank_ms(bench: LayerBench, w, gpu: str, layers, embedding: bool, output: bool) -> RankCompute:
    """Compute of one microbatch on the pipeline rank holding `layers` (and the embedding or the
    output projection + loss) of workload `w` (moe_comm.predict.scale_model.Workload: args, layout,
    seq_len, microbatch / local_batch, ac_mode, converters, routing, ranks_per_node) on `gpu`."""
    a, lay = w.args, w.layout
    if lay.cp > 1:
        raise NotCovered("context parallel: the layer benchmark has no CP case (FlexAttention has no CP in TorchTitan)")
    out = RankCompute()
    name = _choose_case(bench, a, lay.tp, w.seq_len)
    case = bench.cases[name]
    here, there = peaks(bench.device), peaks(gpu)
    sequences = w.microbatch if lay.pp > 1 else w.local_batch
    tokens_sp = sequences * w.seq_len // lay.tp
    m = a.moe_args
    st = routing_statistics(w.routing, lay.ep, w.ranks_per_node, m.num_experts, m.top_k,
                            m.num_expert_groups or 8, m.num_limited_groups or 4)
    routing = "balanced" if w.routing == "balanced" else "node_limited"
    work = {
        "tokens": sequences * w.seq_len / case["tokens"],
        "pairs": sequences * _causal_pairs(w.seq_len) / (case["sequences"] * _causal_pairs(case["seq_len"])),
        "rows": st.max["expert_rows"] * tokens_sp / case["received_rows"][routing]["rows"],
    }
    converters = tuple(w.converters)
    mx = "quantize.grouped_mm.mx" in converters
    expert_dtype = "fp8" if mx or "quantize.grouped_mm.float8" in converters else "bf16"
    if mx and there.gpu != "B200":
        raise ValueError(f"MXFP8 grouped GEMMs (quantize.grouped_mm.mx) need a B200 (SM100), not {there.gpu}")
    linear_fp8 = "quantize.linear.float8" in converters
    impl = "flex" if a.attn_type == "flex" else "sdpa"

    def measured(part: str) -> dict:
        if part == "attention.core":
            p = bench.part(name, f"attention.core.{impl}") or bench.part(name, "attention.core.sdpa")
            if p and not p["name"].endswith(impl):
                out.notes.append(f"attention kernel: {impl} not measured at {name}, SDPA's time stands in")
            return p
        if part == "attention.projections":  # the module less its kernel, same implementation
            mod = bench.part(name, f"attention.module.{impl}") or bench.part(name, "attention.module.sdpa")
            core = mod and bench.part(name, mod["name"].replace("module", "core"))
            if not (mod and core):
                return None
            fwd, bwd = (_ms(mod, k) - _ms(core, k) for k in ("fwd", "bwd"))
            return {"name": part, "ms": {"fwd": {"median": fwd}, "bwd": {"median": bwd},
                                         "recompute": _ms(mod, "recompute") - _ms(core, "recompute")}}
        if part == "experts":
            for label in ([f"experts.fp8.compiled.{routing}", f"experts.fp8.{routing}"] if expert_dtype == "fp8"
                          else [f"experts.bf16.{routing}"]):
                if bench.part(name, label):
                    return bench.part(name, label)
            return None
        return bench.part(name, part)

    n = len(layers)
    n_moe = sum(1 for i in layers if i >= a.n_dense_layers)
    count = {"rmsnorm": 2 * n, "residual_add": 2 * n, "attention.projections": n, "attention.core": n,
             "router": n_moe, "shared_expert": n_moe, "experts": n_moe, "dense_ffn": n - n_moe,
             "embedding": int(embedding), "output_loss": int(output)}
    for part, (term, per) in PARTS.items():
        if not count[part] and part not in ("shared_expert", "experts"):
            continue
        p = measured(part)
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
        scale = work[per]
        if term == "memory-bound":
            scale *= here.hbm_tbs / there.hbm_tbs
        elif part == "experts" and expert_dtype == "fp8":
            scale *= here.fp8_tflops / there.fp8_tflops
        else:
            scale *= here.bf16_tflops / there.bf16_tflops
            if linear_fp8 and part in LINEAR_GEMMS:  # the converter leaves the output projection bf16
                scale *= bench.ceilings["bf16_gemm"]["tflops"] / bench.ceilings["fp8_rowwise_gemm"]["tflops"]
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
        out.notes.append(MXFP8_ASSUMPTION.name)
    return out


def priced(bench: LayerBench | None, w, gpu: str, rank) -> RankCompute | None:
    """rank_ms for a pipeline rank (moe_comm.predict.estimate.PipelineRank) where a recorded
    benchmark covers the workload, else None."""
    if bench is None:
        return None
    try:
        return rank_ms(bench, w, gpu, rank.layers, rank.embedding, rank.output)
    except NotCovered:
        return None


def assumptions(bench: LayerBench) -> list[Assumption]:
    """The rules above as listed assumptions, with the file their figures come from."""
    rel = bench.path.relative_to(REPO) if bench.path.is_relative_to(REPO) else bench.path
    here = peaks(bench.device)
    return [
        Assumption("compute per microbatch: TorchTitan's layer parts measured at the layout's per-rank shape",
                   len([p for p in bench.parts.values() if p.get("status") == "ok"]), "parts",
                   f"{rel} (experiments/layer_bench.py on one {bench.device})"),
        Assumption("another GPU reaches the measured share of its own datasheet peak (bf16 / 8-bit TFLOPS for "
                   "GEMMs and attention, HBM TB/s for memory-bound parts)", 1.0, "",
                   f"assumption: {here.gpu} times scaled by datasheet ratios (moe_comm/metrics/peaks.py, "
                   "moe_comm/predict/assumptions.py); no B200 was measured here"),
        MXFP8_ASSUMPTION,
        Assumption("float8 rowwise linears: bf16 time x measured bf16 / fp8 rowwise GEMM ceilings",
                   bench.ceilings["bf16_gemm"]["tflops"] / bench.ceilings["fp8_rowwise_gemm"]["tflops"], "x",
                   f"{rel} peaks.measured (torch.mm and torch._scaled_mm, 8192^3, same run)"),
        Assumption("selective AC re-runs the grouped GEMMs, the memory-bound ops and every second linear mm", 0.5,
                   "of linear forward", "TorchTitan 0.2.2 op SAC policy (distributed/activation_checkpoint.py; "
                   "deepseek_v3 _op_sac_save_list has no grouped mm)"),
        Assumption("attention kernel priced at one document per sequence (causal)", 1.0, "",
                   f"{rel} attention.core.*; block-causal masks over real documents do less (the bench's docs "
                   "sensitivity part)"),
    ]
