"""The scale model's report: the plan for DeepSeek-V3 671B on 32 x 8 B200 per backend (nccl,
deepep, nvshmem with bf16 and fp8 dispatch), the flagship recipe's step, the EP sweep, the
Nebius anchors, and the model against every measured figure of
results/model_inputs/scale_model_validation.json. One command regenerates it all (after the constants in
moe_comm/predict/calibration.py or the measured inputs in results/model_inputs change):

    python experiments/scale_model.py            # writes results/scale_model.{md,json,png}

Runs on a CPU in about a minute: it reads results/model_inputs, fits the model's measured constants
(moe_comm.predict.calibration), draws routings, prices them and runs the planner.
"""

import argparse
import datetime
import json
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moe_comm import plan as plan_verb  # noqa: E402
from moe_comm import plots  # noqa: E402
from moe_comm import recipe  # noqa: E402
from moe_comm.predict import calibration, estimate, scale_model  # noqa: E402
from moe_comm.predict import plan as planner  # noqa: E402
from moe_comm.predict.routing_plan import routing_statistics  # noqa: E402
from moe_comm.predict import validation  # noqa: E402
from moe_comm.predict.assumptions import MODEL_INPUTS  # noqa: E402

FLAGSHIP = "recipes/deepseek_v3_671b_b200.toml"
# EP 8/16/32 keep the flagship's PP 8 x FSDP 32; EP 64 and 256 need more ranks to borrow from
# (EP divides dp_shard x cp x tp), so PP shrinks and the local batch with it (the global batch
# stays 1024 x 4096 tokens).
EP_LAYOUTS = {8: (8, 32), 16: (8, 32), 32: (8, 32), 64: (4, 16), 256: (1, 4)}  # ep: (pp, local batch)
# issue 23's targets, all model predictions: (what, how the figure is read, bound)
TARGETS = (("nvshmem flagship tok/s/GPU", ">=", 1000.0), ("nvshmem / deepep, each at its best", ">=", 1.2),
           ("exposed MoE comm / MoE comm (nvshmem flagship)", "<=", 0.30),
           ("memory in use / 178 GiB (nvshmem flagship)", "<=", 0.85))
LABEL = {"nccl": "nccl (all-to-all)", "deepep": "deepep (DeepEP V1)", "nvshmem": "nvshmem (hierarchical, bf16)",
         "nvshmem-fp8": "nvshmem (hierarchical, fp8 dispatch)"}
GB = 1e9


def flagship_workloads(cal):
    out = {}
    for ep, (pp, lb) in EP_LAYOUTS.items():
        ov = ["--parallelism.expert_parallel_degree", str(ep), "--parallelism.pipeline_parallel_degree", str(pp),
              "--training.local_batch_size", str(lb)]
        r = recipe.load(str(REPO / FLAGSHIP), ov, device="cuda", check_paths=False)
        w = scale_model.workload_from_recipe(r)
        out[ep] = (w, scale_model.cluster_for("B200", r.layout.nodes, r.layout.procs_per_node, cal))
    return out


def fmt(x, nd=0):
    return f"{x:,.{nd}f}"


PLAN_TOKENS = "1M-4M"  # the global batch range the flagship was planned in: 1x to 4x its 1M tokens before


def _plan_rows(req, cal, top):
    """The plan's rows and the CPU seconds it took from cold (this process's, all threads): the
    routing statistics it draws are cached per process, so they are cleared first."""
    routing_statistics.cache_clear()
    t0 = time.process_time()
    rows = planner.plan(req, cal, top=top)
    return rows, time.process_time() - t0


