"""The rendered job script and the submit checks, without a Slurm cluster (fast)."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from in_process import run_verb

from moe_comm import recipe
from moe_comm.cluster import submit
from moe_comm.cluster.sbatch import REPO

DEBUG_CPU = REPO / "recipes" / "debug_cpu.toml"
B200_671B = REPO / "recipes" / "deepseek_v3_671b_b200.toml"
CPU_FLAGS = ["--cluster.request_gpus", "false", "--cluster.env_file", "slurm/env/cpu-local.sh"]


def _submit(recipe: Path, *rest: str) -> tuple[int, str, str]:
    """`python -m moe_comm submit RECIPE --dry-run REST...`, in this process (TorchTitan is
    imported once for the whole module instead of once per call)."""
    proc = run_verb("submit", str(recipe), "--dry-run", *rest)
    return proc.returncode, proc.stdout, proc.stderr


def dry_run(recipe: Path, *rest: str) -> str:
    rc, out, err = _submit(recipe, *rest)
    assert rc == 0, err
    return out


def submit_error(recipe: Path, *rest: str) -> str:
    rc, out, err = _submit(recipe, *rest)
    assert rc == 2, (rc, out[-500:], err)
    assert out == "", "nothing may be printed as a script when the recipe is refused"
    return err


def header_and_body(script: str) -> tuple[list[str], list[str]]:
    """Split at the first command, exactly where Slurm stops reading #SBATCH lines."""
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for i, line in enumerate(lines[1:], start=1):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            return lines[:i], lines[i:]
    raise AssertionError("script has no command")


def sbatch_directives(script: str) -> dict[str, str]:
    header, body = header_and_body(script)
    assert not [line for line in body if line.lstrip().startswith("#SBATCH")], "an #SBATCH line after the first command is ignored by Slurm"
    out = {}
    for line in header:
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH "):].partition("=")
            out[key] = value
    return out


def test_cpu_script_directives_first_and_one_task_per_node():
    script = dry_run(DEBUG_CPU, *CPU_FLAGS, "--training.steps", "3")
    d = sbatch_directives(script)
    header, body = header_and_body(script)
    assert body[0] == "set -euo pipefail", "the first command must come after every directive"
    assert d["--nodes"] == "1" and d["--ntasks-per-node"] == "1"
    assert "--gpus-per-node" not in d, "a CPU recipe must not ask Slurm for GPUs"
    name = "debug_cpu-nccl-1x2-ep2-b2x128-fp32"  # the run's identity: recipe, backend, nodes, batch
    assert d["--job-name"] == name
    assert d["--output"] == f"{REPO}/slurm/logs/{name}-%j.out"
    assert "--requeue" in d and d["--open-mode"] == "append"
    srun = " ".join(body).replace("\\ ", "").split("srun ", 1)[1]
    assert "--ntasks-per-node=1" in srun and "--mpi=none" in srun
    assert (f"TRAIN_ARGS=(--job.dump_folder {REPO}/outputs/debug_cpu/{name} --checkpoint.enable "
            "--cluster.no-request_gpus --cluster.env_file slurm/env/cpu-local.sh --training.steps 3)") in script
    assert "PROCS_PER_NODE=2" in script
    assert "--rdzv-id \"$SLURM_JOB_ID\"" in script and "getent ahostsv4" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_gpu_script_asks_for_gpus_and_sources_the_platform_env():
    script = dry_run(DEBUG_CPU, "--nodes", "4", "--cluster.gpus_per_node", "8", "--cluster.request_gpus", "true",
                     "--cluster.env_file", "slurm/env/nebius-b200.sh", "--cluster.partition", "b200",
                     "--cluster.account", "team", "--cluster.sbatch_args", "--qos=high")
    d = sbatch_directives(script)
    assert d["--nodes"] == "4" and d["--gpus-per-node"] == "8" and d["--partition"] == "b200"
    assert d["--account"] == "team" and d["--qos"] == "high"
    assert f"ENV_FILE={REPO}/slurm/env/nebius-b200.sh" in script
    assert "PROCS_PER_NODE=8" in script


