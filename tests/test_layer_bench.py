"""experiments/layer_bench.py end to end on CPU (--tiny): the JSON names the machine, the
ceilings and every part of both cases with its times, FLOPs, bytes and efficiency; parts that
cannot run on a CPU say why; the report prints every part and the layer's sum; --resume keeps
what was measured. Plus the closed forms the efficiencies rest on."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from outcomes import kept, result, run_script

REPO = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("layer_bench", REPO / "experiments" / "layer_bench.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["layer_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


lb = _load()

# Every part of a case, named independently of the script (a part that disappears fails here).
DOCS = ["", f".docs{lb.DOC_TOKENS}", ".c4_en", ".nltk_en"]  # one document, fixed, the data's distributions
COMMON = ["rmsnorm", "residual_add", "rope", "silu_mul.experts", "attention.module.sdpa", "attention.core.sdpa",
          "attention.module.flex", "attention.module.varlen",
          *[f"attention.core.{k}{d}" for k in ("flex", "varlen") for d in DOCS], "router",
          "reorderer", "shared_expert", "dense_ffn", "recv_permute", "embedding",
          "output_loss", "output_loss.loss_compiled",
          *[f"experts.{d}.{r}" for d in ("bf16", "fp8", "fp8.compiled", "moe_comm_fp8", "moe_comm_fp8_bf16_wgrad",
                                          "moe_comm_fp8_cached")
            for r in ("balanced", "node_limited")]]
COMPOSITES = ["moe.standard_local", "layer.moe_block"]  # TP 1 only
# torchao's float8 parts need a GPU; the project's FP8 experts run on CPU with the GEMMs emulated
NOT_ON_CPU = {"flex": "FlexAttention's backward does not run on CPU", "varlen": "variable-length kernel is CUDA only",
              "experts.fp8.": "float8 grouped GEMMs need a CUDA GPU"}


def in_background(shared_run, folder: Path, nice: int):
    """The tiny bench, run as its command line runs it, in a process of its own at niceness
    `nice` and on one thread while other modules' tests run (tests/conftest.py): (its JSON's
    path, the JSON)."""
    return kept(_bench, folder / "layer_bench.json", nice)


def _bench(out: Path, nice: int) -> tuple[Path, dict]:
    argv = ["run", "--device", "cpu", "--tiny", "--iters", "1", "--warmup", "0", "--budget-s", "1e9", "--out", str(out)]
    run_script("experiments/layer_bench.py", *argv, nice=nice, env={"OMP_NUM_THREADS": "1"})
    return out, json.loads(out.read_text())


@pytest.fixture(scope="module")
def bench(background):
    return result(background)


def test_json_names_machine_peaks_and_cases(bench):
    _, doc = bench
    assert doc["schema"] == lb.SCHEMA
    assert doc["command"].startswith("python experiments/layer_bench.py run --device cpu --tiny")
    assert doc["machine"]["device"] == "CPU" and doc["machine"]["torchtitan"] == "0.2.2"
    assert doc["peaks"]["measured"]["bf16_gemm"]["tflops"] > 0
    assert doc["peaks"]["measured"]["copy"]["tbs"] > 0
    assert "SM 8.9" in doc["peaks"]["measured"]["fp8_rowwise_gemm"]["reason"]
    flag, neb = doc["cases"]["flagship"], doc["cases"]["nebius"]
    # the flagship's microbatch (PP: one sequence) and the Nebius layout (TP 2, seq twice as long)
    assert (flag["sequences"], flag["tp"], neb["tp"]) == (1, 1, 2) and neb["seq_len"] == 2 * flag["seq_len"]
    assert neb["routing"] == "balanced" and flag["routing"] == "node_limited"
    for c in (flag, neb):
        rows = c["received_rows"]
        picks = c["tokens_sp"] * 4  # tiny: top-4
        # balanced: every rank receives exactly its own number of picks; node-limited: the slowest rank more
        assert rows["balanced"]["rows"] == picks == sum(rows["balanced"]["rows_L"])
        assert sum(map(sum, rows["balanced"]["rows_from_SL"])) == picks
        assert rows["node_limited"]["rows"] >= rows["node_limited"]["mean_rows"] == picks


def test_every_part_is_measured_or_says_why(bench):
    _, doc = bench
    got = {(p["case"], p["name"]): p for p in doc["parts"]}
    expected = [("flagship", n) for n in COMMON + COMPOSITES] + [("nebius", n) for n in COMMON]
    assert sorted(got) == sorted(expected)
    for (case, name), p in got.items():
        blocked = next((why for key, why in NOT_ON_CPU.items() if key in name), None)
        if blocked:
            assert p["status"] == "not run" and blocked in p["reason"], (case, name, p)
            continue
        assert p["status"] == "ok", (case, name, p.get("reason"))
        for phase in ("fwd", "bwd", "fwd_ac", "bwd_ac"):
            assert p["ms"][phase]["median"] > 0, (name, phase)
        assert p["bytes"]["fwd"] > 0 and p["bytes"]["bwd"] > 0
        if p["bound"] in ("compute", "mixed"):
            assert p["flops"]["fwd"] > 0 and p["flops"]["bwd"] == 2 * p["flops"]["fwd"]
            assert p["efficiency"]["fwd"]["tflops"] > 0
        else:
            assert p["efficiency"]["fwd"]["tbs"] > 0


def test_layer_sum_counts_the_common_parts(bench):
    _, doc = bench
    sums = lb.layer_sums(doc)
    flag = sums["flagship"]
    # the flagship's flavor runs FlexAttention, which a CPU cannot: SDPA stands in, named
    assert "2 x rmsnorm" in flag["parts"] and "2 x residual_add" in flag["parts"]
    assert any(s.startswith("attention.module.sdpa (for attention.module.flex") for s in flag["parts"])
    assert "experts.bf16.node_limited" in flag["parts"] and "experts.bf16.balanced" in sums["nebius"]["parts"]
    ok = {(p["case"], p["name"]): p for p in doc["parts"] if p["status"] == "ok"}
    expect = sum(n * ok[("flagship", name)]["ms"]["fwd"]["median"] for n, name in
                 ((2, "rmsnorm"), (2, "residual_add"), (1, "attention.module.sdpa"), (1, "router"),
                  (1, "shared_expert"), (1, "experts.bf16.node_limited")))
    assert flag["fwd"] == pytest.approx(expect)


def test_report_prints_every_part(bench, capsys):
    out, doc = bench
    assert lb.main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    for p in doc["parts"]:
        assert f"| {p['case']} | {p['name']} |" in text
    assert "- flagship: fwd" in text and "- nebius: fwd" in text
    assert "the standard path's own layout work" in text
    with pytest.raises(ValueError, match="not a layer_bench JSON"):
        lb.report({"schema": "other"})


def test_resume_keeps_what_was_measured(bench, tmp_path):
    out, doc = bench
    copy = tmp_path / "lb.json"
    copy.write_text(out.read_text())
    argv = ["run", "--device", "cpu", "--tiny", "--iters", "1", "--warmup", "0", "--budget-s", "1e9",
            "--out", str(copy), "--resume", "--cases", "nebius", "--parts", "rmsnorm", "attention.core.flex"]
    assert lb.main(argv) == 0
    again = json.loads(copy.read_text())
    assert len(again["resumed_by"]) == 1 and "--resume" in again["resumed_by"][0]["command"]
    kept = [p for p in again["parts"] if p["status"] == "ok"]
    assert len(kept) == sum(p["status"] == "ok" for p in doc["parts"])
    # the parts not measured before, of the case and names asked for (names are prefixes), again
    assert {(p["case"], p["name"]) for p in again["parts"] if p["status"] != "ok"} == {
        ("nebius", f"attention.core.flex{d}") for d in DOCS}


def test_causal_flops_closed_form():
    assert lb.causal_pairs(4, None) == 10  # 1 + 2 + 3 + 4
    assert lb.causal_pairs(8, 4) == 20  # two documents of 4
    assert lb.causal_pairs(10, 4) == 10 + 10 + 3  # and a last one of 2
    case = lb.Case("x", "", "671B", 4096, 1, 1, 32, "balanced")
    a = lb.flavor_args(case)
    # 2 x heads x kept pairs x (qk + v): 128 heads, 192 + 128 head dims, causal ~ S^2 / 2
    assert lb.attention_core_flops(a, case) == 2 * 128 * (4096 * 4097 / 2) * 320
    tp2 = lb.Case("x", "", "671B", 8192, 1, 2, 32, "balanced")
    assert lb.attention_core_flops(a, tp2, 512) == 2 * 64 * 16 * (512 * 513 / 2) * 320


def test_the_scale_model_reads_what_the_bench_writes(bench, tmp_path, monkeypatch):
    """The JSON this script writes is the one moe_comm.predict.layer_compute reads: the tiny run,
    relabelled as a GPU run of a registered flavor, prices its own shape from its own parts."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    from moe_comm.layout import Layout
    from moe_comm.predict import layer_compute
    from moe_comm.predict.scale_model import Workload

    _, doc = bench
    doc = json.loads(json.dumps(doc))
    doc["settings"]["tiny"], doc["machine"]["device"] = False, "NVIDIA H200"
    path = tmp_path / "layer_bench.json"
    path.write_text(json.dumps(doc))
    flagship = lb.cases(tiny=True)[0]
    tiny = lb.flavor_args(flagship)
    monkeypatch.setitem(deepseekv3_args, "tiny", tiny)
    layout = Layout(4, 1, 4, 1, 4, 1, 1, 1, flagship.ep, 1)
    w = Workload("tiny", tiny, layout, 1, flagship.seq_len, 1, "full", (), "node_limited", 20)
    c = layer_compute.rank_ms(layer_compute.load(path), w, "H200", tuple(range(tiny.n_layers)), True, True)
    part = {p["name"]: p for p in doc["parts"] if p["case"] == "flagship"}
    core = part["attention.core.sdpa"]
    per_layer = core["ms"]["fwd"]["median"] + core["ms"]["bwd"]["median"] + max(core["ms"]["recompute"], 0.0)
    assert sum(c.terms["attention"]) == pytest.approx(tiny.n_layers * per_layer)
    assert any("SDPA's time stands in" in n for n in c.notes)  # no FlexAttention on a CPU
    assert set(c.parts) == set(layer_compute.PARTS)


