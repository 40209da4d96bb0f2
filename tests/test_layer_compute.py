"""moe_comm.predict.layer_compute on a made-up layer benchmark (tests/layer_bench_fakes.py: every
part's time invented, so each rule can be redone on paper): a workload at a measured shape sums
its parts, other shapes, TP degrees and flavors scale by their work, other GPUs by datasheet peak
ratios, float8 by the measured ceilings where the compiled part is missing, AC modes by the
stated rules; what was not run is said; the refusals; the step model's compute terms are its;
and neither loading nor pricing reads the anchors' table."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from layer_bench_fakes import CEILINGS, FP8_KINDS, TIMES, hand_calibration, kept_pairs, write_bench
from moe_comm.predict import calibration, documents, layer_compute, scale_model
from moe_comm.predict.assumptions import VALIDATION
from moe_comm.predict.routing_plan import routing_statistics


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return write_bench(tmp_path_factory.mktemp("lc") / "layer_bench.json")


def _workload(tp=1, pp=8, seq=4096, microbatch=1, ac="none", converters=(), routing="node_limited", docs=None,
              **fields):
    """The 671B flavor at a layout; its attention over one document per sequence unless `docs`
    names the dataset's documents (c4_en, nltk_en)."""
    spec = {"gpu": "B200", "nodes": 32, "gpus_per_node": 8,
            "workload": {"flavor": "671B", "tp": tp, "pp": pp, "ep": 32, "local_batch": 8 * microbatch,
                         "seq_len": seq, "microbatch": microbatch, "ac_mode": ac, "routing": routing,
                         "converters": list(converters)}}
    w = scale_model.workload_from_spec(spec)[0]
    dist = {None: None, "c4_en": documents.C4_EN}.get(docs) or (docs and documents.load_measured()[docs])
    return replace(w, documents=dist, **fields)


def _f(name):  # fwd + bwd of a part at the flagship case
    return TIMES[name][0] + TIMES[name][1]


# a rank of the flagship's first stage: layers 0-7 (3 dense, 5 MoE) and the embedding
FIRST = dict(layers=tuple(range(8)), embedding=True, output=False)


def _rank(bench, w, gpu="H200", layers=FIRST["layers"], embedding=True, output=False, **kw):
    return layer_compute.rank_ms(bench, w, gpu, layers, embedding, output, **kw)


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
    # float8 experts: the compiled part, as the float8 recipes run them
    assert h.parts["experts"] == pytest.approx(5 * _f("experts.fp8.compiled.node_limited"))
    # MXFP8 is not that kernel: this project's FP8 experts measured on the H200, their GEMM steps at
    # the 8-bit peak ratio and their quantisation steps (a quarter, FP8_KINDS) at the HBM ratio, plus
    # the rows' quantisation (read bf16, write e4m3) at the measured copy rate scaled to the B200
    q = FP8_KINDS["quantise"] / sum(FP8_KINDS.values())
    scale = (1 - q) * 1979 / 4500 + q * 4.8 / 8.0
    rows = routing_statistics("node_limited", 32, 8, 256, 8).max["expert_rows"] * 4096
    quantise = rows * 7168 * 3 / (4.2e12 * 8.0 / 4.8) * 1e3
    assert b.parts["experts"] == pytest.approx(5 * (_f("experts.moe_comm_fp8.node_limited") * scale + quantise))
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


