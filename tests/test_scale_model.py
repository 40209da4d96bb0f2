"""The scale model on hand-computed layouts (made-up constants and a made-up layer benchmark, so
every number below can be redone on paper), and its calibration against the measured figures
(2xH200 and the one-GPU recipe on one H200)."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
from torchtitan.models.moe import MoEArgs

import layer_bench_fakes
from moe_comm.layout import Layout
from moe_comm.predict import calibration, estimate, layer_compute, scale_model, validation
from moe_comm.predict.assumptions import VALIDATION
from moe_comm.predict.calibration import Calibration
from moe_comm.predict.scale_model import Cluster, GPUSpec, Workload

META = 128  # csrc/common/wire.h kNetMetaBytes


def hand_calibration() -> Calibration:
    """Made-up communication constants; compute from the made-up layer benchmark."""
    return layer_bench_fakes.hand_calibration(layer_bench_fakes.made_up_bench())


@pytest.fixture
def two_by_two():
    """W = 4 ranks on 2 nodes of 2, 8 experts (2 per rank), top-2, hidden 1024, 1024 tokens per
    rank, balanced (round-robin) routing: token t picks experts 2t, 2t+1 (mod 8), both on rank
    t % 4, so every token hits exactly one rank; for any source, half its tokens go to the other
    node. NVLink copy rate 400 GB/s, a 50 GB/s NIC."""
    gpu = GPUSpec("H200", 1000.0, 2000.0, 4.8, 132, 400.0)
    cluster = Cluster(gpu, nodes=2, gpus_per_node=2, nvlink_copy_gbps=400.0, nic_gbps=50.0)
    args = scale_model.MoEShape(1024, MoEArgs(num_experts=8, top_k=2))
    lay = Layout(4, 2, 2, 1, 4, 1, 1, 1, 4, 1)
    w = Workload("hand", args, lay, 1, 1024, 1, "none", (), "balanced", num_sms=16)
    return w, cluster


def test_hierarchical_transfer_by_hand(two_by_two):
    w, cluster = two_by_two
    comm = scale_model.layer_comm("nvshmem", w, cluster, hand_calibration())
    d = comm.transfers[0]
    rb = 1024 * 2 + META
    # network: 1 row per token to the other node = 512 out; a forwarder receives 512
    # NVLink: 256 own tokens to the node's other rank + 256 forwarded (of the 512 arriving,
    # half are for the forwarder itself) = 512 out, 512 in
    assert (d.network_rows, d.nvlink_rows, d.row_bytes) == (512, 512, rb)
    assert d.fixed_us == pytest.approx(10 + 1.0 * (1024 + 512) / 16)  # floor + per token-SM
    # half of the 16 SMs drive NVLink: min(400, 35.5 x 8) GB/s x link efficiency 0.5
    assert d.nvlink_us == pytest.approx(512 * rb / (0.5 * 35.5 * 8 * 1e3))
    assert d.network_us == pytest.approx(512 * rb / (50 * 0.86 * 1e3))
    # expand: floor + 0.001 us per expert row (1024 x 2) + 0.002 per slot (1024), at hidden
    # 1024 instead of 7168 on the same HBM
    assert d.layout_us == pytest.approx((10 + 0.001 * 2048 + 0.002 * 1024) * 1024 / 7168)
    assert d.time_us == pytest.approx(d.fixed_us + d.network_us + d.layout_us)  # network-bound
    c = comm.transfers[1]
    assert c.fixed_us == pytest.approx(10 + 2.0 * 1536 / 16)
    assert c.layout_us == pytest.approx((10 + 0.003 * 2048 + 0.004 * 1024) * 1024 / 7168)
    # four transfers, each once without AC; the backward ones are priced as their mirrors
    assert [t.name for t in comm.transfers] == ["dispatch", "combine", "combine backward", "dispatch backward"]
    assert comm.transfers[2].time_us == pytest.approx(d.time_us)
    assert comm.time_us == pytest.approx(2 * (d.time_us + c.time_us))
    # TorchTitan's full AC runs both forward transfers again; ours replays them (no transfer)
    titan = scale_model.layer_comm("nvshmem", replace(w, ac_mode="full", recompute_comm=True), cluster,
                                   hand_calibration())
    assert titan.time_us == pytest.approx(3 * d.time_us + 3 * c.time_us)
    ours = scale_model.layer_comm("nvshmem", replace(w, ac_mode="full"), cluster, hand_calibration())
    assert ours.time_us == pytest.approx(comm.time_us)


def test_fp8_dispatch_halves_the_forward_dispatch_bytes_only(two_by_two):
    w, cluster = two_by_two
    comm = scale_model.layer_comm("nvshmem", w, cluster, hand_calibration(), dispatch_dtype="fp8")
    assert comm.transfers[0].row_bytes == 1024 + 1024 / 128 * 4 + META
    assert {t.row_bytes for t in comm.transfers[1:]} == {1024 * 2 + META}


def test_all_to_all_transfer_by_hand(two_by_two):
    w, cluster = two_by_two
    comm = scale_model.layer_comm("nccl", w, cluster, hand_calibration())
    d = comm.transfers[0]
    # one row per pick, no dedup: 2 picks x 512 remote tokens over the network, 2 x 256 to the
    # node's other rank over NVLink; no slot metadata
    assert (d.network_rows, d.nvlink_rows, d.row_bytes) == (1024, 512, 2048)
    assert d.nvlink_us == pytest.approx(512 * 2048 / (290 * 1e3))  # NCCL's rate, same NVLink
    assert d.network_us == pytest.approx(1024 * 2048 / (43 * 1e3))
    assert d.host_us == 1000.0 and comm.transfers[1].host_us == 0.0  # one host round trip per layer
    assert d.layout_us == pytest.approx(0.02 / 2 * 2048 * 1024 / 7168)
    assert comm.transfers[3].layout_us == pytest.approx(0.04 / 2 * 2048 * 1024 / 7168)


def test_intranode_has_no_network_phase(two_by_two):
    w, cluster = two_by_two
    one_node = replace(w, layout=Layout(4, 1, 4, 1, 4, 1, 1, 1, 4, 1))
    d = scale_model.layer_comm("nvshmem", one_node, replace(cluster, nodes=1, gpus_per_node=4), hand_calibration()).transfers[0]
    # 3 of 4 tokens go to another rank, one row each; all 16 SMs drive NVLink
    assert d.network_rows == 0 and d.nvlink_rows == 768
    assert d.fixed_us == pytest.approx(10 + 1024 / 16)
    assert d.nvlink_us == pytest.approx(768 * (2048 + META) / (0.5 * 400 * 1e3))


def test_virtual_nodes_split_one_machine(two_by_two):
    w, _ = two_by_two
    v = replace(w, layout=Layout(4, 1, 4, 1, 4, 1, 1, 1, 4, 1), virtual_node_size=2)
    assert (v.ranks_per_node, v.ep_nodes) == (2, 2)


def test_step_terms_by_hand():
    """One node of 2 H200-like GPUs, the 16B flavor at 1 x 4096 without AC: compute terms are the
    layer benchmark's parts for the rank, the optimizer and the parameter copies bytes over the
    layout kernels' HBM rate, idle a share of the busy time, tokens/s and MFU follow."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    a = deepseekv3_args["16B"]
    cal = hand_calibration()
    gpu = GPUSpec("H200", 1000.0, 2000.0, 4.0, 132, 400.0)
    cluster = Cluster(gpu, 1, 2, 400.0, 50.0)
    lay = Layout(2, 1, 2, 1, 2, 1, 1, 1, 2, 1)
    w = Workload("16B", a, lay, 1, 4096, 1, "none", (), "random", num_sms=20)
    p = scale_model.predict("nvshmem", w, cluster, cal)
    T = 4096
    c = layer_compute.rank_ms(cal.layer_bench, w, "H200", tuple(range(a.n_layers)), True, True)
    for term in ("gemm", "attention", "memory-bound"):
        assert p.terms_ms[term] == pytest.approx(sum(c.terms[term]))
    assert "layer shapes differ" in p.compute_source  # 16B priced from the 671B parts by work
    rate = 0.5 * 4.0e12  # the layout kernels' share of the GPU's HBM
    assert p.terms_ms["optimizer"] == pytest.approx(40 * estimate.count_params(a).total / 2 / rate * 1e3)
    # FSDP 2 without PP: the all-gather copy-out twice and the reduce-scatter's fp32 cast, 14 B per
    # parameter of the rank's units
    assert p.terms_ms["param copies"] == pytest.approx(14 * estimate.rank_unsharded_params(a, lay, None) / rate * 1e3)
    assert p.terms_ms["moe comm"] == pytest.approx(p.comm.time_us * (a.n_layers - a.n_dense_layers) / 1e3)
    # the idle share applies to the GPU's own work, not to its waits on links, ranks or the bubble
    busy = sum(v for k, v in p.terms_ms.items() if k not in ("idle", *scale_model.WAITING_TERMS))
    waiting = sum(p.terms_ms[k] for k in scale_model.WAITING_TERMS)
    assert p.terms_ms["idle"] == pytest.approx(0.1 * busy) and p.terms_ms["moe comm"] > 0
    assert p.step_ms == pytest.approx(1.1 * busy + waiting)
    assert p.tokens_per_s_per_gpu == pytest.approx(T / (p.step_ms / 1e3))
    flops = estimate.count_params(a).flops_per_token(a, 4096)
    assert p.mfu == pytest.approx(100 * flops * p.tokens_per_s_per_gpu / 1000e12)
    assert p.terms_ms["pp bubble"] == 0 and p.terms_ms["tp comm"] == 0


