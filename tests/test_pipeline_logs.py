"""Pipeline parallelism's logs (issue 15, item 8), on a real CPU run: 4 gloo ranks, PP 2 x
FSDP 2, EP 2 within each stage.

Before: ranks off the last stage printed TorchTitan's placeholder `loss: -2.00000`, and only the
metrics rank's comm reached the JSONL, so stage 0's MoE layers were never recorded. Now every
rank's step line carries the last stage's loss and its own stage's comm, and the JSONL holds
both stages' comm (moe_comm/pp{r}/...) besides the whole model's.
"""

import json
import math

import pytest

from moe_comm.metrics import keys
from moe_comm.metrics.pipeline import loss_pp_rank, stage_key
from test_console import STEP_LINE_RE

STEPS = 2  # conftest.SHARED_RUNS["pp2"]



def test_the_loss_lives_on_the_last_stage_or_rank_0_for_v_schedules():
    assert loss_pp_rank("1F1B", 8) == 7
    assert loss_pp_rank("Interleaved1F1B", 4) == 3
    assert loss_pp_rank("ZBVZeroBubble", 4) == 0
    assert loss_pp_rank("DualPipeV", 4) == 0
    assert stage_key(3, keys.DISPATCH_MS) == "moe_comm/pp3/dispatch_ms"


@pytest.fixture(scope="module")
def pp_run(shared_run):
    """conftest's "pp2" run: recipes/debug_cpu.toml's training on 4 ranks with
    --parallelism.pipeline_parallel_degree 2, 2 steps; its ranks' logs, which `train --log-rank
    all` relays to the console, together."""
    proc = shared_run("pp2")
    logs = sorted((proc.dump / "logs").glob("rank*.log"))
    assert len(logs) == 4, logs
    return "".join(log.read_text() for log in logs), proc.dump


def test_every_rank_prints_the_real_loss_and_its_stage(pp_run):
    out, dump = pp_run
    assert "loss -" not in out and "loss: -" not in out  # no placeholder, on any rank
    lines = [STEP_LINE_RE.match(l.split(" - INFO - ", 1)[1]) for l in out.splitlines()
             if " - INFO - step " in l]
    assert len(lines) == 4 * STEPS and all(lines)
    assert sorted(m["pp"] for m in lines) == ["0"] * 2 * STEPS + ["1"] * 2 * STEPS
    records = [json.loads(l) for l in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # one writer
    for record in records:
        loss = f"{record[keys.LOSS]:.4f}"
        assert float(loss) > 0
        assert {m["loss"] for m in lines if int(m["step"]) == record["step"]} == {loss}


def test_jsonl_holds_every_stages_comm(pp_run):
    _, dump = pp_run
    for record in [json.loads(l) for l in (dump / "metrics.jsonl").read_text().splitlines()]:
        per_stage = [record[stage_key(r, keys.DISPATCH_MS)] for r in (0, 1)]
        assert all(ms > 0 for ms in per_stage), record
        # the whole model's dispatch time is both stages' (each has its own MoE layers)
        assert record[keys.DISPATCH_MS] == pytest.approx(sum(per_stage))
        exposed = [record[stage_key(r, keys.COMM_EXPOSED_PCT)] for r in (0, 1)]
        assert record[keys.COMM_EXPOSED_PCT] == pytest.approx(max(exposed))
        assert not math.isnan(record[keys.IMBALANCE_RANK])