def test_float8_without_its_compiled_part_takes_the_measured_ceiling_ratio(tmp_path):
    """The device run measured the eager float8 grouped GEMM but not the compiled one the float8
    recipes run: the bf16 part x bf16 / fp8 ceilings stands in (never the eager figure), and the
    notes say so; on a B200, MXFP8 takes the same rule at the 8-bit peak ratio."""
    lacking = write_bench(tmp_path / "lb.json", skip=tuple(f"experts.{d}.{r}" for d in ("fp8.compiled", "moe_comm_fp8")
                                                        for r in ("balanced", "node_limited")))
    h = _rank(lacking, _workload(converters=("quantize.grouped_mm.float8",)))
    bf16 = _rank(lacking, _workload())
    ratio = CEILINGS["bf16_gemm"]["tflops"] / CEILINGS["fp8_rowwise_gemm"]["tflops"]
    assert h.parts["experts"] == pytest.approx(bf16.parts["experts"] * ratio)
    assert h.parts["experts"] != pytest.approx(5 * _f("experts.fp8.node_limited"))  # the eager part is not used
    assert layer_compute.FP8_GROUPED_NOTE in h.notes and layer_compute.FP8_GROUPED_NOTE not in bf16.notes
    b = _rank(lacking, _workload(converters=("quantize.grouped_mm.mx",)), "B200")
    assert b.parts["experts"] == pytest.approx(bf16.parts["experts"] * ratio * 1979 / 4500)
    assert layer_compute.MXFP8_ASSUMPTION.name in b.notes
    assert layer_compute.FP8_EXPERTS_NOTE.format(case="flagship") in b.notes


def test_what_was_not_run_stands_in_and_is_said(tmp_path):
    """FlexAttention's parts did not run on the device: SDPA's stand in at the same shape, noted."""
    noflex = write_bench(tmp_path / "lb.json", skip=("attention.core.flex", "attention.module.flex"))
    c = _rank(noflex, _workload())
    core = TIMES["attention.core.sdpa"]
    assert c.terms["attention"] == pytest.approx([8 * core[0], 8 * core[1], 0.0])
    assert any("flex not measured" in n and "SDPA's time stands in" in n for n in c.notes)


