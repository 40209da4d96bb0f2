"""The `train` verb's torchrun command: one node, the multi-node c10d contract, and errors."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_comm.__main__ import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.fixture
def dry(capsys, tmp_path):
    """`train --dry-run` into a fresh dump folder (a folder holds one run's identity)."""
    def run(*args: str) -> SimpleNamespace:
        rc = main(["train", "recipes/debug_cpu.toml", "--dry-run", "--job.dump_folder", str(tmp_path), *args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)

    return run


def _cmd(proc) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return next(l for l in proc.stdout.splitlines() if l.startswith("+ "))


def test_single_node_command_with_overrides(dry, tmp_path):
    line = _cmd(dry("--training.steps", "5"))
    assert "--standalone --nproc_per_node 2" in line
    assert line.endswith("-m moe_comm.trainer --job.config_file recipes/debug_cpu.toml --job.dump_folder "
                         f"{tmp_path} --training.steps 5")


def test_nproc_override_and_double_dash(dry):
    line = _cmd(dry("--nproc-per-node", "4", "--", "--training.steps", "5"))
    assert "--nproc_per_node 4" in line and line.endswith("--training.steps 5")


def test_log_rank_chooses_the_ranks_torchrun_shows(dry):
    """Rank 0's output by default; `--log-rank all` every rank's (tests/test_pipeline_logs.py
    reads what each rank of a PP run prints)."""
    assert "--local-ranks-filter 0 " in _cmd(dry())
    assert "--local-ranks-filter 1,3 " in _cmd(dry("--nproc-per-node", "4", "--log-rank", "1,3"))
    assert "--local-ranks-filter" not in _cmd(dry("--nproc-per-node", "4", "--log-rank", "all"))


def test_multi_node_contract(dry):
    line = _cmd(dry("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "10.0.0.1:29500", "--rdzv-id", "42"))
    assert (
        "--nnodes 2 --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint 10.0.0.1:29500 --rdzv_id 42"
        in line
    )
    assert "--standalone" not in line


def test_multi_node_flags_go_together(dry):
    proc = dry("--nnodes", "2", "--nproc-per-node", "1")
    assert proc.returncode == 2 and "--rdzv-endpoint" in proc.stderr


def test_invalid_layout_stops_before_torchrun(dry):
    proc = dry("--nproc-per-node", "3")
    assert proc.returncode == 2
    assert "expert_parallel_degree = 2" in proc.stderr and "+ " not in proc.stdout


def test_multi_node_recipe_needs_rendezvous(dry):
    proc = dry("--cluster.nodes", "2")
    assert proc.returncode == 2
    assert "[cluster] nodes = 2" in proc.stderr and "--rdzv-endpoint" in proc.stderr


# ---- check and train agree about this machine (issue 32 item 4) -------------------------------

ONE_GPU = "recipes/deepseek_v3_671b_h200x1.toml"


def test_check_lists_what_train_refuses_on_a_machine_without_a_gpu(capsys, monkeypatch, tmp_path):
    """The one-GPU recipe on a machine without a GPU: `check` still plans it for its H200, then
    lists what `train` refuses here as a launch blocker (exit 1), in train's own words; it said
    "ready" while `train` refused."""
    from moe_comm import gpus

    monkeypatch.setattr(gpus, "this_machine", lambda: None)
    dump = ["--job.dump_folder", str(tmp_path / "d")]
    assert main(["train", ONE_GPU, "--dry-run", *dump]) == 2
    refused = capsys.readouterr().err.strip().removeprefix("recipe error: ")
    assert "needs CUDA GPUs" in refused
    assert main(["check", ONE_GPU, *dump]) == 1
    out = capsys.readouterr().out
    assert "scale model H200" in out and "ready" not in out
    assert f"launch blockers (1)" in out
    assert f"  - `train` on this machine (no CUDA GPU) refuses this recipe: {refused}" in out
    assert main(["check", ONE_GPU, "--skip-files", *dump]) == 0  # for another machine: nothing blocks here


def test_a_cpu_run_beyond_this_machines_memory_is_refused_before_launch(capsys, monkeypatch, tmp_path):
    """The one-GPU recipe's 5.7B model with nccl on a 23 GiB CPU machine: `train` (and --dry-run)
    refuse it with the estimate and the memory, `check` lists the same; the CPU main job fits."""
    from moe_comm import machine

    monkeypatch.setattr(machine, "memory_bytes", lambda: 23 * 2**30)
    flags = ["--moe_comm.backend", "nccl", "--job.dump_folder", str(tmp_path / "d")]
    assert main(["train", ONE_GPU, "--dry-run", *flags]) == 2
    out = capsys.readouterr()
    assert "+ " not in out.out
    assert "needs about 97.5 GiB (1 process(es) x 97.5 GiB" in out.err and "this machine has 23.0 GiB" in out.err
    assert "--model.flavor debugmodel" in out.err
    assert main(["check", ONE_GPU, "--device", "cpu", *flags]) == 1
    assert "this machine has 23.0 GiB" in capsys.readouterr().out.split("launch blockers")[1]
    assert main(["train", "recipes/debug_cpu.toml", "--dry-run", "--job.dump_folder", str(tmp_path / "e")]) == 0
