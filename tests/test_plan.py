"""`python -m moe_comm plan`: the search space, feasibility, ranking, the override lines (which
must reproduce each row's prediction when applied to the recipe) and the refusals."""

from pathlib import Path

import pytest

from moe_comm import plan as plan_verb
from moe_comm import recipe
from moe_comm.__main__ import main
from moe_comm.predict import calibration, estimate, scale_model, schedule
from moe_comm.predict import plan as planner

REPO = Path(__file__).resolve().parents[1]
FLAGSHIP = str(REPO / "recipes" / "deepseek_v3_671b_b200.toml")


@pytest.fixture(scope="module")
def flagship_plan():
    r = recipe.load(FLAGSHIP, [], device="cuda", check_paths=False)
    req = plan_verb.request(r, backends=["nvshmem", "deepep"], keep=["ep=32", "pp=8"])
    return r, req, planner.plan(req, calibration.calibrate(), top=5)


def test_rows_are_feasible_ranked_and_kept(flagship_plan):
    _, req, rows = flagship_plan
    assert set(rows) == {"nvshmem", "deepep"}
    for backend, top in rows.items():
        assert len(top) == 5
        speeds = [row.tokens_per_s_per_gpu for row in top]
        assert speeds == sorted(speeds, reverse=True)
        for row in top:
            assert (row.layout.ep, row.layout.pp) == (32, 8)
            assert row.memory_gib <= 0.85 * 178.4 and row.memory_limit_gib == pytest.approx(0.85 * 178.4)
            assert 0 <= row.bounds["bubble"] < 1 and 0 < row.bounds["exposed comm"] < 1
            # the global batch stays in the stated range: the recipe's 8M tokens up to 4x
            tokens = row.layout.local_batch * 4096 * 32
            assert 8 * 2**20 <= tokens <= 32 * 2**20
            assert row.prediction.tflops_per_gpu == pytest.approx(row.prediction.mfu / 100 * 2250)
            # every row shown carries its range; one whose range meets #1's is marked so
            lo, mid, hi = row.span
            assert lo < mid < hi and mid == pytest.approx(row.tokens_per_s_per_gpu)
            lo1, _, hi1 = top[0].span
            assert planner.overlaps_best(row, top[0]) == (row is not top[0] and lo <= hi1 and lo1 <= hi)


def test_override_lines_reproduce_their_rows(flagship_plan):
    """Each row's overrides, applied to the recipe, give the row's layout and prediction (the
    deepep row's layout is loaded with the nccl backend: DeepEP is not installed here, and its
    check_run asks for it)."""
    _, req, rows = flagship_plan
    cal = calibration.calibrate()
    for backend in rows:
        row = rows[backend][0]
        line = " ".join(row.overrides).replace("--moe_comm.backend deepep", "--moe_comm.backend nccl").split()
        r = recipe.load(FLAGSHIP, line, device="cuda", check_paths=False)
        w = scale_model.workload_from_recipe(r)
        assert w.overlap == row.layout.overlap and w.pp_schedule == row.layout.schedule
        cluster = scale_model.cluster_for("B200", r.layout.nodes, r.layout.procs_per_node, cal)
        p = scale_model.predict(backend, w, cluster, cal)
        assert p.tokens_per_s_per_gpu == pytest.approx(row.tokens_per_s_per_gpu)
        mem = scale_model.memory(w, backend)  # with what its comm-free recompute keeps
        assert mem.comm_kept > 0 and mem.total / estimate.GiB <= row.memory_gib