def test_another_flavor_and_tp_scale_by_their_work(bench):
    """16B's layer shapes (dim 2048, no q LoRA, 16 heads) from the 671B case: each part x the
    ratio of its work (flops, or tokens x dim); TP 4 from the TP 2 case; both noted."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    a16, a671 = deepseekv3_args["16B"], deepseekv3_args["671B"]
    w16 = replace(_workload(pp=1), args=a16)
    c = _rank(bench, w16, layers=(0, 1), embedding=False)
    dense = TIMES["dense_ffn"][0] + TIMES["dense_ffn"][1]
    # 8 sequences of the same length against the case's one
    assert c.parts["dense_ffn"] == pytest.approx(8 * dense * (a16.dim * a16.inter_dim) / (a671.dim * a671.inter_dim))
    norm = TIMES["rmsnorm"][0] + TIMES["rmsnorm"][1]
    assert c.parts["rmsnorm"] == pytest.approx(2 * 2 * 8 * norm * a16.dim / a671.dim)  # 8 sequences, 2 layers
    heads = lambda a: a.n_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)  # noqa: E731
    core = TIMES["attention.core.flex"][0] + TIMES["attention.core.flex"][1]
    assert c.parts["attention.core"] == pytest.approx(2 * 8 * core * heads(a16) / heads(a671))
    assert any("layer shapes differ" in n for n in c.notes)
    tp4 = _rank(bench, _workload(tp=4, pp=2, seq=8192, routing="balanced"), layers=tuple(range(31)))
    assert tp4.parts["dense_ffn"] == pytest.approx(3 * 3 * dense / 2)  # the TP 2 case's, half the hidden
    assert any("TP 4 not measured" in n for n in tp4.notes)


def test_refusals(bench, tmp_path):
    cp = replace(_workload(), layout=replace(_workload().layout, cp=2))
    with pytest.raises(layer_compute.NotCovered, match="context parallel"):
        _rank(bench, cp)
    with pytest.raises(ValueError, match="need a B200"):
        _rank(bench, _workload(converters=("quantize.grouped_mm.mx",)))
    gone = replace(bench, parts={k: v for k, v in bench.parts.items() if k != ("flagship", "dense_ffn")})
    with pytest.raises(ValueError, match="dense_ffn not measured.*--resume"):
        _rank(gone, _workload())
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps({"schema": layer_compute.SCHEMA, "settings": {"tiny": True}}))
    with pytest.raises(ValueError, match="--tiny smoke run"):
        layer_compute.load(tiny)


def test_step_model_takes_its_compute_from_the_bench(bench, tmp_path):
    cal = hand_calibration(bench)
    w = _workload(pp=1, ac="full")  # one pipeline rank: every layer, the embedding and the output
    cluster = scale_model.cluster_for("B200", 32, 8, cal)
    p = scale_model.predict("nvshmem", w, cluster, cal)
    c = _rank(bench, w, "B200", layers=tuple(range(61)), embedding=True, output=True)
    for term in ("gemm", "attention", "memory-bound"):
        assert p.terms_ms[term] == pytest.approx(sum(c.terms[term]))
        assert p.recompute_ms[term] == pytest.approx(c.recompute[term])
    assert p.compute_source == "layer bench"  # every part measured
    noflex = write_bench(tmp_path / "lb.json", skip=("attention.core.flex", "attention.module.flex"))
    q = scale_model.predict("nvshmem", w, cluster, hand_calibration(noflex))
    assert q.compute_source.startswith("layer bench (not measured there: attention kernel: flex")
    with pytest.raises(ValueError, match="layer benchmark"):
        scale_model.predict("nvshmem", w, cluster, hand_calibration(None))


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


def test_calibration_loads_the_recorded_bench_and_needs_it(bench, monkeypatch, tmp_path):
    monkeypatch.setattr(layer_compute, "BENCH", bench.path)
    calibration.calibrate.cache_clear()
    try:
        cal = calibration.calibrate()
        assert cal.layer_bench is not None and cal.layer_bench.path == bench.path
        assert any("layer parts measured" in a.name for a in cal.assumptions)
        # the fitted compute constants are gone: no GEMM, attention or memory-bound efficiency
        assert not [a for a in cal.assumptions if "efficiency" in a.name and "GEMM" in a.name]
        monkeypatch.setattr(layer_compute, "BENCH", tmp_path / "absent.json")
        calibration.calibrate.cache_clear()
        with pytest.raises(FileNotFoundError, match="absent.json.*layer_bench.py run"):
            calibration.calibrate()
    finally:
        calibration.calibrate.cache_clear()


def test_the_recorded_bench_prices_the_flagship_from_measured_parts():
    """results/model_inputs/layer_bench_h200x1.json as recorded on the device: every part the
    flagship's pricing looks for ran at its case - FlexAttention and variable-length attention at
    c4's documents, this project's FP8 experts - so its prediction needs no stand-in; the MXFP8
    recipe's grouped GEMM is the stated rule, and its compiled loss is the measured one
    (output_loss.loss_compiled, run 66), not the eager loss standing in."""
    from moe_comm import recipe

    bench = layer_compute.load()
    for part in ("attention.core.flex", "attention.module.flex", "attention.core.flex.c4_en",
                 "attention.core.varlen.c4_en", "experts.moe_comm_fp8.node_limited", layer_compute.LOSS_COMPILED):
        assert bench.part("flagship", part), part
    cal = calibration.calibrate()
    for path, says, never in (("recipes/deepseek_v3_671b_b200.toml", (), ("not measured", "MXFP8")),
                              ("recipes/deepseek_v3_671b_b200_mxfp8.toml",
                               ("B200 runs MXFP8 grouped GEMMs",),
                               ("flex", "varlen", "float8 grouped GEMM", "FP8 experts (experts.moe_comm_fp8) not",
                                "loss: compiled"))):
        r = recipe.load(path, [], device="cuda", check_paths=False)
        w = scale_model.workload_from_recipe(r)
        assert w.documents is documents.C4_EN  # the recipes train on c4
        p = scale_model.predict("nvshmem", w, scale_model.cluster_for("B200", 32, 8, cal), cal)
        assert all(x in p.compute_source for x in says) and not any(x in p.compute_source for x in never), \
            p.compute_source


# --- attention as the data has it, the router, the GPU's share of peak, imbalance, FP8 experts ---


def _core(c):
    return c.parts["attention.core"]


def test_block_causal_attention_is_priced_at_the_datasets_documents(bench):
    """The 671B flavor's block-causal FlexAttention over c4's documents: the kernel measured at c4's
    lengths, scaled by the pairs a packed sequence keeps on average over the one the bench ran."""
    one = _rank(bench, _workload())
    c4 = _rank(bench, _workload(docs="c4_en"))
    pairs = layer_compute.kept_pairs_per_sequence(documents.C4_EN, 4096)
    assert pairs < 0.25 * 4096 * 4097 / 2  # documents of ~430 tokens keep about a fifth of the causal pairs
    expect = 8 * _f("attention.core.flex.c4_en") * pairs / kept_pairs(4096, "c4_en")
    assert _core(c4) == pytest.approx(expect)
    assert _core(one) == pytest.approx(8 * _f("attention.core.flex"))  # a causal flavor: one document
    # a varlen flavor runs (and is priced at) the variable-length kernel
    varlen = _rank(bench, _workload(docs="c4_en", args=replace(_workload().args, attn_type="varlen")))
    assert _core(varlen) == pytest.approx(8 * _f("attention.core.varlen.c4_en") * pairs / kept_pairs(4096, "c4_en"))
    assert varlen.parts["attention.projections"] == pytest.approx(
        8 * (_f("attention.module.varlen") - _f("attention.core.varlen")))
    # the staged real text: its own measured part
    real = _rank(bench, _workload(docs="nltk_en"))
    dist = documents.load_measured()["nltk_en"]
    assert _core(real) == pytest.approx(8 * _f("attention.core.flex.nltk_en")
                                        * layer_compute.kept_pairs_per_sequence(dist, 4096) / kept_pairs(4096, "nltk_en"))


def test_documents_not_measured_take_the_nearest_part_by_kept_pairs(tmp_path):
    """c4's part did not run: the 512-token documents' part stands in, by kept pairs x heads, and
    the notes say so; the Nebius shape, whose case did not run at all, takes the flagship's part by
    the same rule (TP 2: half the heads; seq 8192: its own packing)."""
    no_c4 = write_bench(tmp_path / "a.json", skip=("attention.core.flex.c4_en",))
    c = _rank(no_c4, _workload(docs="c4_en"))
    pairs = layer_compute.kept_pairs_per_sequence(documents.C4_EN, 4096)
    assert _core(c) == pytest.approx(8 * _f("attention.core.flex.docs512") * pairs / kept_pairs(4096, "docs512"))
    assert any("flex at c4_en not measured" in n and "docs512" in n for n in c.notes)
    flagship_only = write_bench(tmp_path / "b.json", cases=("flagship",))
    neb = _rank(flagship_only, _workload(tp=2, pp=2, seq=8192, routing="balanced", docs="c4_en"), layers=(10,))
    expect = _f("attention.core.flex.c4_en") * (layer_compute.kept_pairs_per_sequence(documents.C4_EN, 8192) * 64) / (
        kept_pairs(4096, "c4_en") * 128)
    assert _core(neb) == pytest.approx(expect)
    assert any("TP 2 not measured" in n for n in neb.notes)


def test_the_router_is_launch_bound(bench):
    """Measured taking about as long at 8192 tokens as at 4096, the router's time is its measured
    time on any GPU (no HBM ratio, no peak share) up to the measured tokens, and grows beyond them."""
    h = _rank(bench, _workload())
    b = _rank(bench, _workload(), "B200")
    assert b.parts["router"] == pytest.approx(h.parts["router"]) == pytest.approx(5 * _f("router"))
    assert _rank(bench, _workload(), "B200", peak_share=0.5).parts["router"] == pytest.approx(b.parts["router"])
    two = _rank(bench, _workload(microbatch=2), "B200")
    assert two.parts["router"] == pytest.approx(2 * b.parts["router"])


def test_another_gpus_share_of_peak_scales_every_part_but_the_router(bench):
    b = _rank(bench, _workload(), "B200")
    low = _rank(bench, _workload(), "B200", peak_share=0.85)
    for part in ("rmsnorm", "attention.core", "experts", "shared_expert", "embedding"):
        assert low.parts[part] == pytest.approx(b.parts[part] / 0.85), part
    same = _rank(bench, _workload(), "H200", peak_share=0.85)  # the measured GPU is what it measured
    assert same.parts["experts"] == pytest.approx(_rank(bench, _workload()).parts["experts"])


def test_the_busiest_rank_factor_scales_the_experts(bench):
    st = routing_statistics("node_limited", 32, 8, 256, 8)
    drawn = _rank(bench, _workload())
    skewed = _rank(bench, _workload(), imbalance=1.3)
    assert skewed.parts["experts"] == pytest.approx(drawn.parts["experts"] * 1.3 * st.mean["expert_rows"]
                                                    / st.max["expert_rows"])
    assert skewed.parts["shared_expert"] == pytest.approx(drawn.parts["shared_expert"])


def test_fp8_experts_on_hopper_are_their_measured_part(bench):
    """[moe_comm] expert_dtype = "fp8" on an H200: this project's FP8 experts as measured (the
    rows arrive in e4m3: nothing to add)."""
    c = _rank(bench, _workload(expert_dtype="fp8"))
    assert c.parts["experts"] == pytest.approx(5 * _f("experts.moe_comm_fp8.node_limited"))


def test_a_compiled_loss_is_its_measured_part(bench, tmp_path):
    """[compile] components "loss": the last stage's output + loss is the bench's part with
    TorchTitan's compiled loss; where that part did not run, the eager one stands in, said."""
    last = dict(layers=tuple(range(53, 61)), embedding=False, output=True)
    compiled = _rank(bench, _workload(loss_compiled=True), **last)
    assert compiled.parts["output_loss"] == pytest.approx(_f("output_loss.loss_compiled"))
    assert _rank(bench, _workload(), **last).parts["output_loss"] == pytest.approx(_f("output_loss"))
    assert not any("loss" in n for n in compiled.notes)
    lacking = write_bench(tmp_path / "lb.json", skip=("output_loss.loss_compiled",))
    eager = _rank(lacking, _workload(loss_compiled=True), **last)
    assert eager.parts["output_loss"] == pytest.approx(_f("output_loss"))
    assert layer_compute.LOSS_COMPILED_NOTE.format(case="flagship") in eager.notes
    stand_in = [a for a in layer_compute.assumptions(lacking) if a.name.startswith("a loss compiled")]
    assert len(stand_in) == 1 and "output_loss.loss_compiled (flagship)" in stand_in[0].source
    assert not any(a.name.startswith("a loss compiled") for a in layer_compute.assumptions(bench))


def test_a_recipe_compiles_its_loss_where_its_compile_names_the_loss():
    from moe_comm import recipe

    def compiles_loss(path, overrides=()):
        r = recipe.load(path, list(overrides), device="cuda", check_paths=False)
        return scale_model.workload_from_recipe(r).loss_compiled

    assert compiles_loss("recipes/deepseek_v3_671b_b200_mxfp8.toml")  # [compile] enable, model and loss
    one = "recipes/deepseek_v3_671b_h200x1.toml"
    assert not compiles_loss(one)  # [compile] enable = false
    assert compiles_loss(one, ["--compile.enable", "--compile.components", "loss"])
    assert not compiles_loss(one, ["--compile.enable", "--compile.components", "model"])
