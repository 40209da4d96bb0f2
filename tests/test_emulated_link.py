"""The emulated network link of a one-GPU benchmark (moe_comm.kernels.emulated_link): how long
each call holds its SMs, what the setting takes and refuses, and that everything it produces says
it is emulated. The hold kernel compiles with csrc (tests/test_csrc_compile.py); it runs on the
device in experiments/emulated_link.py."""

import json
import shutil

import pytest

from moe_comm.kernels import emulated_link
from moe_comm.kernels.emulated_link import EmulatedLink
from moe_comm.kernels.limits import LIMITS
from moe_comm.metrics import keys
from moe_comm.metrics.peaks import resolve_peak
from moe_comm.metrics.step_line import StepLine


def test_bytes_at_a_rate_become_microseconds():
    assert emulated_link.hold_us_for_bytes(43e6, 43.0) == pytest.approx(1000.0)  # 43 MB at 43 GB/s: 1 ms
    link = emulated_link.parse("dispatch_bytes=86e6,combine_bytes=43e6,gbps=43,tokens=8192")
    assert (link.dispatch_us, link.combine_us, link.tokens) == (pytest.approx(2000.0), pytest.approx(1000.0), 8192)


def test_a_call_holds_its_kinds_time_in_proportion_to_its_tokens():
    link = emulated_link.parse("dispatch_us=1200,combine_us=800,tokens=8192")
    assert link.hold_ns("dispatch", 8192) == 1_200_000
    assert link.hold_ns("combine", 8192) == 800_000
    assert link.hold_ns("dispatch", 4096) == 600_000  # a chunk of the chunked overlap: half the bytes
    assert link.hold_ns("combine", 16384) == 800_000  # never more than a full call
    assert emulated_link.BACKWARD_KIND == {"dispatch": "combine", "combine": "dispatch"}
    every_call = emulated_link.parse("dispatch_us=5,combine_us=7")
    assert every_call.hold_ns("dispatch", 1) == 5000 and every_call.tokens == 0


@pytest.mark.parametrize("text, fix", [
    ("dispatch_us=1", "dispatch_us=..,combine_us=.."),
    ("dispatch_us=1,combine_us=1,gbps=4", "dispatch_us=..,combine_us=.."),
    ("dispatch_bytes=1,combine_bytes=1,gbps=0", "gbps"),
    ("dispatch_us=-1,combine_us=1", "a number >= 0"),
    ("dispatch_us=fast,combine_us=1", "a number >= 0"),
    ("dispatch_us=1,combine_us", "a number >= 0"),
    (f"dispatch_us={LIMITS.max_emulated_hold_us + 1},combine_us=1", "at most"),
])
def test_a_bad_setting_says_what_it_takes(text, fix):
    with pytest.raises(ValueError, match=emulated_link.ENV) as e:
        emulated_link.parse(text)
    assert fix in str(e.value)


def test_only_a_one_gpu_run_emulates_a_link():
    env = {emulated_link.ENV: "dispatch_us=10,combine_us=10"}
    assert emulated_link.for_backend(1, {}) is None
    assert emulated_link.for_backend(1, env) == EmulatedLink(10.0, 10.0, 0, "dispatch_us=10,combine_us=10")
    with pytest.raises(RuntimeError, match="EP 4, whose links are real"):
        emulated_link.for_backend(4, env)


def test_what_it_produces_says_emulated():
    link = emulated_link.parse("dispatch_us=1450,combine_us=1450,tokens=8192")
    assert link.describe() == {"emulated": True, "dispatch_us_per_call": 1450.0, "combine_us_per_call": 1450.0,
                               "tokens_per_full_call": 8192,
                               "setting": "MOE_COMM_EMULATED_LINK=dispatch_us=1450,combine_us=1450,tokens=8192"}
    assert link.label().startswith("emulated link: dispatch 1450 us, combine 1450 us per call of 8192 tokens")
    line = StepLine(step=3, total_steps=5, seconds_per_step=0.4, eta_s=1.0, loss=6.0, grad_norm=1.0,
                    tokens_per_s=20000.0, mfu_pct=float("nan"), peak=resolve_peak("CPU", []), mem_gib=None,
                    mem_pct=None, dispatch_ms=9.1, combine_ms=8.2, comm_pct=3.0, hidden_pct=60.0,
                    emulated_link=True)
    assert "dispatch 9.1ms combine 8.2ms (3.0% of step, 60% hidden, emulated link)" in line.format()


def test_the_run_says_emulated_in_its_header_and_every_jsonl_line(tmp_path, caplog, monkeypatch):
    from test_metrics_processor import _console, _processor, _train_step

    monkeypatch.setenv(emulated_link.ENV, "dispatch_us=1450,combine_us=1450,tokens=8192")
    processor = _processor(tmp_path, caplog, "--moe_comm.backend", "nvshmem", "--training.steps", "1")
    _train_step(processor, 0.01)
    processor.log(1, 1.0, 1.0, 0.5)
    processor.close()
    row = json.loads(open(tmp_path / "dump" / keys.JSONL_NAME).readline())
    assert row[keys.EMULATED_LINK]["emulated"] is True and row[keys.EMULATED_LINK]["dispatch_us_per_call"] == 1450.0
    assert any("EMULATED network: emulated link: dispatch 1450 us" in m for m in _console(caplog))
    # and what reads the run back: the benchmark's measurement, `report`'s tables and legends
    from experiments import emulated_link as bench
    from moe_comm import report

    assert bench.measured(tmp_path / "dump", warmup=0)["emulated_link"]["dispatch_us_per_call"] == 1450.0
    assert report.load_run(tmp_path / "dump" / keys.JSONL_NAME).backend_name.endswith("(EMULATED link)")