def test_container_image_goes_on_srun_not_sbatch():
    """pyxis runs an `#SBATCH --container-image` batch script inside the container, without srun."""
    script = dry_run(DEBUG_CPU, "--cluster.container_image", "nvcr.io#nvidia/pytorch:25.10-py3")
    d = sbatch_directives(script)
    assert not any(k.startswith("--container") for k in d)
    line = next(line for line in script.splitlines() if line.startswith("SRUN_CONTAINER_ARGS="))
    words = subprocess.run(["bash", "-c", f'{line}; printf "%s\\n" "${{SRUN_CONTAINER_ARGS[@]}}"'],
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert words == ["--container-image=nvcr.io#nvidia/pytorch:25.10-py3", f"--container-mounts={REPO}:{REPO}", f"--container-workdir={REPO}"]
    assert "VENV=''" in script


def test_dump_folder_is_per_job_name_and_movable():
    script = dry_run(DEBUG_CPU, *CPU_FLAGS, "--cluster.job_name", "exp7", "--job.dump_folder", "/scratch/runs")
    assert "DUMP_DIR=/scratch/runs/exp7" in script
    assert "TRAIN_ARGS=(--job.dump_folder /scratch/runs/exp7 --checkpoint.enable --cluster.no-request_gpus " in script
    assert sbatch_directives(script)["--job-name"] == "exp7"


def test_no_requeue_means_no_forced_checkpoint():
    script = dry_run(DEBUG_CPU, *CPU_FLAGS, "--cluster.requeue", "false")
    assert "--requeue" not in sbatch_directives(script)
    assert "--checkpoint.enable" not in script


def test_world_size_mismatch_is_refused_naming_the_fix():
    err = submit_error(DEBUG_CPU, "--nodes", "3", "--cluster.gpus_per_node", "1")
    assert "expert_parallel_degree = 2" in err and "nodes" in err

    err = submit_error(DEBUG_CPU, "--nodes", "2", "--cluster.gpus_per_node", "8",
                       "--parallelism.data_parallel_shard_degree", "8", "--parallelism.tensor_parallel_degree", "4",
                       "--parallelism.expert_parallel_degree", "1")
    assert "nodes = 2 x gpus_per_node = 8 = 16 processes" in err
    assert "multiplies to 32" in err and "[cluster] nodes = 4" in err and "--nodes 4" in err


def test_world_size_with_dp_shard_rest(tmp_path):
    path = tmp_path / "tp8.toml"
    path.write_text((REPO / "recipes" / "deepseek_v3_16b_b200.toml").read_text())
    tp8 = ["--parallelism.tensor_parallel_degree", "8", "--parallelism.expert_parallel_degree", "1"]
    r = recipe.load(str(path), tp8 + ["--cluster.nodes", "4"], check_paths=False)
    assert (r.layout.world, r.layout.dp_shard) == (32, 4)
    err = submit_error(path, *tp8, "--nodes", "1", "--cluster.gpus_per_node", "4")
    assert "multiple of 8" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--cluster.nodez", "2"], "override --cluster.nodez: [cluster] has no field 'nodez'; did you mean --cluster.nodes?"),
        (["--cluster.nodes", "two"], "override --cluster.nodes two: expected an integer"),
        (["--cluster.requeue", "maybe"], "override --cluster.requeue maybe: expected true or false"),
        (["--cluster.gpu", "A100"], "[cluster] gpu = 'A100' is not a GPU model"),
        (["--cluster.time", "4h"], "[cluster] time = '4h'"),
        (["--cluster.env_file", "slurm/env/mars.sh"], "[cluster] env_file = 'slurm/env/mars.sh' does not exist"),
        (["--cluster.venv", "/v", "--cluster.container_image", "img"], "both venv and container_image"),
        (["--cluster.sbatch_args", "qos high"], "sbatch_args item 'qos high'"),
        (["--cluster.job_name", "my run"], "[cluster] job_name = 'my run'"),
    ],
)
def test_bad_cluster_values_are_refused(flags, message):
    assert message in submit_error(DEBUG_CPU, *flags)


def test_missing_recipe_is_a_clear_error(tmp_path):
    assert "does not exist" in submit_error(tmp_path / "nope.toml")


def test_bad_torchtitan_override_is_refused_before_submitting():
    assert "--training.stepz" in submit_error(DEBUG_CPU, *CPU_FLAGS, "--training.stepz", "3")


