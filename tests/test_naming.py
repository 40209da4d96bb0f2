"""Every run has its own identity: job name, dump folder, W&B name/group/id, and a dump folder
that refuses another run (moe_comm.metrics.naming). No training: the names come from recipes."""

import json
import os
from pathlib import Path

import pytest

from moe_comm import recipe
from moe_comm.__main__ import main as cli_main
from moe_comm.errors import RecipeError
from moe_comm.metrics import naming

REPO = Path(__file__).resolve().parents[1]
FLAGSHIP = "recipes/deepseek_v3_671b_b200.toml"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


def identity(path=FLAGSHIP, *overrides):
    r = recipe.load(path, list(overrides), check_paths=False)
    return naming.run_identity(r.config, r.layout.nodes, r.layout.procs_per_node)


def test_backend_and_the_options_that_change_results_change_the_name():
    nccl = identity(FLAGSHIP, "--moe_comm.backend", "nccl")
    assert naming.run_name(nccl) == "deepseek_v3_671b_b200-nccl-chunked-32x8-ep32-pp8-b64x4096"
    names = {
        naming.run_name(identity(FLAGSHIP, *o))
        for o in (["--moe_comm.backend", "nccl"], ["--moe_comm.backend", "nvshmem"], ["--moe_comm.backend", "nvshmem", "--moe_comm.num_sms", "24"],
                  ["--moe_comm.backend", "nvshmem", "--moe_comm.dispatch_dtype", "fp8"],
                  ["--moe_comm.backend", "deepep", "--cluster.container_image", "img"],
                  ["--training.local_batch_size", "32"], ["--cluster.nodes", "64"])
    }
    assert len(names) == 7, names
    assert "deepseek_v3_671b_b200-nvshmem-sm20-fp8-chunked-32x8-ep32-pp8-b64x4096" in names
    # The W&B group is the setting, the same for every backend: they line up side by side.
    assert naming.run_group(identity(FLAGSHIP, "--moe_comm.backend", "nvshmem")) == naming.run_group(nccl)
    assert naming.run_group(identity(FLAGSHIP, "--cluster.nodes", "64")) != naming.run_group(nccl)


def test_submit_derives_job_name_and_dump_folder_per_backend(capsys):
    folders = set()
    for backend in ("nccl", "nvshmem"):
        assert cli_main(["submit", FLAGSHIP, "--dry-run", "--moe_comm.backend", backend]) == 0
        script = capsys.readouterr().out
        name = f"deepseek_v3_671b_b200-{'nccl' if backend == 'nccl' else 'nvshmem-sm20'}-chunked-32x8-ep32-pp8-b64x4096"
        assert f"#SBATCH --job-name={name}\n" in script
        dump = next(line for line in script.splitlines() if line.startswith("DUMP_DIR="))
        assert dump.endswith(f"/outputs/deepseek_v3_671b_b200/{name}")
        folders.add(dump)
    assert len(folders) == 2


def test_a_folder_refuses_another_run(tmp_path):
    mine = identity(FLAGSHIP, "--moe_comm.backend", "nccl")
    naming.claim_dump_folder(str(tmp_path), mine)
    naming.claim_dump_folder(str(tmp_path), mine)  # the same run again (requeue, resubmit): fine
    with pytest.raises(RecipeError) as e:
        naming.claim_dump_folder(str(tmp_path), identity(FLAGSHIP, "--moe_comm.backend", "nvshmem"))
    assert str(tmp_path) in str(e.value) and "backend 'nccl' -> 'nvshmem'" in str(e.value)
    assert json.loads((tmp_path / naming.IDENTITY_FILE).read_text()) == mine


def test_train_refuses_a_folder_of_another_run_before_starting(tmp_path, capsys):
    naming.claim_dump_folder(str(tmp_path), identity("recipes/debug_cpu.toml"))
    rc = cli_main(["train", "recipes/debug_cpu.toml", "--dry-run", "--job.dump_folder", str(tmp_path),
                   "--training.local_batch_size", "4"])
    captured = capsys.readouterr()
    assert rc == 2 and "local_batch_size 2 -> 4" in captured.err and "+ " not in captured.out
    assert cli_main(["train", "recipes/debug_cpu.toml", "--dry-run", "--job.dump_folder", str(tmp_path)]) == 0


@pytest.fixture
def clean_wandb_env(monkeypatch, tmp_path):
    """No W&B or Slurm variables and an empty HOME; everything set_wandb_env_defaults writes into
    os.environ is undone afterwards (it would reach later tests' runs and jobs)."""
    saved = dict(os.environ)
    for var in list(os.environ):
        if var.startswith(("WANDB_", "SLURM_")) or var == "NETRC":
            monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path))
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def test_wandb_login_users_are_online(clean_wandb_env, tmp_path):
    config = recipe.load("recipes/debug_cpu.toml", check_paths=False).config
    naming.set_wandb_env_defaults(config, 1, 2)
    assert os.environ["WANDB_MODE"] == "offline"  # no credentials anywhere
    clean_wandb_env.delenv("WANDB_MODE")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    naming.set_wandb_env_defaults(config, 1, 2)  # what `wandb login` leaves behind
    assert "WANDB_MODE" not in os.environ
    assert os.environ["WANDB_RUN_NAME"] == "debug_cpu-nccl-1x2-ep2-b2x128-fp32"
    assert os.environ["WANDB_RUN_GROUP"] == "debug_cpu-1x2-ep2-b2x128-fp32"


def test_a_requeued_job_continues_its_wandb_run(clean_wandb_env):
    config = recipe.load("recipes/debug_cpu.toml", check_paths=False).config
    assert naming.wandb_run_id("x") is None  # outside Slurm W&B picks the id
    clean_wandb_env.setenv("SLURM_JOB_ID", "4242")
    clean_wandb_env.setenv("SLURM_CLUSTER_NAME", "soperator")
    naming.set_wandb_env_defaults(config, 1, 2)
    first = os.environ["WANDB_RUN_ID"]
    assert first.startswith("soperator-4242-") and os.environ["WANDB_RESUME"] == "allow"
    assert naming.wandb_run_id(naming.run_name(naming.run_identity(config, 1, 2))) == first  # the restart
    clean_wandb_env.setenv("SLURM_JOB_ID", "4243")
    assert naming.wandb_run_id(naming.run_name(naming.run_identity(config, 1, 2))) != first  # another job
