"""experiments/mfu_sweep.py with a stand-in launcher: the sweep plan, the fixed environment of
every run, a failed (OOM) run recorded with its error tail while the sweep goes on, the
results JSON, the plots and the instrumentation-cost pairs."""

import json
import sys
import textwrap
from pathlib import Path

from in_process import run_script
from moe_comm.metrics import keys

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "mfu_sweep.py"

# Stands in for `python -m moe_comm train`: writes a JSONL like a real run, or dies like an OOM.
# Stands in for `python -m moe_comm train`: writes a JSONL like a real run (key names filled in
# from moe_comm.metrics.keys; no torch import, so each fake run takes milliseconds), or dies
# like an OOM.
FAKE_TRAIN = textwrap.dedent(
    """
    import json, os, sys
    args = sys.argv[1:]
    opt = lambda name: args[args.index(name) + 1]
    backend, batch, seq = opt("--moe_comm.backend"), int(opt("--training.local_batch_size")), int(opt("--training.seq_len"))
    print("env", os.environ["NCCL_NVLS_ENABLE"], os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"],
          os.environ["NVSHMEM_DISABLE_NVLS"], os.environ["MOE_COMM_INSTRUMENT"], os.environ["WANDB_RUN_NAME"])
    if backend == "nvshmem" and batch == 4:
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB")
        sys.exit(1)
    tps = 1000.0 * batch * (1.2 if backend == "nvshmem" else 1.0)
    if os.environ["MOE_COMM_INSTRUMENT"] == "0":
        tps *= 1.005
    with open(os.path.join(opt("--job.dump_folder"), "metrics.jsonl"), "w") as f:
        for step in range(1, int(opt("--training.steps")) + 1):
            f.write(json.dumps({{"step": step, "{recipe}": "r", "{backend}": backend, "{batch}": batch,
                                "{seq}": seq, "{tps}": tps, "{mfu}": tps / 100, "{step_ms}": 100.0,
                                "{dispatch}": 2.0, "{combine}": 3.0, "{exposed}": 5.0}}) + "\\n")
    """
)


def test_sweep_survives_a_failed_run(tmp_path):
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN.format(
        recipe=keys.RECIPE, backend=keys.BACKEND, batch=keys.LOCAL_BATCH, seq=keys.SEQ_LEN,
        tps=keys.TPS, mfu=keys.MFU, step_ms=keys.STEP_MS, dispatch=keys.DISPATCH_MS,
        combine=keys.COMBINE_MS, exposed=keys.COMM_EXPOSED_PCT))
    out = tmp_path / "results"
    cmd = ["--recipe", "recipes/some.toml", "--backends", "nccl", "nvshmem", "--batch", "2", "4",
           "--seq", "128", "--steps", "4", "--out", str(out), "--name", "sweep", "--no-wandb",
           "--instrument-cost", "--launcher", f"{sys.executable} {fake}"]
    proc = run_script(SCRIPT, *cmd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    results = json.loads((out / "sweep.json").read_text())
    runs = {r["name"]: r for r in results["runs"]}
    # 2 backends x 2 batches x 1 seq, each instrumented and bare
    assert len(runs) == 8
    failed = runs["some-nvshmem-b4-s128"]
    assert failed["status"] == "failed" and failed["error"] == "oom"
    assert "CUDA out of memory" in failed["error_tail"]
    ok = runs["some-nvshmem-b2-s128"]
    assert ok["status"] == "ok" and ok["summary"]["tps"] == 2400.0
    assert runs["some-nccl-b4-s128"]["status"] == "ok"  # ran after the failure
    assert results["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                              "NVSHMEM_DISABLE_NVLS": "1"}
    log = (out / ok["dump_folder"] / "train.log").read_text()
    assert log.startswith("env 0 1 1 1 nvshmem-b2-s128")
    bare_log = (out / runs["some-nvshmem-b2-s128-noinst"]["dump_folder"] / "train.log").read_text()
    assert bare_log.startswith("env 0 1 1 0 ")
    cost = {(c["backend"], c["local_batch_size"]): c for c in results["instrument_cost"]}
    assert set(cost) == {("nccl", 2), ("nccl", 4), ("nvshmem", 2)}
    assert abs(cost[("nccl", 2)]["slowdown_pct"] - 100 * 0.005 / 1.005) < 1e-9

    for name in ("report.md", "tps.png", "mfu_vs_tokens.png", "step_breakdown.png"):
        assert (out / "sweep" / name).is_file(), name
    assert "failed: some-nvshmem-b4-s128: oom" in proc.stdout
    report_md = (out / "sweep" / "report.md").read_text()
    assert "- some-nvshmem-b4-s128: oom" in report_md and "![mfu_vs_tokens](mfu_vs_tokens.png)" in report_md
    assert "for results/README.md:\n    python experiments/mfu_sweep.py --recipe recipes/some.toml" in proc.stdout

    # --resume keeps the 8 recorded runs; --budget-s stops after one new run (of 4 with batch 8)
    resumed = run_script(SCRIPT, *cmd[:cmd.index("--batch") + 1], "2", "4", "8", *cmd[cmd.index("--batch") + 3:],
                         "--resume", "--budget-s", "0.001", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "4 runs to do, 8 kept from before" in resumed.stdout
    assert "with 3 runs left: run the same command with --resume" in resumed.stdout
    again = json.loads((out / "sweep.json").read_text())
    assert len(again["runs"]) == 9 and len(again["commands"]) == 2
    assert again["runs"][-1]["name"] == "some-nccl-b8-s128"

    # results/ is portable: moved elsewhere, --report-only rebuilds table and plots from it
    moved = tmp_path / "moved"
    out.rename(moved)
    (moved / "sweep" / "report.md").unlink()
    rebuilt = run_script(SCRIPT, "--out", str(moved), "--name", "sweep", "--report-only", cwd=tmp_path)
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    assert "| r | nvshmem | b2xs128 | 2,400 | 1.200 |" in (moved / "sweep" / "report.md").read_text()