def test_another_backend_says_it_ignores_the_setting(tmp_path, caplog, monkeypatch):
    from test_metrics_processor import _console, _processor

    monkeypatch.setenv(emulated_link.ENV, "dispatch_us=1,combine_us=1")
    processor = _processor(tmp_path, caplog, "--moe_comm.backend", "nccl")
    assert keys.EMULATED_LINK not in processor.static_fields
    assert any("is set but backend nccl emulates no link" in m for m in _console(caplog))
    processor.close()


def test_the_benchmark_takes_its_variants_and_labels_its_results():
    from experiments import emulated_link as bench

    assert bench.variant_overrides("none") == ("none", ["--moe_comm.overlap", "none"], {})
    assert bench.variant_overrides("chunked") == ("chunked", ["--moe_comm.overlap", "chunked"], {})
    assert bench.variant_overrides("acfull=--activation_checkpoint.mode=full,--moe_comm.overlap=chunked") == (
        "acfull", ["--activation_checkpoint.mode", "full", "--moe_comm.overlap", "chunked"], {})
    # the recompute's baseline: TorchTitan's own checkpointing, which sends again (a benchmark switch)
    assert bench.variant_overrides("acfull_resend=--activation_checkpoint.mode=full,MOE_COMM_RECOMPUTE_COMM=1") == (
        "acfull_resend", ["--activation_checkpoint.mode", "full"], {"MOE_COMM_RECOMPUTE_COMM": "1"})
    with pytest.raises(SystemExit, match="--section.field=value"):
        bench.variant_overrides("bad=activation_checkpoint.mode=full")
    link = emulated_link.parse("dispatch_us=3000,combine_us=3000,tokens=8192")
    row = {"variant": "chunked", "emulated_link": True, "status": "ok",
           "measured": {"step_ms": 410.0, "moe_comm_ms": 30.0, "moe_comm_exposed_ms": 10.0},
           "predicted": {"step_ms": 400.0, "moe_comm_exposed_ms": 11.0}, "exposed_error_pct": 10.0,
           "within_target": True}
    text = bench.markdown({"date": "today", "recipe": "r.toml", "num_sms": 20, "link": link.describe(),
                           "link_source": "given", "rows": [row], "command": "python experiments/emulated_link.py"})
    assert text.startswith("# MoE overlap over an EMULATED network link, one GPU")
    assert "Not a network" in text and "| chunked | emulated | 410.0 | 400.0 | 30.0 | 10.0 | 11.0 | +10.0% | True |" in text


def test_the_benchmark_asks_the_scale_model_for_the_same_inputs():
    """experiments/emulated_link.py's two calls into moe_comm.predict: the flagship rank's transfers
    it emulates, and the model's step for the one-GPU run with each transfer's network time set to
    the link's hold (the hold replaces what the network would take, the rest is the model's)."""
    import importlib.util
    import sys as _sys

    from moe_comm.predict.assumptions import REPO

    spec = importlib.util.spec_from_file_location("emulated_link_bench", REPO / "experiments" / "emulated_link.py")
    bench = importlib.util.module_from_spec(spec)
    _sys.modules["emulated_link_bench"] = bench
    spec.loader.exec_module(bench)
    transfers = bench.flagship_transfers("recipes/deepseek_v3_671b_b200.toml", "B200")
    assert transfers["dispatch"]["network_bytes"] > 0 and transfers["dispatch"]["backend"] == "nvshmem"
    slow = emulated_link.parse("dispatch_us=5000,combine_us=5000,tokens=8192")
    fast = emulated_link.parse("dispatch_us=50,combine_us=50,tokens=8192")
    p_slow, p_fast = (bench.model_prediction("recipes/deepseek_v3_671b_h200x1.toml", [], link) for link in (slow, fast))
    assert p_slow["moe_comm_exposed_ms"] > p_fast["moe_comm_exposed_ms"] > 0
    assert p_slow["step_ms"] > p_fast["step_ms"]
    # the recompute's baseline switch reaches the model: under full AC the recompute sends again
    full = ["--activation_checkpoint.mode", "full"]
    shipped = bench.model_prediction("recipes/deepseek_v3_671b_h200x1.toml", full, slow)
    resend = bench.model_prediction("recipes/deepseek_v3_671b_h200x1.toml", full, slow, {"MOE_COMM_RECOMPUTE_COMM": "1"})
    assert resend["moe_comm_exposed_ms"] == pytest.approx(1.5 * shipped["moe_comm_exposed_ms"], rel=0.02)


def test_report_only_measures_the_runs_an_earlier_invocation_left(tmp_path):
    """--report-only trains nothing: it reads the runs left in OUT/runs/emulated_link (here the
    committed one-H200 runs) as the invocation that made them reads a run it has just made."""
    from experiments import emulated_link as bench
    from moe_comm.predict.assumptions import REPO

    committed = REPO / "results" / "h200x1"
    shutil.copytree(committed / "runs" / "emulated_link", tmp_path / "runs" / "emulated_link")
    assert bench.main(["--out", str(tmp_path), "--steps", "20", "--no-wandb", "--report-only",
                       "--variants", "none", "chunked"]) == 0
    want = {r["variant"]: r for r in json.loads((committed / "emulated_link.json").read_text())["rows"]}
    rows = json.loads((tmp_path / "emulated_link.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["none", "chunked"]
    for row in rows:
        assert row["status"] == "ok" and row["measured"] == want[row["variant"]]["measured"]
        assert row["command"] == want[row["variant"]]["command"] and "torch.distributed.run" in row["command"]
        assert row["predicted"]["moe_comm_exposed_ms"] > 0 and row["within_target"] is not None
    text = (tmp_path / "emulated_link.md").read_text()
    assert "--report-only" in text and "from the runs made (on one H200) by:" in text