def test_cli_in_a_fresh_process():
    proc = subprocess.run(
        [sys.executable, "-m", "moe_comm", "submit", str(DEBUG_CPU), "--dry-run", *CPU_FLAGS],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#!/bin/bash\n#SBATCH --job-name=debug_cpu-nccl-1x2-ep2-b2x128-fp32\n")


def test_submit_options_after_the_recipe_are_not_overrides():
    parser = argparse.ArgumentParser()
    submit.add_arguments(parser)
    args = parser.parse_args([str(DEBUG_CPU), "--training.steps", "3", "--nodes", "1", "--dry-run", "--cluster.partition=x"])
    spec = submit.build_spec(args)
    assert args.dry_run and spec.cluster.nodes == 1 and spec.cluster.partition == "x"
    assert spec.overrides == ["--training.steps", "3", "--cluster.partition", "x", "--cluster.nodes", "1"]


def test_cpu_recipe_is_the_one_the_slurm_tests_use():
    r = recipe.load(str(DEBUG_CPU), check_paths=False)
    assert r.layout.ep == 2 and r.layout.world == 2 and r.device == "cpu"


def test_671b_dry_run_is_a_soperator_job():
    """Done-when of issue 4: a script a Soperator user could sbatch unchanged."""
    assert B200_671B.exists(), f"{B200_671B} is missing: the 671B B200 recipe is part of the recipe issue"
    script = dry_run(B200_671B)
    d = sbatch_directives(script)
    assert d["--nodes"] == "32" and d["--gpus-per-node"] == "8" and d["--ntasks-per-node"] == "1"
    assert "--exclusive" in d and "--requeue" in d
    assert "PROCS_PER_NODE=8" in script
    assert f"ENV_FILE={REPO}/slurm/env/nebius-b200.sh" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def _source_env(env_file: str, backend: str, sysfs: Path | None = None) -> dict[str, str]:
    env = {"PATH": os.environ["PATH"], "MOE_COMM_BACKEND": backend}
    if sysfs is not None:
        env["MOE_COMM_IB_SYSFS"] = str(sysfs)
    out = subprocess.run(
        ["bash", "-c", f"set -euo pipefail; source {REPO / env_file}; env -0"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout
    return dict(item.split("=", 1) for item in out.split("\0") if "=" in item)


def _fake_hcas(root: Path) -> Path:
    """mlx5_0..3 InfiniBand, mlx5_4 Ethernet (RoCE front-end), mlx5_12 the virtual NIC."""
    for name, layer in [("mlx5_0", "InfiniBand"), ("mlx5_1", "InfiniBand"), ("mlx5_10", "InfiniBand"),
                        ("mlx5_4", "Ethernet"), ("mlx5_12", "InfiniBand")]:
        port = root / name / "ports" / "1"
        port.mkdir(parents=True)
        (port / "link_layer").write_text(layer + "\n")
    return root


def test_b200_env_picks_infiniband_hcas_and_ibgda_only_for_nvshmem_backends(tmp_path):
    sysfs = _fake_hcas(tmp_path / "ib")
    nccl = _source_env("slurm/env/nebius-b200.sh", "nccl", sysfs)
    assert nccl["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1,mlx5_10"
    assert nccl["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1,mlx5_10:1"
    assert nccl["NCCL_SOCKET_IFNAME"] == "eth0"
    assert "NVSHMEM_IB_ENABLE_IBGDA" not in nccl
    for backend in ("nvshmem", "deepep"):
        env = _source_env("slurm/env/nebius-b200.sh", backend, sysfs)
        assert env["NVSHMEM_IB_ENABLE_IBGDA"] == "1" and env["NVSHMEM_REMOTE_TRANSPORT"] == "ibrc"
        assert env["NVSHMEM_IBGDA_NIC_HANDLER"] == "gpu"
        assert env["NVSHMEM_HCA_LIST"] == "mlx5_0:1,mlx5_1:1,mlx5_10:1", "mlx5_12 (virtual) must be excluded"


@pytest.mark.parametrize("env_file", ["slurm/env/nebius-h200.sh", "slurm/env/nebius-b200.sh"])
def test_platform_env_leaves_nvlink_multicast_to_the_user(tmp_path, env_file):
    """Multicast off is the lent test machines' rule (experiments/device_env.py), not a cluster's."""
    for backend in ("nccl", "nvshmem"):
        env = _source_env(env_file, backend, tmp_path)
        assert not {"NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"} & set(env)
    out = subprocess.run(
        ["bash", "-c", f"export NCCL_NVLS_ENABLE=1; source {REPO / env_file}; echo $NCCL_NVLS_ENABLE"],
        env={"PATH": os.environ["PATH"], "MOE_COMM_IB_SYSFS": str(tmp_path)}, capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() == "1"


def test_nvshmem_hca_list_without_detected_hcas_excludes_the_virtual_nic(tmp_path):
    env = _source_env("slurm/env/nebius-b200.sh", "nvshmem", tmp_path)  # no HCA under this sysfs
    assert env["NVSHMEM_HCA_LIST"] == "^mlx5_12" and env["NVSHMEM_REMOTE_TRANSPORT"] == "ibrc"
    assert "NVSHMEM_HCA_LIST" not in _source_env("slurm/env/nebius-b200.sh", "nccl", tmp_path)


def test_launcher_leaves_nvlink_multicast_alone(monkeypatch, tmp_path):
    """`moe_comm train` on a GPU machine passes the user's environment through (was: NVLS forced off)."""
    from moe_comm import launch

    load = recipe.load
    monkeypatch.setattr(launch.recipe, "load", lambda *a, **k: load(*a, **{**k, "device": "cuda"}))
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    seen = {}
    monkeypatch.setattr(launch, "run_torchrun", lambda cmd, env, *rest, **kw: seen.update(env) or 0)
    args = argparse.Namespace(recipe=str(DEBUG_CPU), overrides=["--job.dump_folder", str(tmp_path)], nproc_per_node=None,
                              nnodes=None, rdzv_endpoint=None, rdzv_id=None, log_rank="0", dry_run=False)
    assert launch.main(args) == 0
    assert seen["NCCL_NVLS_ENABLE"] == "1"
    assert "NVSHMEM_DISABLE_NVLS" not in seen and "TORCH_SYMM_MEM_DISABLE_MULTICAST" not in seen


def test_a_user_export_wins_over_detection(tmp_path):
    sysfs = _fake_hcas(tmp_path / "ib")
    env = subprocess.run(
        ["bash", "-c", f"set -euo pipefail; export NCCL_IB_HCA=mlx5; source {REPO}/slurm/env/nebius-b200.sh; echo $NCCL_IB_HCA"],
        env={"PATH": os.environ["PATH"], "MOE_COMM_IB_SYSFS": str(sysfs)}, capture_output=True, text=True, check=True,
    )
    assert env.stdout.strip() == "mlx5"


def test_requeue_without_interval_checkpoints_warns():
    rc, out, err = _submit(DEBUG_CPU, *CPU_FLAGS, "--training.steps", "3")
    assert rc == 0 and "[checkpoint] interval = 500 >= [training] steps = 3" in err
    rc, out, err = _submit(DEBUG_CPU, *CPU_FLAGS, "--training.steps", "3", "--checkpoint.interval", "1")
    assert rc == 0 and "warning" not in err


def test_backend_override_reaches_the_env_file():
    """--moe_comm.backend deepep must switch the job's NVSHMEM/IBGDA environment on."""
    written = recipe.load(str(B200_671B), check_paths=False).config.moe_comm.backend
    assert f"export MOE_COMM_BACKEND={written}\n" in dry_run(B200_671B)
    assert "export MOE_COMM_BACKEND=deepep\n" in dry_run(B200_671B, "--moe_comm.backend", "deepep",
                                                      "--cluster.container_image", "img")
    assert "export MOE_COMM_BACKEND=nvshmem\n" in dry_run(B200_671B, "--moe_comm.backend=nvshmem")


def test_flagship_with_nvshmem_renders_its_job():
    """The headline: DeepSeek-V3 671B with EP 32 across 4 nodes on the project's own kernels."""
    script = dry_run(REPO / "recipes" / "deepseek_v3_671b_b200.toml", "--moe_comm.backend", "nvshmem")
    assert "#SBATCH --nodes=32" in script and "#SBATCH --gpus-per-node=8" in script
    assert "--moe_comm.backend nvshmem" in script and "slurm/env/nebius-b200.sh" in script