def plan_section(cal, lines, data):
    """The planner's table for the flagship, per backend, and the targets."""
    r = recipe.load(str(REPO / FLAGSHIP), [], device="cuda", check_paths=False)
    everything, all_seconds = _plan_rows(plan_verb.request(r, global_tokens=PLAN_TOKENS), cal, 1)
    kept = plan_verb.request(r, keep=["ep=32", "pp=8"], global_tokens=PLAN_TOKENS)
    rows, _ = _plan_rows(kept, cal, 5)
    free, seconds = _plan_rows(plan_verb.request(r, keep=["ep=32"], global_tokens=PLAN_TOKENS), cal, 1)
    n_layouts = len(planner.layouts(plan_verb.request(r, global_tokens=PLAN_TOKENS)))
    lines += ["## The plan for the flagship (predictions)", "",
              f"`python -m moe_comm plan {FLAGSHIP} --keep ep=32 --keep pp=8 --global-tokens {PLAN_TOKENS}` (EP 32 "
              "and the recipe's DP 32 x PP 8 kept): the best five feasible layouts per backend, every figure a model "
              "PREDICTION for 32 x 8 B200 (no multi-node run has measured one). The search (with nothing kept: "
              f"{n_layouts:,} layouts - PP degree and schedule with every stage count TorchTitan can build, "
              f"microbatch size and count for a global batch of {PLAN_TOKENS} tokens (1x to 4x the flagship's "
              "before the plan; the plan's default range is the recipe's own to 4x it), AC none/selective/full, "
              "the EP degree, the overlap none / chunked / DualPipeV's - for all four backends) took "
              f"{all_seconds:.1f} s of CPU here ({seconds:.1f} s with EP 32 kept), most of it drawing the routings of "
              "EP 8 to 256 once. Feasible: the memory estimate plus the nvshmem heap within "
              f"{1 - kept.headroom:.0%} of the B200's 178 GiB. \"bubble\" and \"MoE comm\" are shares of the "
              "step; \"exposed\" is the exposed share of the MoE communication that runs.", "",
              "| backend | # | tok/s/GPU | model TFLOPS/GPU | MFU (bf16 peak) | memory GiB | bubble | MoE comm exposed "
              "(of step) | exposed (of MoE comm) | layout | overrides on the recipe |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    data["plan"] = {}
    for backend, top in rows.items():
        data["plan"][backend] = []
        for i, row in enumerate(top, 1):
            p, b = row.prediction, row.bounds
            lines.append(f"| {LABEL[backend]} | {i} | {fmt(p.tokens_per_s_per_gpu)} | {fmt(p.tflops_per_gpu)} | "
                         f"{p.mfu:.1f}% | {row.memory_gib:.0f} | {b['bubble']:.0%} | {b['exposed comm']:.0%} | "
                         f"{p.moe_exposed_share:.0%} | {plan_verb.describe(row)} | `{' '.join(row.overrides)}` |")
            data["plan"][backend].append({"tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
                                          "tflops_per_gpu": p.tflops_per_gpu, "memory_gib": row.memory_gib,
                                          "layout": asdict(row.layout), "overrides": row.overrides,
                                          "terms_ms": p.terms_ms})
    lines += ["", "The DP/PP split, with only EP 32 kept (the best layout per backend):", "",
              "| backend | tok/s/GPU | model TFLOPS/GPU | memory GiB | layout | overrides |", "| --- | --- | --- | --- | --- | --- |"]
    for backend, top in free.items():
        row = top[0]
        lines.append(f"| {LABEL[backend]} | {fmt(row.tokens_per_s_per_gpu)} | {fmt(row.prediction.tflops_per_gpu)} | "
                     f"{row.memory_gib:.0f} | {plan_verb.describe(row)} | `{' '.join(row.overrides)}` |")
    lines += ["", "With nothing kept (EP free too):", "", "| backend | tok/s/GPU | layout | overrides |",
              "| --- | --- | --- | --- |"]
    for backend, top in everything.items():
        row = top[0]
        lines.append(f"| {LABEL[backend]} | {fmt(row.tokens_per_s_per_gpu)} | {plan_verb.describe(row)} | "
                     f"`{' '.join(row.overrides)}` |")
    # the targets, on the recipe as shipped (the plan's best nvshmem layout) and deepep at its best
    w = scale_model.workload_from_recipe(r)
    cluster = scale_model.cluster_for("B200", r.layout.nodes, r.layout.procs_per_node, cal)
    ours = scale_model.predict("nvshmem", w, cluster, cal)
    drift = rows["nvshmem"][0].overrides != ["--moe_comm.backend", "nvshmem"]
    mem = rows["nvshmem"][0].memory_gib
    deepep = rows["deepep"][0].tokens_per_s_per_gpu
    values = [ours.tokens_per_s_per_gpu, ours.tokens_per_s_per_gpu / deepep, ours.moe_exposed_share, mem / 178.4]
    shipped = (f"**The recipe is no longer the plan's best nvshmem layout** (the first nvshmem row above needs "
               f"`{' '.join(rows['nvshmem'][0].overrides)}`): re-plan it. " if drift else
               "The recipe as shipped (the table's first nvshmem row: no override but the backend) ")
    lines += ["", "### Issue 23's targets, against the model's predictions (not measurements)", "",
              f"{shipped}`{FLAGSHIP}`, against deepep at its own best with the same EP 32 x PP 8:", "",
              "| target | predicted | bound | met (by the model) |",
              "| --- | --- | --- | --- |"]
    for (name, op, bound), value in zip(TARGETS, values):
        met = value >= bound if op == ">=" else value <= bound
        share = bound < 1
        shown = f"{value:,.0f}" if bound > 10 else (f"{value:.0%}" if share else f"{value:.2f}")
        lines.append(f"| {name} | {shown} | {op} {bound:.0%} |" if share else f"| {name} | {shown} | {op} {bound:g} |")
        lines[-1] += f" {'yes' if met else 'NO'} |"
    data["targets"] = dict(zip([t[0] for t in TARGETS], values))
    lines += ["", "### Where the nvshmem flagship's TFLOPS/GPU fall short of Megatron-Core's 944", "",
              "Megatron-Core reports 944 TFLOPS/GPU for DeepSeek-V3 on 256 GB200 with PP 8, VPP 4, EP 32 and MXFP8 "
              "(NVIDIA Megatron-LM, docs/discussions/deepseek-v3-gb200-optimization, 2025-11: 943.56 with HybridEP), "
              "the layout family of the flagship. Each line is what adding that term's time to the "
              "step costs in TFLOPS/GPU (`python -m moe_comm plan ... --explain`), in the order listed; they add up "
              f"from 944 to the prediction ({ours.tflops_per_gpu:,.0f}):", "", "| term | TFLOPS/GPU | step ms |",
              "| --- | --- | --- |"]
    terms = {"memory-bound kernels": ours.terms_ms["memory-bound"] - ours.recompute_ms["memory-bound"],
             "activation recompute": sum(ours.recompute_ms.values()), "exposed MoE communication": ours.terms_ms["moe comm"],
             "comm SM contention": ours.terms_ms["comm SM contention"],
             "chunked overlap's weight work": ours.terms_ms["chunked weight work"], "PP sends": ours.terms_ms["pp p2p"],
             "pipeline bubble": ours.terms_ms["pp bubble"], "exposed FSDP collectives": ours.terms_ms["fsdp exposed"],
             "optimizer step": ours.terms_ms["optimizer"],
             "parameter and gradient copies (FSDP, PP accumulation)": ours.terms_ms["param copies"],
             "GPU idle (launch gaps, host work)": ours.terms_ms["idle"]}
    for name, cost in planner.shortfall(ours):
        ms = terms.get(name)
        lines.append(f"| {name} | {cost:+,.0f} | {'' if ms is None else f'{ms:,.0f}'} |")
    lines += ["", "Reading: the first line is the reference less what the GEMM parts and the attention kernel alone "
              "would reach at their measured H200 times scaled to B200 (results/model_inputs/layer_bench_h200x1.json; the GEMM "
              "parts include what their modules run beside the matmuls: MLA's norms and rope, the loss); the rest is "
              "what each other term costs. The largest are the exposed MoE communication (the chunked overlap hides "
              "the part the experts' compute covers; 4 nodes of 50 GB/s NICs carry more than that) and full AC's "
              "recompute. Megatron also runs on GB200 (2.5 PFLOPS bf16 against the B200's 2.25), with MXFP8 GEMMs, "
              "fused memory-bound kernels and its own EP overlap. " + attention_reading("flagship"), ""]


def _fwd_bwd(case: str, name: str) -> tuple[float, float] | None:
    p = calibration.calibrate().layer_bench.part(case, name)  # the bench the model priced from, loaded once
    return (p["ms"]["fwd"]["median"], p["ms"]["bwd"]["median"]) if p else None


def float8_reading(case: str) -> str:
    """The compiled float8 rowwise grouped GEMM against bf16, at the case's node-limited rows."""
    f8, bf = _fwd_bwd(case, "experts.fp8.compiled.node_limited"), _fwd_bwd(case, "experts.bf16.node_limited")
    if not (f8 and bf):
        return "not measured: the bf16 x ceiling-ratio rule stands in, leaving out its quantisation casts"
    return (f"{f8[0]:.2f} / {f8[1]:.2f} ms forward / backward against bf16's {bf[0]:.2f} / {bf[1]:.2f} ms on one H200 at "
            f"case `{case}`: {sum(f8) / sum(bf):.2f}x bf16's time, its per-row quantisation outside the GEMM")


def attention_reading(case: str) -> str:
    """What the layer bench measured of the attention the 671B flavor runs (FlexAttention) against SDPA."""
    flex, sdpa = _fwd_bwd(case, "attention.module.flex"), _fwd_bwd(case, "attention.module.sdpa")
    docs, core = _fwd_bwd(case, "attention.core.flex.docs512"), _fwd_bwd(case, "attention.core.flex")
    if not (flex and sdpa):
        return ("FlexAttention, which the 671B flavor runs, was not measured at case "
                f"`{case}`: SDPA's time stands in (moe_comm.predict.layer_compute).")
    text = (f"Attention is FlexAttention's measured time, as the 671B flavor runs it (case `{case}`: the MLA module "
            f"{flex[0]:.2f} ms forward / {flex[1]:.2f} ms backward, against SDPA's {sdpa[0]:.2f} / {sdpa[1]:.2f} ms at "
            f"the same shape - {(sum(flex) / sum(sdpa) - 1) * 100:+.0f}% forward + backward, most of it FlexAttention's "
            "backward kernel)")
    if docs and core:
        text += (f"; priced at one document per sequence: with documents of 512 tokens its kernel takes "
                 f"{docs[0]:.2f} / {docs[1]:.2f} ms against {core[0]:.2f} / {core[1]:.2f} ms (the bench's docs512 "
                 "sensitivity part)")
    return text + "."


def flagship_section(cal, lines, data):
    lines += ["## DeepSeek-V3 671B on 32 x 8 B200, the EP degree swept", "",
              f"The flagship recipe (`{FLAGSHIP}`: PP 8 Interleaved1F1B with 4 stages per rank, 32 microbatches of "
              "1 x 4096, full AC, the chunked overlap, [moe_comm] num_sms 20, TorchTitan's node-limited router on "
              "random scores) with the EP degree changed; EP 64 and 256 need PP 4 and PP 1 (EP must divide "
              "dp_shard x cp x tp), with the local batch halved and quartered (the global batch stays 4M tokens). "
              "Per rank and step: rows and bytes of every MoE transfer (dispatch, combine, their backward, and "
              "the forward again under full AC); \"MoE comm\" is the MoE communication that runs, \"exposed\" "
              "all exposed communication. Compute: the one-GPU layer benchmark's parts at the flagship's per-rank "
              "shape (results/model_inputs/layer_bench_h200x1.json, case flagship), scaled to B200 by datasheet peak ratios; nothing "
              "is fitted to the Nebius anchors. Predictions.", "",
              "| EP | layout | nodes / EP group | backend | network rows/step | NVLink rows/step | network GB/step | "
              "NVLink GB/step | MoE comm s/step | exposed comm s | overlapped s | step s | tok/s/GPU | MFU (bf16 peak) | "
              "memory in use GiB |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    data["flagship"] = {}
    for ep, (w, cluster) in flagship_workloads(cal).items():
        preds = scale_model.predict_all(w, cluster, cal)
        mem = estimate.memory_per_gpu(w.args, w.layout, w.local_batch, w.seq_len, w.ac_mode, w.microbatch,
                                      w.pp_schedule, w.layers_per_stage)
        best = max((c.label for c in scale_model.choices() if scale_model.runnable(c.backend, w, c.dispatch_dtype)),
                   key=lambda b: preds[b].tokens_per_s_per_gpu)
        lay = w.layout
        layout = f"PP {lay.pp}, FSDP {lay.dp_shard}, LB {w.local_batch}"
        data["flagship"][ep] = {}
        for b, p in preds.items():
            mark = " **(fastest)**" if b == best else ""
            lines.append(
                f"| {ep} | {layout} | {p.comm.nodes} | {LABEL[b]}{mark} | {fmt(p.per_step('network_rows'))} | "
                f"{fmt(p.per_step('nvlink_rows'))} | {p.per_step('network_bytes') / GB:,.1f} | "
                f"{p.per_step('nvlink_bytes') / GB:,.1f} | {p.moe_comm_ms / 1e3:.2f} | "
                f"{p.comm_exposed_ms / 1e3:.2f} | {p.comm_overlapped_ms / 1e3:.2f} | {p.step_ms / 1e3:.2f} | "
                f"{fmt(p.tokens_per_s_per_gpu)} | {p.mfu:.1f}% | {mem.total / estimate.GiB:.0f} |")
            data["flagship"][ep][b] = {"step_ms": p.step_ms, "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
                                       "mfu": p.mfu, "terms_ms": p.terms_ms, "nodes": p.comm.nodes,
                                       "network_gb_per_step": p.per_step("network_bytes") / GB,
                                       "nvlink_gb_per_step": p.per_step("nvlink_bytes") / GB,
                                       "per_moe_layer_microbatch": [
                                           {**asdict(t), "network_bytes": t.network_bytes,
                                            "nvlink_bytes": t.nvlink_bytes, "time_us": t.time_us}
                                           for t in p.comm.transfers]}
    lines.append("")
    w, cluster = flagship_workloads(cal)[32]
    lines += ["### Where a flagship step goes (EP 32, per rank)", "",
              "| backend | " + " | ".join(scale_model.predict("nccl", w, cluster, cal).terms_ms) + " | step |",
              "| --- |" + " --- |" * (len(scale_model.predict("nccl", w, cluster, cal).terms_ms) + 1)]
    for c in scale_model.choices():
        p = scale_model.predict(c.backend, w, cluster, cal, c.dispatch_dtype)
        lines.append(f"| {LABEL[c.label]} | " + " | ".join(f"{v / 1e3:.2f}" for v in p.terms_ms.values())
                     + f" | {p.step_ms / 1e3:.2f} s |")
    lines += ["", "One MoE layer, one microbatch (4096 tokens per rank), slowest rank, EP 32; times in us (a "
              "transfer costs host + fixed + the slower of NVLink and network + layout):", "",
              "| backend | transfer | network rows | NVLink rows | network MB | NVLink MB | host | fixed | NVLink | "
              "network | layout | total |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in scale_model.choices():
        p = scale_model.predict(c.backend, w, cluster, cal, c.dispatch_dtype)
        for t in p.comm.transfers:
            lines.append(f"| {LABEL[c.label]} | {t.name} | {fmt(t.network_rows)} | {fmt(t.nvlink_rows)} | "
                         f"{t.network_bytes / 1e6:,.1f} | {t.nvlink_bytes / 1e6:,.1f} | {t.host_us:.0f} | "
                         f"{t.fixed_us:.0f} | {t.nvlink_us:.0f} | {t.network_us:.0f} | {t.layout_us:.0f} | "
                         f"{t.time_us:.0f} |")
    st = p.comm.stats
    lines += ["", f"Routing at EP 32 (node-limited): {st.nodes_hit_per_token:.2f} nodes and "
              f"{st.ranks_hit_per_token:.2f} ranks per token; per-node dedup {st.node_dedup:.2f}x, per-rank dedup "
              f"{st.rank_dedup:.2f}x (tests/test_routing_plan.py's table).", ""]


# what each anchor's prediction takes from measurements and what from stated assumptions
ANCHOR_MEASURED = {
    "standard": "compute: results/model_inputs/layer_bench_h200x1.json case `nebius` (TP 2, 1 x 8192: norms, residuals, router, "
                "MLA projections, FlexAttention kernel, shared expert, dense FFN, bf16 grouped GEMM at EP 32 balanced, "
                "embedding, output + loss; fwd, bwd, full-AC recompute); nccl path: per-call host cost and per-row "
                "permutes (results/model_inputs/comm_bench_h200x2.json, mfu_sweep profiles); NCCL's NVLink rate (a "
                "probe on 2xH200, moe_comm/predict/assumptions.py); idle share (results/model_inputs split_kernels "
                "profile)",
    "deepep": "compute as standard; DeepEP's per-token fixed cost from its intranode test on 2xH200 "
              "(moe_comm/predict/assumptions.py) with our kernels' link efficiency "
              "(results/model_inputs/comm_bench_h200x2.json); TorchTitan's DeepEP permute and unpermute per row (a "
              "profile on one H200, moe_comm/predict/assumptions.py)",
    "deepep_mxfp8": "as deepep; the bf16 grouped GEMM and the measured bf16 / fp8 rowwise GEMM ceilings "
                    "(layer_bench.json peaks.measured: 799 / 1,560 TFLOPS)",
}
ANCHOR_ASSUMED = {
    "standard": "B200 = the H200's share of each datasheet peak (bf16 2,250 / 989 TFLOPS, HBM 8.0 / 4.8 TB/s); "
                "attention at one document per sequence (c4's packed documents do less); network 43 GB/s per GPU "
                "(DeepEP V1 internode on CX7, DeepEP's README); TP 2 collectives at NCCL's NVLink rate, exposed",
    "deepep": "as standard; DeepEP's host sync per forward dispatch = the nccl path's per-call cost (not measured); "
              "DeepEP's network phase at the same 43 GB/s",
    "deepep_mxfp8": "as deepep; compiled MXFP8 grouped GEMM = bf16 x the measured ceiling ratio at the B200's FP8 "
                    "rate (4.5 PFLOPS, datasheet; not measured anywhere here, and not the H200's float8 rowwise "
                    "kernel: moe_comm.predict.layer_compute.MXFP8_ASSUMPTION)",
}


def anchor_section(cal, rows, lines, data):
    anchors = [r for r in rows if r.kind == "anchor"]
    figs = {f["id"]: f for f in validation.load_figures() if f["kind"] == "anchor"}
    lines += ["## The Nebius anchors (651 -> 859 tok/s/GPU with DeepEP, 918 with MXFP8, 256 B200)", "",
              "Layout from the published job script (nebius/ml-cookbook `pytorch-dsv3-mxfp8/train_671b.sh`): TP 2, "
              "PP 2 (Interleaved1F1B), EP 32, FSDP 64, local batch 64 x 8192, full AC, "
              "`--debug.moe_force_load_balance` (round-robin routing: every token lands on one rank, 3 of 4 times "
              "on another node, so DeepEP's per-node dedup sends 8x fewer network rows than the all-to-all). "
              "Nothing is fitted to these figures (tests/test_scale_model.py::test_nothing_is_fitted_to_the_nebius_"
              "anchors; calibration never opens the validation table). Step seconds per rank (64 x 8192 / TP 2 / PP 2 "
              "tokens): measured = 131,072 / tok/s/GPU.", "",
              "| figure | measured tok/s/GPU | predicted | error | step s measured / predicted | compute s (layer bench; "
              "of it recompute) | MoE comm s | TP comm s | idle s | rest s | measured inputs | assumed, and from where |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    data["anchors"] = {}
    preds = {}
    for r in anchors:
        name = r.id.rsplit("/", 1)[1]
        f = figs[r.id]
        w, cluster = scale_model.workload_from_spec(f["predict"], cal)
        p = scale_model.predict(f["predict"]["backend"], w, cluster, cal, f["predict"].get("dispatch_dtype", "bf16"))
        preds[name] = (p, w, cluster, r)
        t = p.terms_ms
        tokens = w.local_batch * w.seq_len / (w.layout.tp * w.layout.pp)
        compute = sum(t[k] for k in ("gemm", "attention", "memory-bound"))
        rest = p.step_ms - compute - t["moe comm"] - t["tp comm"] - t["idle"]
        lines.append(f"| {name} | {fmt(r.measured)} | {fmt(r.predicted)} | {r.error_pct:+.1f}% | "
                     f"{tokens / r.measured:.1f} / {p.step_ms / 1e3:.1f} | {compute / 1e3:.1f} "
                     f"({sum(p.recompute_ms.values()) / 1e3:.1f}) | {t['moe comm'] / 1e3:.1f} | {t['tp comm'] / 1e3:.1f} | "
                     f"{t['idle'] / 1e3:.1f} | {rest / 1e3:.1f} | {ANCHOR_MEASURED[name]} | {ANCHOR_ASSUMED[name]} |")
        data["anchors"][name] = {"measured": r.measured, "predicted": r.predicted, "error_pct": r.error_pct,
                                 "terms_ms": t, "compute_source": p.compute_source}
    std, dep, mx = (preds[k] for k in ("standard", "deepep", "deepep_mxfp8"))
    gap = {k: (v[1].local_batch * v[1].seq_len / (v[1].layout.tp * v[1].layout.pp)) / v[3].measured - v[0].step_ms / 1e3
           for k, v in preds.items()}  # measured - predicted step seconds
    measured_gain = dep[3].measured / std[3].measured
    predicted_gain = dep[0].tokens_per_s_per_gpu / std[0].tokens_per_s_per_gpu
    mx_step = {k: (preds[k][1].local_batch * preds[k][1].seq_len / 4) / preds[k][3].measured for k in ("deepep", "deepep_mxfp8")}
    # what DeepEP's network rate would have to be to reproduce 859 (all else as modelled)
    p, w, cluster, target_row = dep
    target = target_row.measured
    lo, hi = 0.5, cluster.nic_gbps
    for _ in range(40):
        mid = (lo + hi) / 2
        c = replace(cluster, nic_gbps=mid / scale_model.READ["network_efficiency"].value)
        lo, hi = (mid, hi) if scale_model.predict("deepep", w, c, cal).tokens_per_s_per_gpu < target else (lo, mid)
    dispatches = p.moe_calls_per_step * (2 if w.comm_recomputed else 1)
    lines += ["", f"Compute comes from the layer benchmark for every row ({std[0].compute_source}). "
              f"What the figures say against each other: MXFP8 saves {mx_step['deepep'] - mx_step['deepep_mxfp8']:.1f} s "
              f"per step measured and {(dep[0].step_ms - mx[0].step_ms) / 1e3:.1f} s predicted (the grouped GEMM at "
              "the 8-bit rate, MXFP8_ASSUMPTION); DeepEP over the all-to-all is "
              f"{measured_gain:.2f}x measured and {predicted_gain:.2f}x predicted. The model is "
              f"{gap['standard']:.1f} s per step fast on the standard path and {gap['deepep']:.1f} s on DeepEP. A term the "
              f"two share (attention, TP 2's collectives, the idle share) can take at most the standard path's "
              f"{gap['standard']:.1f} s before that row turns slow, so at least "
              f"{gap['deepep'] - gap['standard']:.1f} s of the DeepEP residual is DeepEP's own path (unless the model "
              "over-prices the all-to-all by the same amount).", "",
              "Residuals beyond +-15%, the term, and the measurement that settles it:", "",
              f"- **deepep ({dep[3].error_pct:+.0f}%) and deepep_mxfp8 ({mx[3].error_pct:+.0f}%): DeepEP's path at EP 32 "
              f"across 4 nodes.** The model gives it {dep[0].terms_ms['moe comm'] / 1e3:.1f} s of MoE communication per "
              f"step: network {dep[0].per_step('network_bytes') / GB:,.0f} GB at {cluster.network_gbps:.0f} GB/s, "
              f"{dispatches:,.0f} host syncs at the nccl path's {cal.nccl_call_us / 1e3:.1f} ms (assumed), TorchTitan's "
              f"permutes. The measured 859 needs about {gap['deepep'] / dispatches * 1e3:.1f} ms more per forward "
              f"dispatch, or DeepEP's network phase at about {(lo + hi) / 2:.0f} GB/s per GPU instead of "
              f"{cluster.network_gbps:.0f}. Settled by (1) the host syncs, on one GPU: the deepep backend at 2 PEs under "
              "MPS through TorchTitan's DeepEP path (tests/gpu, as the GPU tests run it) with the step's comm timers and "
              "a profile - the wait on DeepEP's CPU-side counts per dispatch; (2) the rate, on two or more nodes: "
              "experiments/bench_comm.py across nodes for deepep and nvshmem at EP 16/32 (bytes per second on the "
              "NIC); its rows join results/model_inputs/scale_model_validation.json.",
              f"- **Attention at seq 8192 (all rows).** {attention_reading('nebius')} Nebius trains on c4 with "
              "block-causal masks over packed documents, which skip the pairs across documents: at one document per "
              "sequence the model prices attention at its most. The term is shared, so by the argument above it can "
              f"explain at most the standard row's {gap['standard']:.1f} s. Settled by the anchor's document lengths "
              "(c4's, through TorchTitan's tokenizer at seq 8192), priced with the docs512 part's rule.",
              f"- **TP 2's collectives (all rows): {std[0].terms_ms['tp comm'] / 1e3:.1f} s per step modelled** "
              "(sequence-parallel all-gather and reduce-scatter around attention and the FFNs at NCCL's measured "
              "NVLink rate, exposed). Shared as well; settled on the 2xH200 machine by timing those collectives at the "
              "anchor's shape (all-gather and reduce-scatter of 8,192 x 7,168 bf16 over 2 GPUs, forward and backward, "
              "beside the layer's compute) - our recipes refuse TP with EP, so not through a recipe.",
              ""]


def validation_section(rows, lines, data):
    lines += ["## Validation against every measured figure", "",
              "Measured values are those of `results/model_inputs/scale_model_validation.json`, each with the result "
              "file it was read from (tests/test_model_inputs.py reads every one again from its file). "
              "\"calibration\" rows were used to fit a constant (their error shows how well the model's form fits); "
              "\"held out\" rows were not. The comm bench's torch symmetric-memory rows are a baseline, not a backend, "
              "and are not modelled.", "",
              "| figure | kind | use | measured | predicted | error | note |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| `{r.id}` | {r.kind} | {r.use} | {r.measured:,.1f} | {r.predicted:,.1f} | "
                     f"{r.error_pct:+.1f}% | {r.note} |")
    lines += ["", "| kind | held-out figures | median abs error | largest abs error |", "| --- | --- | --- | --- |"]
    for kind in ("comm_bench", "training", "memory", "anchor"):
        held = [abs(r.error_pct) for r in rows if r.kind == kind and r.use == "held out"]
        if held:
            lines.append(f"| {kind} | {len(held)} | {statistics.median(held):.1f}% | {max(held):.1f}% |")
    lines.append("")
    data["validation"] = [{"id": r.id, "kind": r.kind, "use": r.use, "measured": r.measured,
                           "predicted": r.predicted, "error_pct": r.error_pct} for r in rows]


def memory_section(rows, lines):
    one = [r for r in rows if r.kind == "memory" and "h200x1" in r.id]
    two = [r for r in rows if r.kind == "memory" and "h200x2" in r.id and r.id.endswith("/in") and "float8" not in r.id]
    worst1 = max(one, key=lambda r: abs(r.error_pct))
    lines += ["## Memory estimate", "",
              "`moe_comm.predict.estimate.memory_per_gpu` prices the two moments a step peaks: the end of the forward "
              "pass (fp32 params + AdamW moments 12 B/param sharded, FSDP working set, every activation and the "
              "logits; no gradient exists yet) and the end of the backward pass (the same plus 4 B/param of sharded "
              "fp32 gradients and the largest unit's unsharded gradients in bf16 and fp32, the activations gone). "
              "The larger is the peak in use (TorchTitan's memory/max_active); torch's caching allocator reserves "
              f"about {estimate.ALLOCATOR_CACHE_BYTES_PER_OUTPUT_PARAM:.0f} bytes per output-projection parameter "
              "(vocab x dim) more (memory/max_reserved; an empirical fit over the 2xH200 runs, "
              f"`validation.fit_allocator_cache` = {validation.fit_allocator_cache():.1f}).", "",
              "Without fully_shard (world 1: dp_shard x cp = 1 and EP 1) TorchTitan applies no FSDP and trains under "
              "torch.autocast: there is no working set and no gradient reduce (the estimate used to count 6.1 + 9.2 "
              "GiB of them there, +16% on the one-GPU recipe), but autocast keeps a bf16 copy of every weight it "
              "casts until that weight's backward (its cast cache; the grouped GEMM's explicit casts, recomputed "
              "under AC; the embedding is not cast) and the residual stream is fp32 (each norm's input saved in "
              "fp32, each norm output cast to bf16 once per linear that reads it). With those, the one-GPU recipe's "
              f"{len(one)} measured peaks (AC none / selective / full, local batch 1 and 2, nccl and nvshmem) lie "
              f"within {max(abs(r.error_pct) for r in one):.1f}% (largest: `{worst1.id}`, {worst1.note}); the 2xH200 "
              f"bf16 rows are unchanged (within {max(abs(r.error_pct) for r in two):.1f}%). At world 1 the peak of "
              "AC none x 1, selective x 2 and full x 2 is the end of the backward pass - fp32 params, moments and "
              "gradients, 16 B/param = 85.2 GiB, measured 86.0-86.4 - so the activations do not show there; AC none "
              "x 2 peaks at the end of the forward pass (97.5 estimated, 99.8-101.5 measured). Reserved memory is "
              "not validated at world 1 (the allocator term is the FSDP runs' fit: ~121-133 GiB estimated, 96-109 "
              "measured). The float8 2xH200 runs (torch.compile, fp8 saved tensors) use 14% less than estimated. "
              "Outside torch's allocator (not in these figures): the CUDA context, NCCL buffers and the NVSHMEM "
              "symmetric heap.", ""]


def assumptions_section(cal, lines):
    lines += ["## Assumptions and their sources", "", "| assumption | value | unit | source |", "| --- | --- | --- | --- |"]
    for a in cal.assumptions:
        lines.append(f"| {a.name} | {a.value:.4g} | {a.unit} | {a.source} |")
    lines += ["", "Structural assumptions (not numbers):",
              "- a transfer costs its fixed part, then the slower of its NVLink and network phases (pipelined in "
              "chunks), then its layout kernels; the fixed part of the hierarchical path grows with the rows a "
              "forwarder handles (its own tokens plus what arrives over the network); `network_sms` (default half "
              "of num_sms) drive the network hop and are assumed enough to saturate the NIC, the rest drive NVLink;",
              "- the slowest rank bounds every transfer (rows from the drawn routing's busiest rank);",
              "- backward transfers cost what their forward mirrors cost (combine backward = dispatch, dispatch "
              "backward = combine), except the nccl path's permutes, measured apart;",
              "- full AC runs every forward transfer twice; op-level selective AC keeps comm outputs; the recompute "
              "(all of a layer's forward under full AC, half under selective) runs in the input-gradient pass;",
              "- the pipeline (moe_comm/predict/schedule.py, tested against torch's own action lists): a step is "
              "the busiest rank's microbatches (forward f, input gradient bi, weight gradient bw) plus the "
              "schedule's bubble in closed form - 1F1B (pp - 1)(f + b), Interleaved1F1B (f + b)(pp - 1 + max(0, pp "
              "- m)(v - 1)) / v, InterleavedZeroBubble (pp - 1) max(f + bi - bw, f, bi) / v, ZBVZeroBubble (pp - 1) "
              "max(bi / 2, bi - f, bi - bw, f - bi / 2), DualPipeV (pp - 1)(f + 2 bi - bw) / 2; the zero-bubble "
              "ones are modelled for m >= pp (V schedules m >= 2 pp); the GEMMs' weight gradient is bw, all else "
              "bi; activations are held per the schedule's microbatch-stages in flight on each rank;",
              "- with PP, TorchTitan keeps each stage's parameters unsharded for the step and torch accumulates "
              "unsharded fp32 gradients over the microbatches: both are in the memory estimate; FSDP's exposed "
              "collectives are one stage chunk's all-gather and reduce-scatter (1/v of the rank's);",
              "- FSDP collectives otherwise overlap compute except one unit's all-gather and reduce-scatter; TP "
              "collectives and PP sends are exposed;",
              "- the chunked overlap ([moe_comm] overlap = \"chunked\", `scale_model.overlap_exposure`): two "
              "chunks of half the tokens, each paying a whole call's per-op cost plus half the rows; forward "
              "exposed = max(0, d0 - shared) + max(0, d1 - E0) + max(0, c0 - E1) + c1, the backward mirrored with "
              "the experts' backward (2x, or 1x where a zero-bubble schedule defers the weight gradient); while a "
              "comm kernel runs beside a GEMM the GEMM loses num_sms / SMs of the GPU (a pair costs max(a - e, a x "
              "num_sms / SMs) beyond e); host syncs stay exposed;",
              "- DualPipeV's EP overlap: in its OVERLAP_F_B pairs (counted from torch's schedule) each comm op of "
              "one chunk runs beside half a layer's compute of the other; elsewhere the comm is exposed;",
              "- fp8 dispatch sends e4m3 rows + one fp32 scale per 128 channels on the forward dispatch only;",
              "- compute (moe_comm/predict/layer_compute.py): each part of a rank's layers measured on one H200 at "
              "the layout's per-rank shape (results/model_inputs/layer_bench_h200x1.json), scaled by its work where the shape "
              "differs and by datasheet peak ratios to another GPU; float8 GEMMs (grouped, until the compiled one is "
              "measured, and linear) at the bf16 part's time x the measured bf16 / fp8 rowwise ceiling ratio, "
              "MXFP8 the same at the B200's 8-bit rate; the eager float8 grouped GEMM (measured 2.6x slower than "
              "bf16: its quantisation unfused) is never used, as every float8 recipe compiles;",
              "- what no layer part times, per step: the optimizer (fused AdamW and the gradient clip's norm and "
              "scale, 40 B per sharded parameter) and the parameter and gradient copies (FSDP's all-gather copy-out "
              "and reduce-scatter cast, 14 B per parameter of the rank's units without PP; with PP one copy-out, the "
              "fp32 gradient accumulation of every microbatch after the first, 10 B each, and the reduce's copy; "
              "autocast's casts at world 1, 12 B), at the layout kernels' measured share of HBM bandwidth; the GPU's "
              "idle share from the 2xH200 profile.", ""]


def gaps_section(rows, lines):
    def err(needle):
        got = [r.error_pct for r in rows if needle in r.id and r.kind == "training"]
        return f"{min(got):+.0f}% to {max(got):+.0f}%" if len(got) > 1 else f"{got[0]:+.0f}%"

    def chunking(backend):  # measured tok/s of the chunked run against the plain one, world 1
        got = {r.id.rsplit("-", 1)[1]: r.measured for r in rows if f"overlap_training/deepseek_v3_671b_h200x1/{backend}-" in r.id}
        return f"{(got['chunked'] / got['none'] - 1) * 100:+.1f}%"

    lines += ["## Known gaps", "",
              f"- **16B on 2 H200 (held out): nvshmem {err('nvshmem_16b/')} ({err('split_kernels_16b/deepseek_v3_16b_h200x2-nvshmem')} "
              "on the slow lease).** 27 thin layers (dim 2048) with full AC and FlexAttention run host- and "
              "launch-bound (GPU idle ~70% in a 16B profile of TorchTitan's standard path, 2xH200, not in results/); their compute is the 671B parts scaled by "
              "work (the benchmark has no 16B case), the idle share is the GPU-bound 671B-shaped profile's, and "
              "the model has no host-launch floor. A profile of the 16B step would give the floor.",
              f"- **nccl at 4 x 4096 on 2 H200 (held out): {err('h200x2-nccl-b4-s4096')}.** Those runs reserve 137.4 "
              "of 139.8 GiB and retry allocations (memory/num_alloc_retries 12 against 6 for nvshmem); the model has "
              "no memory-pressure term; at 2 x 4096 and 4 x 2048 the nccl path is within 3%.",
              f"- **The 671B-shaped layers on 2 H200, nvshmem: {err('671b_layers_h200x2-nvshmem')}; one H200: "
              f"{err('one_gpu_training')}.** The model is fast by a few percent: parts timed alone leave out some "
              "of what a step runs between them (the copies it does price are sized from kernel names in the "
              "one-GPU step profiles, not fitted).",
              f"- **The chunked overlap at world 1 (one H200, held out): nvshmem {err('overlap_training/deepseek_v3_671b_h200x1/nvshmem-chunked')}, "
              f"nccl {err('overlap_training/deepseek_v3_671b_h200x1/nccl-chunked')}; without it {err('overlap_training/deepseek_v3_671b_h200x1/nvshmem-none')} and "
              f"{err('overlap_training/deepseek_v3_671b_h200x1/nccl-none')}.** With no link to hide, chunking measured a loss (tok/s "
              f"{chunking('nvshmem')} nvshmem, {chunking('nccl')} nccl): the experts run once per chunk, so their weight gradients are added and, under autocast, their "
              "weights re-cast (the step's `chunked weight work`, moe_comm.predict.estimate.chunked_expert_bytes, "
              "from run 20's profile). The nccl row's rest: its host waits for split sizes come twice per layer.",
              f"- **float8 on 2 H200 (torch.compile): {err('train/float8/')}.** The routed experts are the layer "
              "bench's compiled float8 rowwise grouped GEMM (" + float8_reading("flagship") + ").",
              "- **FlexAttention:** " + attention_reading("flagship"),
              "- **Inter-node:** no multi-node figure exists yet; the network rate (DeepEP V1's 43 GB/s), the "
              "hierarchical path's fixed cost and the NVLink forward's SM budget are assumptions until the lead's "
              "inter-node kernels and a multi-node run measure them.",
              "- **B200:** no B200 was measured here: its parts are the H200's at the same share of each datasheet "
              "peak; nothing is fitted to the Nebius anchors.", ""]


def plot(data, rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    eps = sorted(data["flagship"])
    for b in (c.label for c in scale_model.choices()):
        ax1.plot(range(len(eps)), [data["flagship"][ep][b]["tokens_per_s_per_gpu"] for ep in eps], marker="o", label=LABEL[b])
    ax1.set_xticks(range(len(eps)), [f"EP {ep}" for ep in eps])
    ax1.set_ylabel("predicted tok/s per GPU")
    ax1.set_title("DeepSeek-V3 671B, 32 x 8 B200 (flagship recipe)")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    markers = {"comm_bench": "o", "training": "s", "memory": "^", "anchor": "*"}
    for kind, m in markers.items():
        for use, color in (("calibration", "tab:gray"), ("held out", "tab:red")):
            pts = [(r.measured, r.predicted) for r in rows if r.kind == kind and (r.use == "held out") == (use == "held out")]
            if pts:
                ax2.scatter(*zip(*pts), marker=m, color=color, label=f"{kind} ({use})", s=60 if m == "*" else 25)
    lo = min(min(r.measured, r.predicted) for r in rows) * 0.7
    hi = max(max(r.measured, r.predicted) for r in rows) * 1.4
    ax2.plot([lo, hi], [lo, hi], color="k", lw=0.8)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("measured (us, tok/s/GPU, GiB)")
    ax2.set_ylabel("predicted")
    ax2.set_title("validation: every figure of scale_model_validation.json")
    ax2.legend(fontsize=7)
    plots.save(fig, path, inputs_footer())


def inputs_footer() -> list[str]:
    """What the plot is computed from: the model's measured inputs and the kernels each measured."""
    manifest = json.loads((MODEL_INPUTS / "MANIFEST.json").read_text())
    measured = {name: entry["kernels"]["commit"] for name, entry in manifest["files"].items() if entry["kernels"]}
    files = "; ".join(f"{name} ({f'kernels {commit}' if commit else 'no kernels of ours'})"
                      for name, commit in measured.items())
    return ["PREDICTIONS of the step model, computed on a CPU by experiments/scale_model.py; the validation "
            "panel's measured values are in results/model_inputs/scale_model_validation.json",
            f"measured inputs (results/model_inputs, MANIFEST.json): {files}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "results" / "scale_model.md"))
    args = ap.parse_args()
    out = Path(args.out)
    cal = calibration.calibrate()
    rows = validation.validate(cal)
    data: dict = {}
    lines = ["# Scale model: the flagship's plan, dispatch/combine and MFU at 256 B200, validated on 2xH200 and 1xH200",
             "",
             f"Made by `python experiments/scale_model.py` on {datetime.date.today().isoformat()} (CPU; no GPU "
             "needed) from the model's measured inputs in results/model_inputs (MANIFEST.json: what each file "
             "measured, on which machine, with which kernels; the 2xH200 comm bench and training profiles, the "
             "one-GPU layer benchmark every compute time comes from) and the figures in "
             "results/model_inputs/scale_model_validation.json. The model: "
             "moe_comm/predict/scale_model.py (compute: moe_comm/predict/layer_compute.py; routing counts: "
             "moe_comm/predict/routing_plan.py; memory: moe_comm/predict/estimate.py). `python -m moe_comm check RECIPE` "
             "prints the same predictions for one recipe. Plot: `scale_model.png`; numbers: `scale_model.json`.", ""]
    plan_section(cal, lines, data)
    flagship_section(cal, lines, data)
    anchor_section(cal, rows, lines, data)
    validation_section(rows, lines, data)
    memory_section(rows, lines)
    assumptions_section(cal, lines)
    gaps_section(rows, lines)
    out.write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps(data, indent=1, default=float) + "\n")
    plot(data, rows, out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_suffix('.json')}, {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
