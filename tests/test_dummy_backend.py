"""A fourth backend, defined and registered in this file and nowhere else: `check`, `plan`, the
run names, the metrics processor and `report` ask its class what they ask the other three
(its abilities, refusals, identity options, label, colour, how it sends, what the scale model
prices), so adding a backend touches no other file (issue 33)."""

import json
import logging

import pytest
import torch
import torch.distributed as dist

from moe_comm import backends, recipe
from moe_comm.__main__ import main
from moe_comm.backends import CommBackend, CostTraits, DispatchResult, MoELayerSpec
from moe_comm.config import MoEComm
from moe_comm.errors import RecipeError

DEBUG = "recipes/debug_cpu.toml"
MAX_EP = 2  # the dummy's own limit, which its check_run enforces


class DummyBackend(CommBackend):
    """Moves nothing between ranks: expands each token to one row per pick, expert-major, and
    sums them back with the routing weights. On any device, at EP <= MAX_EP."""

    name = "dummy"
    overlap = ("none", "chunked")
    sends_once_per_rank = True
    IDENTITY_OPTIONS = ("num_sms", "wait_timeout_s")
    color = "#123456"
    costs = CostTraits(hierarchical=True, transport="our kernels", host_syncs_per_dispatch=2, layout="TorchTitan")

    @classmethod
    def check_run(cls, run):
        notes = super().check_run(run)
        if run.ep > MAX_EP:
            raise RecipeError(f"[parallelism] expert_parallel_degree = {run.ep}: the dummy backend serves at most "
                              f"{MAX_EP} ranks")
        return notes + ["the dummy backend moves nothing"]

    @classmethod
    def ignored_options(cls, run):
        ignored = super().ignored_options(run)
        for option in cls.IDENTITY_OPTIONS:
            ignored.pop(option)
        return ignored

    def dispatch(self, x_TD, topk_idx_TK, topk_w_TK):
        top_k = topk_idx_TK.shape[1]
        order_R = topk_idx_TK.flatten().argsort(stable=True)
        counts_E = torch.bincount(topk_idx_TK.flatten(), minlength=self.layer.num_experts)
        return DispatchResult(x_TD[order_R // top_k], counts_E, (order_R, topk_w_TK, x_TD.shape[0]))

    def combine(self, y_RD, handle):
        order_R, topk_w_TK, num_tokens = handle
        weighted_RD = y_RD * topk_w_TK.flatten()[order_R, None]
        return torch.zeros(num_tokens, y_RD.shape[1], dtype=y_RD.dtype).index_add(0, order_R // topk_w_TK.shape[1],
                                                                                 weighted_RD)


@pytest.fixture
def dummy(monkeypatch):
    monkeypatch.chdir(recipe.REPO)
    backends.register(DummyBackend)
    yield DummyBackend
    backends.unregister("dummy")


def test_the_registry_takes_it_and_gives_it_back(dummy):
    assert backends.names()[-1] == "dummy" and backends.backend_class("dummy") is dummy
    with pytest.raises(ValueError, match="registered already"):
        backends.register(type("Other", (DummyBackend,), {}))
    backends.unregister("dummy")
    assert "dummy" not in backends.names()
    with pytest.raises(RecipeError, match=r"backend = 'dummy' is not a backend; choose one of \['nccl', 'nvshmem', 'deepep'\]"):
        backends.backend_class("dummy")
    backends.register(dummy)  # for the fixture to remove


def test_check_asks_its_class(dummy, capsys):
    assert main(["check", DEBUG, "--skip-files", "--moe_comm.backend", "dummy", "--moe_comm.network_sms", "4"]) == 0
    out = capsys.readouterr().out
    assert "backend     dummy (num_sms 20) on cpu" in out
    assert "note        the dummy backend moves nothing" in out  # its check_run's note
    # its ignored options, and who reads them instead
    assert '[moe_comm] network_sms = 4 has no effect here: backend "dummy" does not read it' in out
    # on GPUs the scale model prices it from its cost traits, beside the others
    assert main(["check", DEBUG, "--skip-files", "--moe_comm.backend", "dummy", "--device", "cuda", "--gpu", "H200"]) == 0
    out = capsys.readouterr().out
    table = out.split("per rank and step:")[1].splitlines()[2:6]
    assert [line.split()[0] for line in table] == ["nccl", "deepep", "dummy", "nvshmem"]  # the baseline, then by name
    assert table[2].endswith("<- this recipe")
    # a name it does not have: the error lists it among the choices
    assert main(["check", DEBUG, "--skip-files", "--moe_comm.backend", "dumy"]) == 2
    assert ("override --moe_comm.backend dumy: expected one of 'nccl', 'nvshmem', 'deepep', 'dummy'; "
            "did you mean 'dummy'?") in capsys.readouterr().err


def test_its_refusal_is_its_check_run(dummy):
    with pytest.raises(RecipeError, match=r"expert_parallel_degree = 4: the dummy backend serves at most 2 ranks"):
        recipe.load(DEBUG, ["--moe_comm.backend", "dummy", "--parallelism.expert_parallel_degree", "4"],
                    nproc_per_node=4, check_paths=False)


def test_the_scale_model_prices_it_from_its_traits(dummy):
    from moe_comm.predict import calibration, scale_model

    r = recipe.load(DEBUG, ["--moe_comm.backend", "dummy"], device="cuda", check_paths=False)
    w, cal = scale_model.workload_from_recipe(r), calibration.calibrate()
    cluster = scale_model.cluster_for("H200", 1, 2, cal)
    ours, nvshmem = (scale_model.layer_comm(b, w, cluster, cal) for b in ("dummy", "nvshmem"))
    for mine, theirs in zip(ours.transfers, nvshmem.transfers):
        # the same hierarchical rows and kernels as nvshmem; its two host round trips per forward
        # dispatch unmeasured, so the dispatch costs what a host-driven call of the all-to-all path
        # costs (between one launch and that cost per round trip); TorchTitan's permute instead of our layout
        assert (mine.network_rows, mine.nvlink_rows, mine.fixed_us) == (theirs.network_rows, theirs.nvlink_rows,
                                                                         theirs.fixed_us)
        assert mine.host_us == (cal.nccl_call_us if mine.name == "dispatch" else 0.0)
        assert mine.layout_us != theirs.layout_us
    pessimistic = scale_model.layer_comm("dummy", w, cluster, cal, inputs=cal.scenario("low"))
    assert pessimistic.transfers[0].host_us == 2 * cal.nccl_call_us
    assert scale_model.refusal("dummy", w) == ""
    assert "Choice(backend='dummy', dispatch_dtype='bf16')" in repr(scale_model.choices())


def test_plan_ranks_it_and_shows_its_refusal(dummy, capsys):
    assert main(["plan", DEBUG, "--gpu", "H200", "--backend", "dummy", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "dummy: 2 best feasible layout(s), predicted" in out
    assert "--moe_comm.backend dummy" in out
    # at EP 4 its check_run refuses it, and the plan says so with its words
    assert main(["plan", DEBUG, "--gpu", "H200", "--backend", "dummy", "--backend", "nccl", "--keep", "ep=4",
                 "--cluster.gpus_per_node", "4", "--parallelism.expert_parallel_degree", "4"]) == 0
    out = capsys.readouterr().out
    assert ("dummy: no feasible layout: refused: [parallelism] expert_parallel_degree = 4: the dummy backend "
            "serves at most 2 ranks") in out
    assert "nccl: " in out and "best feasible layout(s)" in out


def test_its_runs_are_named_by_its_identity_options(dummy):
    from moe_comm.metrics import naming

    r = recipe.load(DEBUG, ["--moe_comm.backend", "dummy", "--moe_comm.wait_timeout_s", "5"], check_paths=False)
    identity = naming.run_identity(r.config, r.layout.nodes, r.layout.procs_per_node)
    assert {k: identity[k] for k in ("backend", "num_sms", "wait_timeout_s")} == {
        "backend": "dummy", "num_sms": 20, "wait_timeout_s": 5.0}
    assert "dispatch_dtype" not in identity
    assert naming.run_name(identity) == "debug_cpu-dummy-sm20-1x2-ep2-b2x128-fp32"


def test_the_metrics_processor_and_report_ask_its_class(dummy, world_of_one, tmp_path, caplog, monkeypatch):
    import moe_comm.titan  # noqa: F401  the CPU adaptations
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    from moe_comm.metrics import build_metrics_processor, instrument, instrumented, keys

    # the processor summarises every live instrumented backend of the process (one model per
    # process in a run); here only this test's, whatever earlier tests of the session left alive
    monkeypatch.setattr(instrumented, "_registry", [])

    caplog.set_level(logging.INFO)
    runs = tmp_path / "runs"
    for name in ("dummy", "nccl"):
        job_config = ConfigManager().parse_args([
            "--job.custom_config_module", "moe_comm.config", "--job.dump_folder", str(runs / name),
            "--metrics.log_freq", "1", "--metrics.no-enable_wandb", "--training.steps", "4",
            "--training.local_batch_size", "1", "--training.seq_len", "3", "--moe_comm.backend", name])
        processor = build_metrics_processor(job_config, ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1,
                                                                     ep=1, etp=1, world_size=1))
        processor.num_flops_per_token = 1_000_000
        layer = instrument(backends.build_backend(job_config.moe_comm, MoELayerSpec(4, 2, 8), dist.group.WORLD))
        assert layer.sends_once_per_rank == (name == "dummy")
        for step in range(1, 5):
            processor.ntokens_since_last_log += 3
            processor.data_loading_times.append(0.0)
            x_TD = torch.randn(3, 8, requires_grad=True)
            result = layer.dispatch(x_TD, torch.tensor([[0, 2], [2, 3], [1, 0]]), torch.rand(3, 2))
            layer.combine(result.recv_x_RD, result.handle).sum().backward()
            processor.log(step, 1.0 / step, 1.0 / step, 0.5)
        processor.close()
    first = json.loads((runs / "dummy" / "metrics.jsonl").read_text().splitlines()[0])
    assert (first[keys.BACKEND], first[keys.SENDS_PER]) == ("dummy", "rank")
    assert any("backend dummy (20 SMs)" in r.getMessage() for r in caplog.records)  # the header: its SM budget

    from moe_comm import plots, report

    out = tmp_path / "report"
    assert main(["report", str(runs), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [s["backend_name"] for s in summary] == ["nccl", "dummy-sm20"]  # the baseline first, then its label
    assert summary[1]["vs_nccl"] is not None
    assert plots.backend_color("dummy") == "#123456"
    styles = report.run_styles([report.load_run(runs / "dummy" / "metrics.jsonl")])
    assert styles[0]["color"] == "#123456"


def test_a_backend_without_a_colour_gets_one_by_its_name(dummy):
    from moe_comm import plots

    class Plain(DummyBackend):
        name = "plain"
        color = ""

    backends.register(Plain)
    try:
        assert plots.backend_color("plain") in plots.SPARE_COLORS
        assert plots.backend_color("plain") == plots.backend_color("plain")
    finally:
        backends.unregister("plain")