def test_one_gpu_is_priced_at_ep_1():
    """The one-GPU recipe (world 1, EP 1): no link to cross, the backend's local work is its
    transfers' layout and fixed costs (nccl: its host sync and permutes); no FSDP, so the
    parameter copies are autocast's casts, 12 B per parameter but the embedding's."""
    cal = hand_calibration()
    spec = {"gpu": "H200", "recipe": "recipes/deepseek_v3_671b_h200x1.toml", "overrides": []}
    w, _ = scale_model.workload_from_spec(spec)
    assert (w.layout.world, w.layout.ep, w.ep_nodes) == (1, 1, 1)
    cluster = scale_model.cluster_for("H200", 1, 1, cal)
    ours, nccl = (scale_model.predict(b, w, cluster, cal) for b in ("nvshmem", "nccl"))
    assert ours.per_step("network_rows") == 0 and ours.per_step("nvlink_bytes") == 0
    assert all(t.nvlink_us == 0 and t.network_us == 0 for t in nccl.comm.transfers)
    assert nccl.comm.transfers[0].host_us == cal.nccl_call_us
    p = estimate.count_params(w.args)
    assert ours.terms_ms["param copies"] == pytest.approx(12 * (p.total - p.embedding) / (0.5 * 4.8e12) * 1e3)
    assert ours.terms_ms["fsdp exposed"] == 0 and ours.tokens_per_s_per_gpu > nccl.tokens_per_s_per_gpu


def test_one_gpu_with_a_loader_worker_takes_its_own_idle_share():
    """World 1 with a dataloader worker (the one-GPU recipe as it ships) idles at the one-GPU
    profile's share, in the central scenario only; without a worker, on two GPUs and at the
    range's ends the calibration's shares stand."""
    cal = replace(hand_calibration(), one_gpu_idle_ratio=0.02)
    spec = {"gpu": "H200", "recipe": "recipes/deepseek_v3_671b_h200x1.toml", "overrides": []}
    w, _ = scale_model.workload_from_spec(spec)
    assert w.loader_workers == 1  # the recipe's [training.dataloader] num_workers
    cluster = scale_model.cluster_for("H200", 1, 1, cal)

    def idle_share(workload, c=cal, scenario="central"):
        p = scale_model.predict("nvshmem", workload, cluster, c, scenario=scenario)
        busy = sum(v for k, v in p.terms_ms.items() if k not in ("idle", *scale_model.WAITING_TERMS))
        return p.terms_ms["idle"] / busy

    assert idle_share(w) == pytest.approx(0.02)
    assert idle_share(replace(w, loader_workers=0)) == pytest.approx(0.1)
    assert idle_share(w, replace(cal, one_gpu_idle_ratio=None)) == pytest.approx(0.1)
    two = replace(w, layout=Layout(2, 1, 2, 1, 2, 1, 1, 1, 2, 1))
    assert idle_share(two) == pytest.approx(0.1)
    ranged = replace(cal, inputs={s: replace(cal.scenario(), idle_ratio=r) for s, r in
                                  (("low", 0.3), ("central", 0.1), ("high", 0.05))})
    assert (idle_share(w, ranged, "low"), idle_share(w, ranged, "high")) == pytest.approx((0.3, 0.05))


def test_pipeline_bubble_and_microbatches():
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    a = deepseekv3_args["16B"]
    gpu = GPUSpec("H200", 1000.0, 2000.0, 4.0, 132, 400.0)
    lay = Layout(16, 2, 8, 1, 4, 1, 1, 4, 4, 1)
    w = Workload("16B", a, lay, 8, 4096, 1, "full", (), "random", num_sms=20)
    p = scale_model.predict("nvshmem", w, Cluster(gpu, 2, 8, 400.0, 50.0), hand_calibration())
    assert w.microbatches == 8 and w.tokens_per_call == 4096
    per_micro = sum(p.terms_ms[k] for k in ("gemm", "attention", "memory-bound", "moe comm", "tp comm", "pp p2p")) / 8
    assert p.terms_ms["pp bubble"] == pytest.approx(3 * per_micro)  # (pp - 1) microbatch-stages, 1F1B
    # TorchTitan's split of 27 layers + embedding + output over 4 stages: layers 0-6, 7-13, 14-20,
    # 21-26; a step is the busiest rank's microbatches (which one depends on the made-up parts)
    ranks = estimate.pipeline_ranks(a, lay, 8, 1, "1F1B")
    assert [r.layers for r in ranks] == [tuple(range(0, 7)), tuple(range(7, 14)), tuple(range(14, 21)),
                                         tuple(range(21, 27))]
    assert p.moe_calls_per_step / 8 in {sum(1 for i in r.layers if i >= a.n_dense_layers) for r in ranks}
    assert p.per_step("network_rows") == pytest.approx(p.comm.total("network_rows") * p.moe_calls_per_step)