def test_documents_are_the_datas_packed_as_torchtitan_packs_them(bench):
    """Each case records the pieces its block-causal parts run: one document, fixed 512-token
    documents, and TorchTitan's packing of each distribution (seed lb.DOC_SEED)."""
    from moe_comm.predict import documents

    _, doc = bench
    assert set(doc["documents"]) == set(lb.DOC_DISTRIBUTIONS)
    assert doc["documents"]["c4_en"]["mean"] == pytest.approx(documents.C4_EN.mean)
    for name, c in doc["cases"].items():
        S, B = c["seq_len"], c["sequences"]
        seen = c["documents"]
        assert seen["one"] == {"pieces": B, "kept_pairs": B * S * (S + 1) // 2, "longest": S, "seed": None}
        assert seen[f"docs{lb.DOC_TOKENS}"]["kept_pairs"] == B * lb.causal_pairs(S, lb.DOC_TOKENS)
        for dist in lb.DOC_DISTRIBUTIONS:
            pieces = documents.packed(lb.document_distribution(dist), B, S, seed=lb.DOC_SEED)
            assert seen[dist]["kept_pairs"] == sum(documents.kept_pairs(p) for p in pieces), (name, dist)
            assert seen[dist]["pieces"] == sum(len(p) for p in pieces)


def test_attention_choice_names_the_faster_kernel():
    parts = []
    for impl, fwd, bwd in (("flex", 1.0, 4.0), ("varlen", 1.2, 3.0)):
        parts.append({"case": "flagship", "name": f"attention.core.{impl}.c4_en", "status": "ok",
                      "shape": {"documents": "c4_en", "pieces": 9},
                      "ms": {"fwd": {"median": fwd}, "bwd": {"median": bwd}}})
    (c,) = lb.attention_choice({"parts": parts})
    assert c["faster"] == "varlen" and c["full_ac_ratio"] == pytest.approx(6.0 / 5.4)
    assert lb.attention_choice({"parts": parts[:1]}) == []  # varlen not measured: no choice
def test_fp8_experts_are_timed_step_by_step_against_bf16(bench):
    """The project's FP8 experts: every step of their forward and backward timed (what the
    benchmark's JSON says about quantisation against GEMMs), and set against bf16 in the report."""
    from moe_comm import fp8_experts

    _, doc = bench
    fp8_steps = {"weights", "gemm_13", "gate", "gemm_2", "quantise_dy", "weights_t_2", "dgrad_h", "gate_backward",
                 "weights_t_13", "dgrad_x", "wgrad_operands", "wgrad_gemm"}
    for case in ("flagship", "nebius"):
        for variant in ("moe_comm_fp8", "moe_comm_fp8_bf16_wgrad"):
            for routing in ("balanced", "node_limited"):
                p = next(q for q in doc["parts"] if (q["case"], q["name"]) == (case, f"experts.{variant}.{routing}"))
                assert set(p["breakdown"]["steps_ms"]) == fp8_steps
                assert set(p["breakdown"]["kinds_ms"]) == set(lb.FP8_STEP_KINDS)
                assert all(v > 0 for v in p["breakdown"]["steps_ms"].values())
                assert p["shape"]["align"] == fp8_experts.ROW_ALIGN and p["shape"]["wgrad"] == ("fp8" if variant == "moe_comm_fp8" else "bf16")
    lines = lb.fp8_experts_against_bf16(doc)
    assert len(lines) == 12 and all("x bf16's" in line and "target <= 0.75x" in line for line in lines)
    # the cached part: whole steps of microbatches (--tiny: 2), the weights changed at each step's
    # start, so its mean per microbatch shares one quantisation out over the step
    for case in ("flagship", "nebius"):
        for routing in ("balanced", "node_limited"):
            p = next(q for q in doc["parts"] if (q["case"], q["name"]) == (case, f"experts.moe_comm_fp8_cached.{routing}"))
            assert len(p["ms"]["fwd"]["samples"]) % 2 == 0 and "once per step of 2 microbatches" in p["note"]
    assert sum("once per 2 microbatches, mean per microbatch" in line for line in lines) == 4