def test_search_space_covers_every_schedule_and_stage_count():
    r = recipe.load(FLAGSHIP, [], device="cuda", check_paths=False)
    req = plan_verb.request(r, keep=["ep=32", "pp=8"])
    seen = {(lay.schedule, lay.v) for lay in planner.layouts(req)}
    assert {s for s, _ in seen} == set(schedule.SCHEDULES)
    assert {v for s, v in seen if s == "Interleaved1F1B"} == {2, 4}  # 63 / layers_per_stage in {4, 2}
    overlaps = {lay.overlap for lay in planner.layouts(req)}
    assert overlaps == {"none", "chunked", "microbatch", "dualpipev", "dualpipev+chunked"}
    # DualPipeV's EP overlap (alone, or chunked outside its pairs) with every AC mode: our recompute
    # is comm-free (TorchTitan refuses AC there)
    for dual in scale_model.DUALPIPEV:
        assert {lay.ac for lay in planner.layouts(req) if lay.overlap == dual} == {"none", "selective", "full"}
        assert {lay.schedule for lay in planner.layouts(req) if lay.overlap == dual} == {"DualPipeV"}
    assert {lay.schedule for lay in planner.layouts(req) if lay.overlap == "microbatch"} == {"Interleaved1F1B"}


def test_shortfall_is_on_one_flop_count_adds_up_and_ignores_the_terms_order(flagship_plan, monkeypatch):
    """--explain (issue 34 item 5): both sides on Megatron's flop count (attention halved for the
    causal mask: 250.5 GFLOP/token at seq 4096 against TorchTitan's 281.2), the lines add up to the
    reference less the prediction, and each term's share is its Shapley value: listing the terms in
    another order changes no line."""
    r, _, rows = flagship_plan
    p = rows["nvshmem"][0].prediction
    a = scale_model.workload_from_recipe(r).args
    flops = planner.causal_flops_per_token(a, 4096)
    assert flops / 1e9 == pytest.approx(250.5, abs=0.1)
    assert estimate.count_params(a).flops_per_token(a, 4096) / 1e9 == pytest.approx(281.2, abs=0.1)
    ref = planner.MEGATRON_BRIDGE_B200.tokens_per_s_per_gpu
    lines = planner.shortfall(p, flops, ref)
    ours = p.tokens_per_s_per_gpu * flops / 1e12
    assert sum(cost for _, cost in lines) == pytest.approx(ref * flops / 1e12 - ours)
    names = [name for name, _ in lines]
    assert "exposed MoE transfers" in names and "activation recompute" in names
    monkeypatch.setattr(planner, "SHORTFALL_TERMS", tuple(reversed(planner.SHORTFALL_TERMS)))
    again = dict(planner.shortfall(p, flops, ref))
    assert all(again[name] == pytest.approx(cost) for name, cost in lines)