def test_bad_backend_and_gpu():
    with pytest.raises(ValueError, match="backend 'ucx'"):
        scale_model.layer_comm("ucx", None, None, None)
    with pytest.raises(ValueError, match="GPU 'A100'"):
        scale_model.gpu_spec("A100")


# --- against the measurements ---------------------------------------------------------------


@pytest.fixture(scope="module")
def validated():
    cal = calibration.calibrate()
    return cal, {r.id: r for r in validation.validate(cal)}


def test_every_figure_resolves_and_the_table_is_data(validated):
    _, rows = validated
    figures = validation.load_figures()
    assert len(rows) == len(figures) and len({f["id"] for f in figures}) == len(figures)
    assert {r.kind for r in rows.values()} == {"comm_bench", "training", "memory", "anchor"}
    assert all(r.use in ("held out", "calibration") or r.use.startswith("calibration (") for r in rows.values())


def test_comm_bench_held_out_within_6_percent(validated):
    _, rows = validated
    held = [r for r in rows.values() if r.kind == "comm_bench" and r.use == "held out"]
    assert len(held) == 8
    assert max(abs(r.error_pct) for r in held) < 6.0


def test_671b_layers_nvshmem_training_within_8_percent(validated):
    """The 671B-shaped layers on 2xH200: their compute is priced by the one-GPU layer benchmark,
    which no figure of these runs touched (their profile gives the idle share only), so every
    run is a test of it; the model is 3-7% fast (parts timed alone leave out some of what a
    step runs between them)."""
    _, rows = validated
    runs = [r for r in rows.values() if r.kind == "training" and "671b_layers_h200x2-nvshmem" in r.id]
    assert len(runs) >= 9
    assert max(abs(r.error_pct) for r in runs) < 8.0
    # without memory pressure (2 x 4096, 4 x 2048) the nccl path too: within 3% while the idle share
    # applied to its exposed communication; 3.6% since it applies to compute only (its per-call cost
    # is a measured round trip, its host waits included)
    light = [r for r in rows.values() if r.kind == "training" and ("nccl-b2-s4096" in r.id or "nccl-b4-s2048" in r.id)]
    assert light and max(abs(r.error_pct) for r in light) < 4.0


def test_memory_within_3_percent_for_bf16_runs(validated):
    _, rows = validated
    bf16 = [r for r in rows.values() if r.kind == "memory" and "float8" not in r.id and "h200x2" in r.id]
    assert len(bf16) == 16
    assert max(abs(r.error_pct) for r in bf16) < 3.0


def test_one_gpu_memory_and_throughput_held_out(validated):
    """The one-GPU recipe on one H200 (world 1: no fully_shard, autocast): every measured peak in
    use within 8% (issue 24's bound) - AC none / selective / full, local batch 1 and 2, nccl and
    nvshmem - and its training throughput within 8%."""
    _, rows = validated
    mem = [r for r in rows.values() if r.kind == "memory" and "h200x1" in r.id and r.id.endswith("/in")]
    assert len(mem) >= 6 and {"none", "selective", "full"} <= {r.id.split("-ac")[-1].split("-")[0].split("/")[0]
                                                                 for r in mem}
    assert all(r.use == "held out" for r in mem)
    assert max(abs(r.error_pct) for r in mem) < 8.0
    # the runs of 2026-12-02 are predicted as `check` estimates them now: the per-call CUDA
    # graphs' pools (measured 8.1 GiB apart with and without) and the comm-free recompute's keep
    one = "memory/deepseek_v3_671b_h200x1-nvshmem-b2-"
    with_graphs, without = rows[one + "acnone-graphs/in"], rows[one + "acnone-nographs/in"]
    assert with_graphs.measured - without.measured == pytest.approx(8.1, abs=0.1)
    assert with_graphs.predicted - without.predicted == pytest.approx(with_graphs.measured - without.measured, abs=1.0)
    assert rows[one + "acfull-commkept/in"].predicted > rows["memory/deepseek_v3_671b_h200x1-nvshmem-b2-acfull/in"].predicted
    tps = [r for r in rows.values() if r.kind == "training" and "h200x1" in r.id]
    assert {r.id.rsplit("/", 1)[1] for r in tps} >= {"nccl", "nvshmem"}
    assert max(abs(r.error_pct) for r in tps) < 8.0


def test_allocator_cache_constants_match_their_fits():
    assert validation.fit_allocator_cache() == pytest.approx(
        estimate.ALLOCATOR_CACHE_BYTES_PER_OUTPUT_PARAM, abs=1.0)
    assert validation.fit_allocator_cache(sharded=False) == pytest.approx(
        estimate.ALLOCATOR_CACHE_BYTES_PER_OUTPUT_PARAM_UNSHARDED, abs=0.1)


