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
    assert line.endswith("-m torchtitan.train --job.config_file recipes/debug_cpu.toml --job.dump_folder "
                         f"{tmp_path} --training.steps 5")


def test_nproc_override_and_double_dash(dry):
    line = _cmd(dry("--nproc-per-node", "4", "--", "--training.steps", "5"))
    assert "--nproc_per_node 4" in line and line.endswith("--training.steps 5")


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
