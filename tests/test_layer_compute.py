"""moe_comm.predict.layer_compute on a made-up layer benchmark (every part's time invented, so
each rule can be redone on paper): a workload at a measured shape sums its parts, other shapes
scale by their work, other GPUs by datasheet peak ratios, AC modes by the stated rules; the
refusals; the step model's compute terms come from it once a benchmark is recorded; and neither
loading nor pricing reads the anchors' table."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from moe_comm.predict import calibration, estimate, layer_compute, scale_model
from moe_comm.predict.assumptions import VALIDATION
from moe_comm.predict.calibration import Calibration, OpCost
from moe_comm.predict.routing_plan import routing_statistics

NAMES = ["rmsnorm", "residual_add", "router", "embedding", "shared_expert", "dense_ffn", "output_loss",
         "attention.module.flex", "attention.core.flex", "attention.module.sdpa", "attention.core.sdpa",
         *[f"experts.{d}.{r}" for d in ("bf16", "fp8", "fp8.compiled") for r in ("balanced", "node_limited")]]
# made-up (fwd ms, bwd ms, recompute ms) per part: distinct so a wrong pick shows
TIMES = {n: (1.0 + i, 2.0 * (1.0 + i), 1.5 + i) for i, n in enumerate(NAMES)}
for impl in ("flex", "sdpa"):  # the module holds its kernel: 5 ms more forward, 9 backward, 4 recompute
    core = TIMES[f"attention.core.{impl}"]
    TIMES[f"attention.module.{impl}"] = (core[0] + 5.0, core[1] + 9.0, core[2] + 4.0)
CEILINGS = {"bf16_gemm": {"tflops": 700.0}, "fp8_rowwise_gemm": {"tflops": 1100.0}, "copy": {"tbs": 4.2}}


def _case(name, seq, tp, routing):
    tokens_sp = seq // tp
    rows = {}
    for r in ("balanced", "node_limited"):
        st = routing_statistics(r, 32, 8, 256, 8)
        rows[r] = {"rows": st.max["expert_rows"] * tokens_sp}
    return {"name": name, "flavor": "671B", "seq_len": seq, "sequences": 1, "tp": tp, "ep": 32, "routing": routing,
            "tokens": seq, "tokens_sp": tokens_sp, "received_rows": rows}


def _part(case, name, t):
    return {"case": case, "name": name, "status": "ok", "ms": {"fwd": {"median": t[0]}, "bwd": {"median": t[1]},
                                                              "recompute": t[2]}}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    cases = {"flagship": _case("flagship", 4096, 1, "node_limited"), "nebius": _case("nebius", 8192, 2, "balanced")}
    parts = [_part(c, n, (t[0] * k, t[1] * k, t[2] * k)) for c, k in (("flagship", 1.0), ("nebius", 3.0))
             for n, t in TIMES.items()]
    doc = {"schema": layer_compute.SCHEMA, "settings": {"tiny": False}, "machine": {"device": "NVIDIA H200"},
           "peaks": {"measured": CEILINGS}, "cases": cases, "parts": parts}
    path = tmp_path_factory.mktemp("lc") / "layer_bench.json"
    path.write_text(json.dumps(doc))
    return layer_compute.load(path)


def _workload(tp=1, pp=8, seq=4096, microbatch=1, ac="none", converters=(), routing="node_limited"):
    spec = {"gpu": "B200", "nodes": 32, "gpus_per_node": 8,
            "workload": {"flavor": "671B", "tp": tp, "pp": pp, "ep": 32, "local_batch": 8 * microbatch,
                         "seq_len": seq, "microbatch": microbatch, "ac_mode": ac, "routing": routing,
                         "converters": list(converters)}}
    return scale_model.workload_from_spec(spec)[0]


def _f(name):  # fwd + bwd of a part at the flagship case
    return TIMES[name][0] + TIMES[name][1]


# a rank of the flagship's first stage: layers 0-7 (3 dense, 5 MoE) and the embedding
FIRST = dict(layers=tuple(range(8)), embedding=True, output=False)


def _rank(bench, w, gpu="H200", layers=FIRST["layers"], embedding=True, output=False):
    return layer_compute.rank_ms(bench, w, gpu, layers, embedding, output)


def test_at_the_measured_shape_the_parts_add_up(bench):
    c = _rank(bench, _workload())
    n, moe, dense = 8, 5, 3
    proj = _f("attention.module.flex") - _f("attention.core.flex")  # the module less its kernel
    assert c.parts["attention.projections"] == pytest.approx(n * proj)
    core = TIMES["attention.core.flex"]
    assert c.terms["attention"] == pytest.approx([n * core[0], n * core[1], 0.0])  # its backward is all bi
    assert sum(c.terms["memory-bound"]) == pytest.approx(2 * n * (_f("rmsnorm") + _f("residual_add"))
                                                         + moe * _f("router") + _f("embedding"))
    gemm_fwd = (n * (TIMES["attention.module.flex"][0] - core[0]) + moe * (TIMES["shared_expert"][0]
                + TIMES["experts.bf16.node_limited"][0]) + dense * TIMES["dense_ffn"][0])
    f, bi, bw = c.terms["gemm"]
    assert f == pytest.approx(gemm_fwd)
    assert bi == pytest.approx(bw) and f + bi + bw == pytest.approx(
        n * proj + moe * (_f("shared_expert") + _f("experts.bf16.node_limited")) + dense * _f("dense_ffn"))
    assert "output_loss" not in c.parts  # the last stage's
    last = _rank(bench, _workload(), layers=tuple(range(53, 61)), embedding=False, output=True)
    assert last.parts["output_loss"] == pytest.approx(_f("output_loss")) and "dense_ffn" not in last.parts
    assert c.moe_layer_fwd == {"shared_expert": TIMES["shared_expert"][0],
                               "experts": TIMES["experts.bf16.node_limited"][0]}


def test_other_gpus_scale_by_datasheet_peaks(bench):
    h = _rank(bench, _workload(converters=("quantize.grouped_mm.float8",)))
    b = _rank(bench, _workload(converters=("quantize.grouped_mm.mx",)), "B200")
    assert b.parts["rmsnorm"] == pytest.approx(h.parts["rmsnorm"] * 4.8 / 8.0)  # HBM
    assert b.parts["attention.core"] == pytest.approx(h.parts["attention.core"] * 989 / 2250)  # bf16 dense
    assert b.parts["experts"] == pytest.approx(h.parts["experts"] * 1979 / 4500)  # MXFP8 at the FP8 rate
    # float8 experts: the compiled part, as the float8 recipes run them
    assert h.parts["experts"] == pytest.approx(5 * _f("experts.fp8.compiled.node_limited"))
    assert any("MXFP8" in n for n in b.notes)
    fp8_linear = _rank(bench, _workload(converters=("quantize.linear.float8",)))
    bf16 = _rank(bench, _workload())
    assert fp8_linear.parts["shared_expert"] == pytest.approx(bf16.parts["shared_expert"] * 700 / 1100)


def test_activation_checkpointing_rules(bench):
    none = _rank(bench, _workload())
    full = _rank(bench, _workload(ac="full"))
    sel = _rank(bench, _workload(ac="selective"))
    last_none = _rank(bench, _workload(), layers=(60,), embedding=False, output=True)
    last_full = _rank(bench, _workload(ac="full"), layers=(60,), embedding=False, output=True)
    assert full.parts["rmsnorm"] - none.parts["rmsnorm"] == pytest.approx(2 * 8 * TIMES["rmsnorm"][2])
    assert full.recompute["memory-bound"] > 0 and none.recompute["memory-bound"] == 0
    assert last_full.parts["output_loss"] == last_none.parts["output_loss"]  # outside the checkpointed blocks
    # the recompute runs before the input gradient: in bi
    assert full.terms["attention"][1] - none.terms["attention"][1] == pytest.approx(8 * TIMES["attention.core.flex"][2])
    # op SAC: memory-bound ops and grouped GEMMs re-run, half the linear mm forward, attention saved
    assert sel.parts["rmsnorm"] - none.parts["rmsnorm"] == pytest.approx(2 * 8 * TIMES["rmsnorm"][0])
    assert sel.parts["experts"] - none.parts["experts"] == pytest.approx(5 * TIMES["experts.bf16.node_limited"][0])
    assert sel.parts["shared_expert"] - none.parts["shared_expert"] == pytest.approx(0.5 * 5 * TIMES["shared_expert"][0])
    assert sel.parts["attention.core"] == none.parts["attention.core"]


def test_other_shapes_scale_by_their_work(bench):
    one = _rank(bench, _workload())
    two = _rank(bench, _workload(microbatch=2))
    for part in ("rmsnorm", "attention.core", "shared_expert", "embedding"):
        assert two.parts[part] == pytest.approx(2 * one.parts[part])  # two sequences: twice the work
    assert two.parts["experts"] == pytest.approx(2 * one.parts["experts"], rel=0.02)  # rows of 8192 tokens
    long = _rank(bench, _workload(seq=8192))  # TP 1: the flagship case
    pairs = 8192 * 8193 / (4096 * 4097)
    assert long.parts["attention.core"] == pytest.approx(pairs * one.parts["attention.core"])
    assert long.parts["rmsnorm"] == pytest.approx(2 * one.parts["rmsnorm"])
    tp2 = _rank(bench, _workload(tp=2, pp=2, seq=8192, routing="balanced"), layers=tuple(range(31)))
    # the TP 2 case at its own shape: its parts (3x the flagship's here), balanced experts
    assert tp2.parts["router"] == pytest.approx(28 * 3 * _f("router"))
    assert tp2.parts["experts"] == pytest.approx(28 * 3 * _f("experts.bf16.balanced"))


def test_refusals(bench, tmp_path):
    with pytest.raises(layer_compute.NotCovered, match="no case at TP 4"):
        _rank(bench, _workload(tp=4))
    with pytest.raises(ValueError, match="need a B200"):
        _rank(bench, _workload(converters=("quantize.grouped_mm.mx",)))
    w16 = replace(_workload(), args=scale_model.workload_from_spec(
        {"gpu": "H200", "nodes": 1, "gpus_per_node": 2, "workload": {
            "flavor": "16B", "ep": 2, "local_batch": 1, "seq_len": 4096, "ac_mode": "full", "routing": "random"}})[0].args)
    with pytest.raises(layer_compute.NotCovered, match="differs in"):
        _rank(bench, w16)
    rank = estimate.pipeline_ranks(w16.args, w16.layout, 8, 1, "1F1B")[0]
    assert layer_compute.priced(bench, w16, "H200", rank) is None  # the step model then uses the fitted terms
    gone = replace(bench, parts={k: v for k, v in bench.parts.items() if k != ("flagship", "dense_ffn")})
    with pytest.raises(ValueError, match="dense_ffn not measured.*--resume"):
        _rank(gone, _workload())
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps({"schema": layer_compute.SCHEMA, "settings": {"tiny": True}}))
    with pytest.raises(ValueError, match="--tiny smoke run"):
        layer_compute.load(tiny)


def test_step_model_takes_its_compute_from_the_bench(bench):
    cal = Calibration(
        p2p_gbps=400.0, nvlink_copy_efficiency=1.0, kernel_floor_us=10.0,
        ops={"dispatch": OpCost(0.5, 1.0), "combine": OpCost(0.25, 2.0)},
        deepep_ops={"dispatch": OpCost(0.5, 3.0), "combine": OpCost(0.25, 4.0)},
        expand=(0.001, 0.002), reduce=(0.003, 0.004), layout_hbm_efficiency=0.5,
        nccl_call_us=1000.0, nccl_row_us=0.02, nccl_backward_row_us=0.04,
        gemm_efficiency=0.5, attention_efficiency=0.25, memory_bytes_factor=2.0, idle_ratio=0.1, layer_bench=bench)
    w = _workload(pp=1, ac="full")  # one pipeline rank: every layer, the embedding and the output
    cluster = scale_model.cluster_for("B200", 32, 8, cal)
    p = scale_model.predict("nvshmem", w, cluster, cal)
    c = _rank(bench, w, "B200", layers=tuple(range(61)), embedding=True, output=True)
    for term in ("gemm", "attention", "memory-bound"):
        assert p.terms_ms[term] == pytest.approx(sum(c.terms[term]))
        assert p.recompute_ms[term] == pytest.approx(c.recompute[term])
    assert p.compute_source == "layer bench"
    fitted = scale_model.predict("nvshmem", w, cluster, replace(cal, layer_bench=None))
    assert fitted.compute_source == "fitted" and fitted.terms_ms["gemm"] != pytest.approx(p.terms_ms["gemm"])


def test_pricing_never_reads_the_anchors(bench, monkeypatch):
    """Issue 24: the anchors are read only for the validation table - not by loading the bench,
    not by pricing a workload shaped like theirs."""
    read = Path.read_text

    def guarded(path, *args, **kwargs):
        assert Path(path).resolve() != VALIDATION.resolve(), "the layer model read the validation table"
        return read(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", guarded)
    again = layer_compute.load(bench.path)
    c = _rank(again, _workload(tp=2, pp=2, seq=8192, ac="full", routing="balanced"), "B200", layers=tuple(range(31)))
    assert c.total > 0
    names = " ".join(a.name + a.source for a in layer_compute.assumptions(again)).lower()
    assert "nebius" not in names and "anchor" not in names and "fitted" not in names


def test_calibration_loads_a_recorded_bench(bench, monkeypatch):
    monkeypatch.setattr(layer_compute, "BENCH", bench.path)
    calibration.calibrate.cache_clear()
    try:
        cal = calibration.calibrate()
    finally:
        calibration.calibrate.cache_clear()
    assert cal.layer_bench is not None and cal.layer_bench.path == bench.path
    assert any("layer parts measured" in a.name for a in cal.assumptions)