def test_nothing_is_fitted_to_the_nebius_anchors(validated, monkeypatch):
    """Issue 24: the anchors are read only for the validation table. They are all held out, no
    constant names them, the B200 runs at the H200's measured GEMM efficiency, and calibrating
    never opens the validation table."""
    cal, rows = validated
    anchors = [r for r in rows.values() if r.kind == "anchor"]
    assert len(anchors) == 3 and all(r.use == "held out" for r in anchors)
    assert not [a for a in cal.assumptions if "fitted" in a.name.lower() or "anchor" in a.source.lower()]
    read = Path.read_text

    def guarded(path, *args, **kwargs):
        assert Path(path).resolve() != VALIDATION.resolve(), "calibration read the validation table"
        return read(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", guarded)
    calibration.calibrate.cache_clear()
    try:
        again = calibration.calibrate()
    finally:
        calibration.calibrate.cache_clear()
    assert again is not cal and again.idle_ratio == cal.idle_ratio and again.layer_bench.path == cal.layer_bench.path
    # the model still expects DeepEP to beat the all-to-all, and MXFP8 to add to it
    deepep = rows["anchor/nebius_671b_256xb200/deepep"]
    assert deepep.predicted > rows["anchor/nebius_671b_256xb200/standard"].predicted
    assert rows["anchor/nebius_671b_256xb200/deepep_mxfp8"].predicted > deepep.predicted


def test_calibration_lists_every_constant_with_a_source(validated):
    cal, _ = validated
    names = [a.name for a in cal.assumptions]
    assert len(names) == len(set(names))
    assert all(a.source for a in cal.assumptions)
    for needle in ("layer parts measured", "float8 rowwise linear GEMMs", "MXFP8", "link efficiency", "per-kernel floor",
                   "nccl path", "another GPU reaches"):
        assert any(needle in n for n in names), needle


# --- the overlap and the schedule in the step -------------------------------------------------


def test_overlap_exposure_by_hand():
    # a0 under s, a1 under e0, b0 under e1, b1 alone; no SM share: plain excesses
    assert scale_model.overlap_exposure((5, 4, 3, 2), (1, 6, 1), 0.0) == (4 + 0 + 2 + 2, 0.0)
    # with the comm kernels on a quarter of the SMs: a pair costs max(a - e, a / 4) beyond e
    exposed, slowdown = scale_model.overlap_exposure((5, 4, 3, 2), (1, 6, 1), 0.25)
    assert exposed == 8
    assert slowdown == pytest.approx(4 * 0.25)  # only (a1, e0) is compute-bound: a1 x share


def test_chunked_overlap_in_the_step(two_by_two):
    """The chunked overlap hides comm behind the experts and takes the per-call costs twice:
    exposed + hidden = what runs, and the hidden part is what overlap_exposure leaves."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    a = deepseekv3_args["16B"]
    cal = hand_calibration()
    gpu = GPUSpec("H200", 1000.0, 2000.0, 4.0, 132, 400.0)
    cluster = Cluster(gpu, 1, 2, 400.0, 50.0)
    lay = Layout(2, 1, 2, 1, 2, 1, 1, 1, 2, 1)
    w = Workload("16B", a, lay, 1, 4096, 1, "none", (), "random", num_sms=33)
    plain = scale_model.predict("nvshmem", w, cluster, cal)
    chunked = scale_model.predict("nvshmem", replace(w, overlap="chunked"), cluster, cal)
    L = a.n_layers - a.n_dense_layers
    d, c, cb, db = (scale_model._chunk_us(t) * 1e-3 for t in chunked.comm.transfers)  # ms
    assert chunked.moe_comm_ms == pytest.approx(L * 2 * (d + c + cb + db))
    assert chunked.terms_ms["moe comm"] + chunked.overlapped_ms["moe comm"] == pytest.approx(chunked.moe_comm_ms)
    rc = layer_compute.rank_ms(cal.layer_bench, w, "H200", tuple(range(a.n_layers)), True, True)
    experts, shared = rc.moe_layer_fwd["experts"], rc.moe_layer_fwd["shared_expert"]  # ms, one MoE layer
    ef, sf = scale_model.overlap_exposure((d, d, c, c), (shared, experts / 2, experts / 2), 33 / 132)
    # the backward runs each op's backward in reverse: the combines' backwards first
    eb, sb = scale_model.overlap_exposure((cb, cb, db, db), (2 * shared, experts, experts), 33 / 132)
    assert chunked.terms_ms["moe comm"] == pytest.approx(L * (ef + eb))
    assert chunked.terms_ms["comm SM contention"] == pytest.approx(L * (sf + sb))
    assert plain.terms_ms["comm SM contention"] == 0 and plain.moe_exposed_share == 1.0
    assert chunked.moe_exposed_share < 1.0
    with pytest.raises(ValueError, match="overlap 'sideways'"):
        scale_model.predict("nvshmem", replace(w, overlap="sideways"), cluster, cal)


def test_the_bubble_is_the_schedules_of_the_step_terms():
    """With PP the bubble is moe_comm.predict.schedule's, of the per-microbatch forward, input
    gradient (with the recompute) and weight gradient: Interleaved1F1B's (f + b)(pp - 1) / v."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    a = deepseekv3_args["16B"]
    gpu = GPUSpec("H200", 1000.0, 2000.0, 4.0, 132, 400.0)
    lay = Layout(16, 2, 8, 1, 4, 1, 1, 4, 4, 1)
    w = Workload("16B", a, lay, 16, 4096, 1, "full", (), "random", num_sms=20, pp_schedule="Interleaved1F1B",
                 layers_per_stage=4)
    p = scale_model.predict("nvshmem", w, Cluster(gpu, 2, 8, 400.0, 50.0), hand_calibration())
    assert (p.pipeline.name, p.pipeline.v, p.pipeline.microbatches) == ("Interleaved1F1B", 2, 16)
    work = sum(v for k, v in p.terms_ms.items()
               if k not in ("pp bubble", "optimizer", "param copies", "fsdp exposed", "idle"))
    assert p.terms_ms["pp bubble"] == pytest.approx(work / 16 * 3 / 2)
    zb = scale_model.predict("nvshmem", replace(w, pp_schedule="InterleavedZeroBubble"),
                             Cluster(gpu, 2, 8, 400.0, 50.0), hand_calibration())
    assert zb.terms_ms["pp bubble"] < p.terms_ms["pp bubble"]
    with pytest.raises(ValueError, match="multiple of the 2 rounds"):
        scale_model.predict("nvshmem", replace(w, local_batch=9), Cluster(gpu, 2, 8, 400.0, 50.0), hand_calibration())


def test_dualpipev_overlap_prices_its_pairs_as_the_microbatch_overlap_with_any_ac():
    """DualPipeV's EP overlap runs TorchTitan's overlap callback with the same sync points as
    [moe_comm] overlap = "microbatch" (moe_comm.titan.overlap), and our recompute is comm-free, so
    it runs under AC too (moe_comm.titan.parallelize lifts TorchTitan's refusal; the PP 2 x EP 2
    CPU training with full AC matches the plain schedule bit for bit): its overlapped pairs (rank
    0's of torch's DualPipeV lists) hide each MoE layer's transfers as the microbatch overlap's do,
    and the rest expose theirs. It needs the DualPipeV schedule."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    a = deepseekv3_args["16B"]
    cal = hand_calibration()
    gpu = GPUSpec("H200", 1000.0, 2000.0, 4.0, 132, 400.0)
    cluster = Cluster(gpu, 2, 8, 400.0, 50.0)
    lay = Layout(16, 2, 8, 1, 4, 1, 1, 4, 4, 1)
    for ac in ("none", "full"):
        w = Workload("16B", a, lay, 16, 4096, 1, ac, (), "random", num_sms=20, pp_schedule="DualPipeV")
        plain = scale_model.predict("nvshmem", w, cluster, cal)
        ep = scale_model.predict("nvshmem", replace(w, overlap="dualpipev"), cluster, cal)
        assert ep.terms_ms["moe comm"] < plain.terms_ms["moe comm"] and ep.overlapped_ms["moe comm"] > 0
        assert ep.moe_comm_ms == pytest.approx(plain.moe_comm_ms)  # the same transfers, none recomputed
        # the pairs torch's DualPipeV runs overlapped on rank 0: 2 (m - 2 pp + 1) + pp - 1 of 2 m chunks
        pipe = ep.pipeline
        assert pipe.overlapped_pairs == 2 * (16 - 8 + 1) + 3
        share = pipe.overlapped_pairs / (2 * 16)
        # by hand for the busiest rank: what the pairs hide, per MoE layer and microbatch
        comm_us = {t.name: t.time_us * 1e-3 for t in ep.comm.transfers}  # ms
        busiest = max(estimate.pipeline_ranks(a, lay, 16, 1, "DualPipeV", None),
                      key=lambda r: sum(sum(v) for v in layer_compute.rank_ms(
                          cal.layer_bench, w, "H200", r.layers, r.embedding, r.output).terms.values()))
        rc = layer_compute.rank_ms(cal.layer_bench, w, "H200", busiest.layers, busiest.embedding, busiest.output)
        x = scale_model.microbatch_pair_exposure(comm_us, rc.moe_layer, 20 / 132)
        L = sum(1 for i in busiest.layers if i >= a.n_dense_layers)
        exposed = L * sum((1 - share) * (comm_us[f] + comm_us[g]) + share * x[t][0]
                          for t, (f, g) in {"f": ("dispatch", "combine"),
                                            "b": ("dispatch backward", "combine backward")}.items())
        assert ep.terms_ms["moe comm"] / 16 == pytest.approx(exposed)
    with pytest.raises(ValueError, match="needs pipeline_parallel_schedule DualPipeV"):
        scale_model.predict("nvshmem", replace(w, pp_schedule="Interleaved1F1B", overlap="dualpipev"), cluster, cal)


def test_dualpipev_with_chunked_prices_the_unpaired_stages_chunked():
    """DualPipeV's EP overlap with [moe_comm] overlap = "chunked" (moe_comm.titan.overlap): its
    pairs as DualPipeV's alone, the microbatch-stages outside them as "chunked" (which the same
    schedule without its EP overlap runs everywhere). The exposed MoE communication is the
    pairs' share of the one and the rest's of the other, and the chunked weight work is the
    rest's share of "chunked"'s."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    a = deepseekv3_args["16B"]
    cal = hand_calibration()
    cluster = Cluster(GPUSpec("H200", 1000.0, 2000.0, 4.0, 132, 400.0), 2, 8, 400.0, 50.0)
    lay = Layout(16, 2, 8, 1, 4, 1, 1, 4, 4, 1)
    for ac in ("none", "full"):
        w = Workload("16B", a, lay, 16, 4096, 1, ac, (), "random", num_sms=20, pp_schedule="DualPipeV")
        p = {o: scale_model.predict("nvshmem", replace(w, overlap=o), cluster, cal)
             for o in ("none", "chunked", "dualpipev", "dualpipev+chunked")}
        share = p["dualpipev"].pipeline.overlapped_pairs / (2 * 16)
        assert 0 < share < 1
        for term in ("moe comm", "chunked weight work"):
            want = p["dualpipev"].terms_ms[term] - (1 - share) * (p["none"].terms_ms[term] - p["chunked"].terms_ms[term])
            assert p["dualpipev+chunked"].terms_ms[term] == pytest.approx(want), (ac, term)
        assert p["dualpipev+chunked"].terms_ms["moe comm"] < p["dualpipev"].terms_ms["moe comm"]
        assert p["dualpipev+chunked"].moe_exposed_share < p["dualpipev"].moe_exposed_share
    with pytest.raises(ValueError, match="needs pipeline_parallel_schedule DualPipeV"):
        scale_model.predict("nvshmem", replace(w, pp_schedule="Interleaved1F1B", overlap="dualpipev+chunked"),
                            cluster, cal)