def test_plan_cli(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["plan", "recipes/deepseek_v3_671b_b200.toml", "--keep", "ep=32", "--keep", "pp=8",
                 "--backend", "nccl", "--top", "2", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "on 32 x 8 B200 (256 GPUs); kept: ep=32, pp=8" in out and "predicted" in out
    assert "nccl: 2 best feasible layout(s)" in out and "--moe_comm.backend nccl" not in out.split("#")[0]
    assert "low-high" in out
    # the recipe's own row (its backend, as it stands), against Megatron-Bridge on the same B200s
    assert "recipes/deepseek_v3_671b_b200.toml as it stands (nvshmem)" in out and "Megatron-Bridge" in out
    assert "Shapley" in out and "exposed MoE transfers" in out and "What differs from" in out


@pytest.mark.parametrize("argv,message", [
    (["--keep", "epp=32"], "--keep 'epp=32': write KEY=VALUE with KEY one of"),
    (["--keep", "ep=x"], "--keep 'ep=x': ep takes a whole number"),
    (["--keep", "ep=3"], "--keep ep=3: EP must divide the 256 GPUs and the 256 experts"),
    (["--keep", "schedule=GPipe"], "the schedule model covers"),
    (["--keep", "ac=some"], "ac is one of"),
    (["--nodes", "1"], "nothing fits on 1 x 8 B200"),
    (["--keep", "pp=3"], "the kept values exclude every PP degree"),
    (["--global-tokens", "4M-1M"], "--global-tokens '4M-1M': write MIN-MAX"),
])
def test_plan_refusals(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["plan", "recipes/deepseek_v3_671b_b200.toml", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plan error: ") and message in err and err.count("\n") == 1


def test_check_names_the_plans_best_layout_when_the_recipe_is_slower(capsys, monkeypatch):
    """The flagship with nvshmem but an old layout (16 microbatches, no overlap) is predicted more
    than 10% slower than the plan's best with EP 32 and its global batch kept: `check` says so,
    with the overrides."""
    monkeypatch.chdir(REPO)
    old = ["--training.local_batch_size", "16", "--parallelism.pipeline_parallel_expert_parallel_overlap", "false",
           "--moe_comm.overlap", "none"]
    assert main(["check", "recipes/deepseek_v3_671b_b200.toml", "--skip-files", *old]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("plan "))
    assert "faster on this cluster with nvshmem, EP 32 and the global batch kept" in line
    assert "--moe_comm.overlap chunked" in line


def test_check_is_quiet_on_the_flagship_it_planned(capsys, monkeypatch):
    """The flagship carries the plan's best nvshmem layout with PP 8; the plan's best with its
    EP and global batch is within 10%: no plan line."""
    monkeypatch.chdir(REPO)
    assert main(["check", "recipes/deepseek_v3_671b_b200.toml", "--skip-files"]) == 0
    out = capsys.readouterr().out
    assert "\nplan " not in out and "<- this recipe" in out.split("\n  nvshmem ")[1].splitlines()[0]


def test_the_flagship_is_the_plans_best_nvshmem_layout():
    """recipes/deepseek_v3_671b_b200.toml carries the plan's best nvshmem layout with EP 32 and
    PP 8 kept, in the global batch range it was planned in (its header says how). When the
    model's constants change, re-plan the recipe and regenerate results/scale_model.md."""
    r = recipe.load(FLAGSHIP, [], device="cuda", check_paths=False)
    req = plan_verb.request(r, backends=["nvshmem"], keep=["ep=32", "pp=8"], global_tokens="1M-8M")
    best = planner.plan(req, calibration.calibrate(), top=1)["nvshmem"][0]
    assert best.overrides == ["--moe_comm.backend", "nvshmem"], best.overrides


@pytest.mark.parametrize("flags,message", [
    (["--nodes", "0"], "argument --nodes: '0' must be a whole number >= 1"),
    (["--nodes", "-2"], "argument --nodes: '-2' must be a whole number >= 1"),
    (["--nodes", "1.5"], "argument --nodes: '1.5' must be a whole number >= 1"),
    (["--gpus-per-node", "0"], "argument --gpus-per-node: '0' must be a whole number >= 1"),
    (["--top", "0"], "argument --top: '0' must be a whole number >= 1"),
    (["--top", "-1"], "argument --top: '-1' must be a whole number >= 1"),
    (["--headroom", "1"], "argument --headroom: '1' must be a share of the GPU's memory in [0, 1)"),
    (["--gpu", "X100"], "argument --gpu: invalid choice: 'X100'"),
    (["--backend", "foo"], "argument --backend: invalid choice: 'foo'"),
])
@pytest.mark.parametrize("where", ["before the recipe", "after the recipe"])
def test_plan_flags_refused_with_the_verbs_usage(flags, message, where, capsys, monkeypatch):
    """A value the plan cannot mean is refused by argparse (exit 2, before the recipe loads), with
    the usage of `python -m moe_comm plan`, wherever the flag stands."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(recipe, "load", lambda *a, **k: pytest.fail("the recipe was loaded"))
    argv = [*flags, "recipes/deepseek_v3_671b_b200.toml"] if where == "before the recipe" else \
        ["recipes/deepseek_v3_671b_b200.toml", *flags]
    with pytest.raises(SystemExit) as e:
        main(["plan", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m moe_comm plan ") and f"python -m moe_comm plan: error: {message}" in err


@pytest.mark.parametrize("verb", ["check", "train"])
def test_every_verbs_flags_after_the_recipe_name_the_verb(verb, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as e:
        main([verb, "recipes/debug_cpu.toml", "--nproc-per-node", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: python -m moe_comm {verb} ") and "__main__.py" not in err


def test_plan_gpu_is_case_insensitive(capsys, monkeypatch):
    """--gpu b200 is the GPU table's B200 (plan and check)."""
    monkeypatch.chdir(REPO)
    assert main(["plan", "recipes/deepseek_v3_671b_b200.toml", "--gpu", "b200", "--keep", "ep=32", "--keep", "pp=8",
                 "--backend", "nvshmem", "--top", "1"]) == 0
    assert "on 32 x 8 B200 (256 GPUs)" in capsys.readouterr().out
    from moe_comm import check

    parser = __import__("argparse").ArgumentParser()
    check.add_arguments(parser)
    assert parser.parse_args(["--gpu", "h100 pcie", "r.toml"]).gpu == "H100 PCIe"


@pytest.mark.parametrize("keep,message", [
    ("epp=32", "--keep 'epp=32': write KEY=VALUE"),
    ("ep=x", "--keep 'ep=x': ep takes a whole number"),
    ("ac=some", "ac is one of"),
])
def test_plan_refuses_a_bad_keep_before_loading_the_recipe(keep, message, capsys, monkeypatch):
    """What --keep says is checked before the recipe (and TorchTitan) load and long before the
    routing statistics."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(recipe, "load", lambda *a, **k: pytest.fail("the recipe was loaded"))
    assert main(["plan", "recipes/deepseek_v3_671b_b200.toml", "--keep", keep]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plan error: ") and message in err


def test_plan_says_why_nothing_fits_on_a_huge_cluster(capsys, monkeypatch):
    """100,000 nodes: even one sequence per data-parallel rank makes a global batch far above the
    range asked for; the refusal says so in those words, not that the kept values exclude all."""
    monkeypatch.chdir(REPO)
    assert main(["plan", "recipes/deepseek_v3_671b_b200.toml", "--nodes", "100000"]) == 2
    err = capsys.readouterr().err
    assert "kept values" not in err and err.count("\n") == 1
    assert "on 100000 x 8 B200 (800,000 GPUs) the smallest global batch is" in err
    assert "above the range searched" in err and "--global-tokens" in err and "fewer nodes" in err


def test_a_plan_prices_each_ranks_compute_once(monkeypatch):
    """A layout's compute is the same for every backend and MoE overlap: the plan asks the layer
    model once per layout, pipeline rank and range scenario (it asked once per backend and overlap,
    the larger part of a plan's time)."""
    from moe_comm.predict import layer_compute

    asked = []
    real = layer_compute._rank_ms

    def counted(bench, w, gpu, layers, embedding, output, **scenario):
        # each range scenario (peak share, imbalance) is a question of its own
        asked.append((tuple(vars(w.layout).values()), w.local_batch, w.microbatch, w.ac_mode, tuple(layers),
                      embedding, output, tuple(sorted(scenario.items()))))
        return real(bench, w, gpu, layers, embedding, output, **scenario)

    monkeypatch.setattr(layer_compute, "_rank_ms", counted)
    cal = calibration.calibrate()
    cal.layer_bench.memo.clear()
    r = recipe.load(FLAGSHIP, [], device="cuda", check_paths=False)
    req = plan_verb.request(r, backends=["nvshmem", "deepep", "nccl"], keep=["ep=32", "pp=8"])
    planner.plan(req, cal, top=1)
    assert asked and len(asked) == len(set(asked))


def test_the_product_cites_only_what_a_clone_has():
    """Every figure the product quotes points at a file of the repository or states its public
    source: `plan --explain` cited "NOTES section 8", a file users do not have."""
    cited = []
    for folder in ("moe_comm", "recipes", "experiments"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".toml", ".sh") and ("NOTES" in path.read_text() or "shared/" in path.read_text()):
                cited.append(str(path.relative_to(REPO)))
    assert cited == []
    r = recipe.load(FLAGSHIP, [], device="cuda", check_paths=False)
    req = plan_verb.request(r, backends=["nvshmem"], keep=["ep=32", "pp=8"])
    line = plan_verb.explain(r, req, calibration.calibrate())[0]
    assert "NOTES" not in line and "Megatron-Bridge performance summary, release 26.04.01" in line