def test_the_backward_chunks_run_combines_backward_first():
    """Issue 34 item 6: under "chunked" the backward runs each op's backward in reverse, so the
    combines' backwards come first and the last dispatch backward stays exposed; with a slow
    dispatch backward and a fast combine backward the two orders differ, and the step takes the
    right one."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    a = deepseekv3_args["16B"]
    cal = hand_calibration()
    gpu = GPUSpec("H200", 1000.0, 2000.0, 4.0, 132, 400.0)
    w = Workload("16B", a, Layout(2, 1, 2, 1, 2, 1, 1, 1, 2, 1), 1, 4096, 1, "none", (), "random", num_sms=33,
                 overlap="chunked")
    p = scale_model.predict("nvshmem", w, Cluster(gpu, 1, 2, 400.0, 50.0), cal)
    d, c, cb, db = (scale_model._chunk_us(t) * 1e-3 for t in p.comm.transfers)
    rc = layer_compute.rank_ms(cal.layer_bench, w, "H200", tuple(range(a.n_layers)), True, True)
    e, s = rc.moe_layer_fwd["experts"], rc.moe_layer_fwd["shared_expert"]
    right = scale_model.overlap_exposure((cb, cb, db, db), (2 * s, e, e), 33 / 132)[0]
    wrong = scale_model.overlap_exposure((db, db, cb, cb), (2 * s, e, e), 33 / 132)[0]
    assert right != pytest.approx(wrong)
    ef = scale_model.overlap_exposure((d, d, c, c), (s, e / 2, e / 2), 33 / 132)[0]
    L = a.n_layers - a.n_dense_layers
    assert p.terms_ms["moe comm"] == pytest.approx(L * (ef + right))


def test_fsdp_takes_its_share_of_the_nic_from_the_ep_transfers():
    """Issue 34 item 6: FSDP's collectives across nodes run on the NIC the EP transfers use: while
    they run (spread over the step's compute) the EP network phase gets the rest of the line rate."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    a = deepseekv3_args["16B"]
    cal = hand_calibration()
    gpu = GPUSpec("H200", 1000.0, 2000.0, 4.0, 132, 400.0)
    cluster = Cluster(gpu, 2, 8, 400.0, 50.0)
    lay = Layout(16, 2, 8, 1, 16, 1, 1, 1, 16, 1)  # FSDP 16 and EP 16 over both nodes
    w = Workload("16B", a, lay, 1, 4096, 1, "none", (), "random", num_sms=20)
    p = scale_model.predict("nvshmem", w, cluster, cal)
    alone = scale_model.layer_comm("nvshmem", w, cluster, cal)
    total_ms, _, network_ms = scale_model._fsdp_ms(w, cluster, cal, 1)
    assert network_ms == total_ms > 0
    compute_ms = sum(p.terms_ms[k] for k in ("gemm", "attention", "memory-bound"))
    share = 1 - network_ms / compute_ms
    assert p.comm.transfers[0].network_us == pytest.approx(alone.transfers[0].network_us / share)
    one_node = Layout(16, 2, 8, 1, 16, 1, 1, 1, 8, 1)  # EP inside a node: its transfers never meet FSDP's
    q = scale_model.predict("nvshmem", replace(w, layout=one_node), cluster, cal)
    assert q.comm.transfers[0].network_us == 0


def _deepep_workload():
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    a = deepseekv3_args["671B"]
    return Workload("671B", a, Layout(256, 32, 8, 1, 32, 1, 1, 8, 32, 1), 8, 4096, 1, "full", (), "node_limited",
                    num_sms=20, pp_schedule="1F1B")


def test_measured_host_syncs_replace_the_borrowed_cost():
    """Issue 34 item 3: where experiments/host_syncs.py measured a backend's case, each transfer
    costs its measured host synchronisations (the scenario's end of their range), not the
    all-to-all path's per-call cost; where it did not, the class's stated count at that cost."""
    from moe_comm.predict.calibration import HostSync

    w = _deepep_workload()
    cluster = scale_model.cluster_for("B200", 32, 8, hand_calibration())
    borrowed = scale_model.layer_comm("deepep", w, cluster, hand_calibration())
    assert [t.host_us for t in borrowed.transfers] == [1000.0, 0.0, 0.0, 0.0]  # 1 x nccl_call_us
    measured = {name: HostSync(n, {"low": 20.0 * n, "central": 300.0 * n, "high": 900.0 * n})
                for name, n in (("dispatch", 5), ("combine", 1), ("combine backward", 0), ("dispatch backward", 2))}
    cal = replace(hand_calibration(), host_syncs={"deepep_2pe": measured})
    comm = scale_model.layer_comm("deepep", w, cluster, cal)
    assert [t.host_us for t in comm.transfers] == [1500.0, 300.0, 0.0, 600.0]
    high = scale_model.layer_comm("deepep", w, cluster, cal, inputs=replace(cal.scenario(), host_sync="high"))
    assert high.transfers[0].host_us == 4500.0
    # nccl's per-call cost is a measured round trip, host syncs included: it keeps it
    nccl = scale_model.layer_comm("nccl", w, cluster, replace(cal, host_syncs={"nccl_ep1": measured}))
    assert nccl.transfers[0].host_us == 1000.0


def test_fp8_combine_backward_halves_its_bytes():
    w = _deepep_workload()
    cal = hand_calibration()
    cluster = scale_model.cluster_for("B200", 32, 8, cal)
    plain = scale_model.layer_comm("nvshmem", w, cluster, cal)
    fp8 = scale_model.layer_comm("nvshmem", replace(w, combine_grad_dtype="fp8"), cluster, cal)
    rows = {t.name: t.row_bytes for t in fp8.transfers}
    assert rows["combine backward"] == 7168 + 7168 / 128 * 4 + META and rows["dispatch"] == 7168 * 2 + META
    assert fp8.transfers[2].network_us < 0.6 * plain.transfers[2].network_us


def test_the_busiest_rank_factor_scales_what_the_busiest_rank_receives():
    """Measured routing skew (calibration.Imbalance) at the workload's EP: the receive side of
    every transfer and the experts' rows are the mean rank's times it; forced-balanced routing is
    exact as drawn."""
    from moe_comm.predict.calibration import Imbalance
    from moe_comm.predict.routing_plan import routing_statistics

    w = _deepep_workload()
    cal = replace(hand_calibration(), imbalance=Imbalance({8: {"median": 1.1, "p90": 1.2, "max": 1.3},
                                                           32: {"median": 1.4, "p90": 1.6, "max": 2.0}}, "made up"))
    cluster = scale_model.cluster_for("B200", 32, 8, cal)
    comm = scale_model.layer_comm("nvshmem", w, cluster, cal)
    st = routing_statistics("node_limited", 32, 8, 256, 8)
    assert comm.busiest_factor == 1.4
    assert comm.transfers[0].nvlink_rows == pytest.approx(max(4096 * st.max["nvlink_out"], 4096 * st.mean["nvlink_in"] * 1.4))
    assert cal.imbalance.factor(16, "median") == 1.4 and cal.imbalance.factor(4, "p90") == 1.2
    assert cal.imbalance.factor(64, "median") == 1.4 and cal.imbalance.factor(1, "p90") == 1.0
    balanced = scale_model.layer_comm("nvshmem", replace(w, routing="balanced"), cluster, cal)
    assert balanced.busiest_factor == 1.0
    # fixed receive buffers run no skew beyond them (the run stops, naming recv_capacity_factor)
    capped = scale_model.layer_comm("nvshmem", replace(w, recv_capacity_factor=1.25), cluster, cal)
    assert capped.busiest_factor == 1.25
    assert scale_model.layer_comm("deepep", replace(w, recv_capacity_factor=1.25), cluster, cal).busiest_factor == 1.4
    drawn = scale_model.layer_comm("nvshmem", w, cluster, cal, inputs=replace(cal.scenario(), imbalance="drawn"))
    assert drawn.busiest_factor is None and drawn.transfers[0].nvlink_rows < comm.transfers[0].nvlink_rows


def test_ranges_bound_the_central_prediction():
    """Every prediction at the pessimistic end of the unmeasured inputs, at their central values
    and at their optimistic end: low <= central <= high, each end's inputs as calibrated."""
    from moe_comm.predict.assumptions import Inputs

    w = replace(_deepep_workload(), pp_schedule="Interleaved1F1B", local_batch=16, layers_per_stage=2,
                overlap="chunked")
    inputs = {"low": Inputs(0.7, 0.85, "drawn", 0.2, "high"), "central": Inputs(0.86, 1.0, "drawn", 0.1, "central"),
              "high": Inputs(0.95, 1.0, "drawn", 0.05, "low")}
    cal = replace(hand_calibration(), inputs=inputs)
    cluster = scale_model.cluster_for("B200", 32, 8, cal)
    r = scale_model.predict_range("nvshmem", w, cluster, cal)
    lo, mid, hi = r.span()
    assert lo < mid < hi
    assert r.low.scenario == "low" and r.high.comm.transfers[0].network_us < r.central.comm.transfers[0].network_us
    assert r.low.terms_ms["idle"] > r.central.terms_ms["idle"] and r.overlaps(r)
    assert r.central.tokens_per_s_per_gpu == scale_model.predict("nvshmem", w, cluster, cal).tokens_per_s_per_gpu


def test_comm_free_recompute_keeps_its_tensors_in_the_memory():
    """Issue 37 item 1: under AC our recompute replays dispatch and combine, so their outputs are
    kept per MoE layer and microbatch in flight (estimate.comm_kept_bytes, by the backend's
    transport); TorchTitan's own recompute (the anchors) keeps nothing and re-sends."""
    from moe_comm.predict import estimate

    w = replace(_deepep_workload(), recv_capacity_factor=1.25)
    base = estimate.memory_per_gpu(w.args, w.layout, w.local_batch, w.seq_len, w.ac_mode, w.microbatch, w.pp_schedule)
    for backend, kind in (("nvshmem", "nvshmem"), ("nccl", "nccl"), ("deepep", "deepep")):
        mem = scale_model.memory(w, backend)
        kept = estimate.comm_kept_bytes(w.args, 4096, 32, kind, recv_capacity_factor=1.25, ranks_per_node=8)
        ranks = estimate.pipeline_ranks(w.args, w.layout, 8, 1, "1F1B")
        held = max(sum(1 for i in r.layers if i >= 3) * r.pipe.microbatches_in_flight(r.rank) for r in ranks)
        assert mem.comm_kept == pytest.approx(kept * held) and mem.total > base.total
    assert scale_model.memory(replace(w, recompute_comm=True), "nvshmem").comm_kept == 0
    assert scale_model.memory(replace(w, ac_mode="none"), "nvshmem").comm_kept == 0


def test_fp8_experts_kept_weights_are_in_the_memory_where_the_run_keeps_them():
    """Issue 35: where the FP8 experts run more than once per step (microbatches, recompute),
    their e4m3 weights stay over the step (moe_comm.fp8_experts.WeightCache): every MoE layer of
    the busiest pipeline rank holds cached_weight_bytes more; bf16 experts hold none, and a run with
    one forward per step only the forward's copies, from each layer's forward to its backward."""
    from moe_comm import fp8_experts

    w = replace(_deepep_workload(), expert_dtype="fp8")
    bf16, fp8 = scale_model.memory(replace(w, expert_dtype="bf16"), "nvshmem"), scale_model.memory(w, "nvshmem")
    per_layer = fp8_experts.cached_weight_bytes(w.args.moe_args.num_experts // w.layout.ep, w.args.dim,
                                                w.args.moe_inter_dim)
    assert bf16.fp8_weights == 0 and fp8.fp8_weights > 0 and fp8.fp8_weights % per_layer == 0
    assert fp8.total == pytest.approx(bf16.total + fp8.fp8_weights)  # PP: the transposed copies are there too
    # without PP the forward's end holds the forward copies only (the one-GPU recipe under AC, run 30)
    nopp = replace(w, layout=replace(w.layout, pp=1, dp_shard=w.layout.dp_shard * w.layout.pp), local_batch=1)
    a, b = scale_model.memory(replace(nopp, expert_dtype="bf16"), "nvshmem"), scale_model.memory(nopp, "nvshmem")
    forward = fp8_experts.forward_weight_bytes(w.args.moe_args.num_experts // w.layout.ep, w.args.dim,
                                               w.args.moe_inter_dim)
    assert b.forward_end - a.forward_end == pytest.approx(b.fp8_forward_weights) and b.fp8_forward_weights % forward == 0
    assert b.backward_end - a.backward_end == pytest.approx(b.fp8_weights)
    # one forward per step (no AC, one microbatch): nothing cached, but each MoE layer's forward
    # copies are saved for its backward (which transposes them), at the forward's end only
    once = replace(nopp, ac_mode="none", accumulation=1)
    a, b = scale_model.memory(replace(once, expert_dtype="bf16"), "nvshmem"), scale_model.memory(once, "nvshmem")
    assert b.fp8_weights == 0 and b.fp8_forward_weights > 0 and b.fp8_forward_weights % forward == 0
    assert b.forward_end - a.forward_end == pytest.approx(b.fp8_forward_weights)
    assert b.backward_end == pytest.approx(a.backward_end)
    assert b.backward_end - a.backward_end == pytest.approx(b.fp8_weights)
    one = replace(w, ac_mode="none", layout=replace(w.layout, pp=1, dp_shard=w.layout.dp_shard * w.layout.pp))
    assert one.microbatches == 1 and scale_model.memory(one, "nvshmem").fp8_weights == 0
    # gradient accumulation runs the forward twice per step too ([training] global_batch_size)
    assert scale_model.memory(replace(one, accumulation=2), "nvshmem").fp8_weights > 0


def test_microbatch_overlap_prices_what_hides_behind_what():
    """Issue 37 item 2, as moe_comm.titan.pipeline ships it: in Interleaved1F1B's overlapped pairs
    (schedule.Pipeline.microbatch_pairs of the rank) the forward's dispatch hides behind the other
    microbatch's experts' backward, its combine behind the rest of that block's backward and its
    recompute, the backward's dispatch behind the experts' forward and its combine behind the shared
    experts and the next block's attention; the rest of the rank's microbatch-stages expose theirs.
    One more microbatch-stage is in flight."""
    w = replace(_deepep_workload(), pp_schedule="Interleaved1F1B", local_batch=32, layers_per_stage=2,
                overlap="microbatch")
    cal = hand_calibration()
    cluster = scale_model.cluster_for("B200", 32, 8, cal)
    p = scale_model.predict("nvshmem", w, cluster, cal)
    none = scale_model.predict("nvshmem", replace(w, overlap="none"), cluster, cal)
    assert p.terms_ms["moe comm"] < none.terms_ms["moe comm"] and p.overlapped_ms["moe comm"] > 0
    assert p.moe_comm_ms == pytest.approx(none.moe_comm_ms)  # the same transfers, one chunk each
    pipe = p.pipeline
    ranks = estimate.pipeline_ranks(w.args, w.layout, 32, 1, "Interleaved1F1B", 2)
    pairs = [pipe.microbatch_pairs(r.rank) for r in ranks]
    assert 0 < min(pairs) < max(pairs) < pipe.microbatches * pipe.v  # the edge ranks pair the fewest
    # by hand for one rank: the comm of one MoE layer in a pair and out of it
    comm_us = {t.name: t.time_us * 1e-3 for t in p.comm.transfers}  # ms
    rank = ranks[3]
    rc = layer_compute.rank_ms(cal.layer_bench, w, "B200", rank.layers, rank.embedding, rank.output)
    x = scale_model.microbatch_pair_exposure(comm_us, rc.moe_layer, w.num_sms / 148)
    lay = rc.moe_layer
    assert x["f"][0] == pytest.approx(max(0, comm_us["dispatch"] - lay["experts"][1]) + max(
        0, comm_us["combine"] - (sum(lay[k][1] * (2 if k in ("rmsnorm", "residual_add") else 1) for k in
                                     ("attention.core", "attention.projections", "router", "rmsnorm", "residual_add"))
                                 + lay["shared_expert"][1] + sum(v[2] * (2 if k in ("rmsnorm", "residual_add") else 1)
                                                                 for k, v in lay.items()))))
    assert x["b"][0] == pytest.approx(max(0, comm_us["dispatch backward"] - lay["experts"][0]) + max(
        0, comm_us["combine backward"] - lay["shared_expert"][0] - sum(
            lay[k][0] * (2 if k in ("rmsnorm", "residual_add") else 1)
            for k in ("attention.core", "attention.projections", "router", "rmsnorm", "residual_add"))))
    mem, plain = scale_model.memory(w, "nvshmem"), scale_model.memory(replace(w, overlap="none"), "nvshmem")
    assert mem.microbatches_in_flight == pytest.approx(plain.microbatches_in_flight + 1 / 4)
    with pytest.raises(ValueError, match="Interleaved1F1B"):
        scale_model.predict("nvshmem", replace(w, pp_schedule="1F1B", layers_per_stage=None), cluster, cal)


def _experiment(name):
    import importlib.util
    import sys as _sys

    from moe_comm.predict.assumptions import REPO

    spec = importlib.util.spec_from_file_location(name, REPO / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    _sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


HOST_SYNC_SUMMARY = {  # experiments/host_syncs.py's per-phase summary, made up
    "dispatch.fwd": {"syncs_per_call": 5, "host_ms": 2.0, "wait_us_per_call": 500.0,
                     "wait_outside_cuda_api": {"op": "deep_ep::dispatch", "self_cpu_us_median": 300.0}},
    "combine.fwd": {"syncs_per_call": 1, "host_ms": 0.5, "wait_us_per_call": 100.0},
    "combine.bwd": {"syncs_per_call": 0, "host_ms": 0.3, "wait_us_per_call": None},
    "dispatch.bwd": {"syncs_per_call": 2, "host_ms": 0.1, "wait_us_per_call": 0.0},
}


def test_calibration_reads_host_syncs_and_routing_imbalance_by_their_schema(tmp_path):
    """The measured inputs of experiments/host_syncs.py and experiments/routing_imbalance.py, as they
    write them, found in results/model_inputs by their schema: each GPU case's calls with their cost
    range, the busiest-rank factor per EP with its median and p90; the scenarios take them; a second
    file of one schema is refused. Neither is an anchor's figure."""
    import random
    import shutil

    import torch

    from moe_comm.predict.assumptions import MODEL_INPUTS

    inputs = tmp_path / "model_inputs"
    shutil.copytree(MODEL_INPUTS, inputs)
    for schema in (calibration.HOST_SYNCS_SCHEMA, calibration.IMBALANCE_SCHEMA):  # the recorded ones
        recorded = calibration.find_input(inputs, schema)
        if recorded:
            recorded.unlink()
    ri = _experiment("routing_imbalance")
    rng = random.Random(0)
    counts = {s: torch.tensor([[rng.choice((300, 200, 100)) for _ in range(32)] for _ in range(2)], dtype=torch.float64)
              for s in range(1, 21)}
    run = {"recipe": "made up", "layers": ["1", "2"], "num_experts": 32, "top_k": 8, "load_balance_coeff": 1e-3}
    analysis = ri.analyse(run, counts)
    (inputs / "routing_imbalance_made_up.json").write_text(json.dumps(
        {"schema": ri.SCHEMA, "run": run, "analysis": analysis}))
    hs = _experiment("host_syncs")
    cases = {"deepep_2pe": {"status": "ok", "device": "cuda", "where": "2 PEs", "summary": HOST_SYNC_SUMMARY},
             "nccl_ep2_cpu": {"status": "ok", "device": "cpu", "summary": {p: {"syncs_per_call": 1} for p in hs.PHASES}}}
    (inputs / "host_syncs_made_up.json").write_text(json.dumps(
        {"schema": hs.SCHEMA, "device": "NVIDIA H200", "shape": {"tokens": 4096, "hidden": 7168}, "cases": cases}))
    calibration.calibrate.cache_clear()
    try:
        cal = calibration.calibrate(inputs)
        assert set(cal.host_syncs) == {"deepep_2pe"}  # the CPU cases count, they do not time
        d = cal.host_syncs["deepep_2pe"]["dispatch"]
        floor = cal.kernel_floor_us
        assert d.count == 5 and d.cost_us == pytest.approx({"low": 5 * floor, "central": 2000 - 500 - 300, "high": 2000})
        assert cal.host_syncs["deepep_2pe"]["combine backward"].cost_us == {"low": 0.0, "central": 0.0, "high": 0.0}
        back = cal.host_syncs["deepep_2pe"]["dispatch backward"].cost_us  # no wait: all its host time is idle
        assert back == pytest.approx({"low": 2 * floor, "central": 100.0, "high": 100.0})
        ep32 = analysis["ep"]["32"]["all_layers"]
        assert cal.imbalance.by_ep[32] == {k: ep32[k] for k in ("median", "p90", "max")} and 8 in cal.imbalance.by_ep
        # measured on 32 experts, not DeepSeek-V3's 256: the pessimistic end, the drawn routing central
        assert "32 routed experts" in cal.imbalance.collapsed
        assert [cal.scenario(s).imbalance for s in ("low", "central", "high")] == ["median", "drawn", "drawn"]
        names = [a.name for a in cal.assumptions]
        assert any("host synchronisations, deepep_2pe" in n for n in names) and any("busiest EP rank" in n for n in names)
        # a run routing the flagship's 256 experts stands for it: its median central, its p90 the pessimistic end
        wide = {s: torch.cat([c] * 8, dim=1) for s, c in counts.items()}
        run256 = dict(run, num_experts=256)
        (inputs / "routing_imbalance_made_up.json").write_text(json.dumps(
            {"schema": ri.SCHEMA, "run": run256, "analysis": ri.analyse(run256, wide)}))
        calibration.calibrate.cache_clear()
        cal = calibration.calibrate(inputs)
        assert not cal.imbalance.collapsed and 64 in cal.imbalance.by_ep
        assert [cal.scenario(s).imbalance for s in ("low", "central", "high")] == ["p90", "median", "drawn"]
        assert not [a for a in cal.assumptions if "anchor" in a.source.lower() or "fitted" in a.name.lower()]
        (inputs / "host_syncs_again.json").write_text((inputs / "host_syncs_made_up.json").read_text())
        calibration.calibrate.cache_clear()
        with pytest.raises(ValueError, match="2 host_syncs/1 files"):
            calibration.calibrate(inputs)
    finally:
        calibration.calibrate.cache_clear()


def test_the_nvshmem_calls_cuda_graph_pools_are_in_the_memory():
    """moe_comm.kernels.call_graphs keeps each graph instance's outputs in its pool: about two of
    each call kind's outputs per MoE layer (estimate.call_graph_bytes), for the whole step, for a
    backend whose calls replay from graphs (our kernels'); measured at world 1 as 8.1 GiB more in
    use on the one-GPU recipe, which the rule gives as 7.9."""
    from moe_comm import recipe
    from moe_comm.kernels import capacity

    r = recipe.load("recipes/deepseek_v3_671b_h200x1.toml", [], device="cuda", check_paths=False)
    w = scale_model.workload_from_recipe(r)
    mem, nccl = scale_model.memory(w, "nvshmem"), scale_model.memory(w, "nccl")
    cap = capacity.expert_rows(8192, 32, 8, 1, 0.0, 8)
    per_layer = 2 * (2 * cap + 2 * 8192) * 7168 * 2
    assert mem.call_graphs == pytest.approx(2 * per_layer) and nccl.call_graphs == 0
    assert mem.call_graphs / estimate.GiB == pytest.approx(7.9, abs=0.05)
    assert mem.total - nccl.total == pytest.approx(mem.call_graphs)


def test_a_recipe_that_compiles_its_loss_holds_its_bf16_logits_alone():
    """`check`'s memory for the one-GPU recipe with `--compile.enable --compile.components loss`:
    4 B a logit less than eager (estimate.logits_bytes), 3.9 GiB at 2 x 4096 tokens x 129,280."""
    from moe_comm import recipe

    path = "recipes/deepseek_v3_671b_h200x1.toml"
    eager = scale_model.workload_from_recipe(recipe.load(path, [], device="cuda", check_paths=False))
    compiled = scale_model.workload_from_recipe(recipe.load(
        path, ["--compile.enable", "--compile.components", "loss"], device="cuda", check_paths=False))
    assert compiled.loss_compiled and not eager.loss_compiled
    drop = scale_model.memory(eager, "nvshmem").total - scale_model.memory(compiled, "nvshmem").total
    assert drop == pytest.approx(4 * 8192 * 129280) and drop / estimate.GiB == pytest.approx(3.95, abs=0.01)


def test_the_known_gaps_name_what_compiling_the_blocks_measured(validated):
    """Run 65 compiled the one-GPU recipe's blocks (TorchTitan's [compile], model and loss), which the
    model does not price: the known gaps give the compiled runs' errors apart from the eager and
    loss-compiled runs' of the same call, and the measured gain of compiling, each read from the table."""
    cal, rows = validated
    call = "train/one_gpu_compile_2026-12-05/deepseek_v3_671b_h200x1/"
    rows = dict(rows)  # the eager nccl row's error set apart, so that a filter which drops it shows
    rows[call + "nccl"] = replace(rows[call + "nccl"], predicted=1.2 * rows[call + "nccl"].measured)  # +20%
    lines = []
    _experiment("scale_model").gaps_section(list(rows.values()), cal, lines)
    bullet = next(line for line in lines if line.startswith("- **The blocks compiled at world 1"))
    compiled = [rows[call + b].error_pct for b in ("nccl-compiled", "nvshmem-fp8-experts-compiled")]
    eager = [rows[call + b].error_pct for b in ("nccl", "nvshmem-fp8-experts", "nccl-loss-compiled",
                                                "nvshmem-fp8-experts-loss-compiled")]
    assert f"(run 65, held out): {min(compiled):+.0f}% to {max(compiled):+.0f}%;" in bullet
    assert f"loss alone compiled: {min(eager):+.0f}% to +20%." in bullet
    gain = {b: (rows[call + f"{b}-compiled"].measured / rows[call + b].measured - 1) * 100
            for b in ("nccl", "nvshmem-fp8-experts")}
    assert f"{gain['nccl']:+.1f}% tok/s over eager with nccl and {gain['nvshmem-fp8-experts']:+.1f}% with FP8" in bullet
    assert 8 < gain["nccl"] < 10 and 7 < gain["nvshmem-fp8-experts"] < 10  # run 65: +9.0%, +8.4%
