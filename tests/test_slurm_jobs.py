"""The job template on a real Slurm (tests/slurm_cluster.py): runs, rendezvous, requeue and
resubmit, each run's identity, resource checks.

One local cluster serves the whole module. Its daemons are stopped by pid at the end, pass or
fail. The CPU jobs run recipes/debug_cpu.toml (EP=2 over gloo) for 3 steps; two of them (one
node, requeued; two nodes) are shared by the tests that look at them. The cluster, those two jobs,
the finished one's resubmission and the held flagship job are made in the session's background
(`in_background`, tests/conftest.py): they wait on Slurm and on start-ups more than they compute.
"""

import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_comm.cluster.sbatch import REPO
from in_process import run_verb
from outcomes import kept, result
from slurm_cluster import GPU_PARTITION, LIVE_PARTITION, LocalSlurm

pytestmark = pytest.mark.slurm

DEBUG_CPU = REPO / "recipes" / "debug_cpu.toml"
RECIPES_B200 = {
    "16B": REPO / "recipes" / "deepseek_v3_16b_b200.toml",
    "671B": REPO / "recipes" / "deepseek_v3_671b_b200.toml",
}
STEPS = 3
# A job in one of these states has ended ("GONE": past MinJobAge, Slurm no longer knows it).
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "GONE")


def in_background(shared_run, folder: Path, nice: int) -> SimpleNamespace:
    """The cluster started, the two CPU jobs submitted together (one waits for its requeue while
    the other trains) and driven to their end, then the finished one submitted again and the
    671B job submitted held. Each outcome is kept, failure included, for the test that reads it;
    the cluster stays up for the module (its `close` stops it).

    The one-node job is watched for its requeue from the moment it is submitted, while the
    two-node job is being submitted: a `submit` takes seconds of imports, and a job that finished
    its few steps meanwhile would be requeued after its end."""
    cluster = LocalSlurm(nice=nice)
    try:
        cluster.start()
        base = folder / "dumps"
        base.mkdir(parents=True)
        proc, *one_node = submit_cpu(cluster, base, "--checkpoint.interval", "1")
        assert proc.returncode == 0, proc.stderr
        with ThreadPoolExecutor(max_workers=1) as watch:
            requeued = watch.submit(kept, _requeued_once, cluster, *one_node)
            proc, *two_nodes = submit_cpu(cluster, base, "--nodes", "2", "--cluster.gpus_per_node", "1")
            assert proc.returncode == 0, proc.stderr
            one_node_outcome = requeued.result()
    except BaseException:
        cluster.stop()
        raise
    done = SimpleNamespace(slurm=cluster, base=base, close=cluster.stop)
    done.one_node = one_node_outcome
    done.two_nodes = kept(finished, cluster, *two_nodes)
    done.again = kept(lambda: cpu_job(cluster, base, "--checkpoint.interval", "1"))
    done.held_flagship = kept(_held_flagship, cluster)
    return done


def _requeued_once(slurm: LocalSlurm, job_id: str, log: Path, dump: Path) -> tuple[str, Path, Path]:
    """Requeued after its first checkpoint: the job runs again under the same id and TorchTitan
    resumes from that checkpoint."""
    first = dump / "checkpoint" / "step-1" / ".metadata"
    wait_for("the step-1 checkpoint", first.exists, 300, slurm, log, running_job=job_id)
    slurm.run("scontrol", "requeue", job_id)
    return finished(slurm, job_id, log, dump)


@pytest.fixture(scope="module")
def slurm(background):
    try:
        yield background.slurm
    finally:
        background.slurm.stop()


def submit(slurm: LocalSlurm, recipe: Path, *rest: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_comm", "submit", str(recipe), *rest],
        cwd=REPO, env=slurm.env, capture_output=True, text=True, timeout=timeout,
    )


def render(recipe: Path, *rest: str) -> subprocess.CompletedProcess:
    """`submit --dry-run` in this process (a fresh one costs seconds of imports): the job script."""
    return run_verb("submit", str(recipe), "--dry-run", *rest)


CPU_FLAGS = ("--cluster.partition", LIVE_PARTITION, "--cluster.request_gpus", "false",
             "--cluster.env_file", "slurm/env/cpu-local.sh", "--cluster.time", "00:15:00")


def submit_cpu(slurm: LocalSlurm, base: Path, *rest: str) -> tuple[subprocess.CompletedProcess, str, Path, Path]:
    """Submit the CPU recipe into `base`; return (the submit process, job id, its log, its dump folder)."""
    proc = submit(slurm, DEBUG_CPU, *CPU_FLAGS, "--job.dump_folder", str(base), "--training.steps", str(STEPS), *rest)
    m = re.search(r"submitted job (\d+): log (\S+), dump folder (\S+)", proc.stdout)
    assert m, f"submit printed no job id:\n{proc.stdout}\n{proc.stderr}"
    return proc, m.group(1), Path(m.group(2)), Path(m.group(3))


def cpu_job(slurm: LocalSlurm, base: Path, *rest: str) -> tuple[str, Path, Path]:
    """Submit the CPU recipe and wait for it; return (job id, its log, its dump folder)."""
    proc, job_id, log, dump = submit_cpu(slurm, base, "--wait", *rest)
    text = log.read_text() if log.exists() else "(no log)"
    assert proc.returncode == 0, f"job {job_id} failed ({proc.returncode}); log {log}:\n{text[-6000:]}\n{proc.stderr}; {slurm.logs_hint()}"
    return job_id, log, dump


def wait_for(what: str, ok, timeout: float, slurm: LocalSlurm, log: Path, running_job: str = "") -> None:
    """Poll ok() (4 times a second: the requeue must come before the job ends) until it holds;
    give up early if running_job has already ended (asked of Slurm every 2 s)."""
    deadline = time.monotonic() + timeout
    ended = ""
    polls = 0
    while time.monotonic() < deadline:
        if ok():
            return
        state = slurm.job_state(running_job) if running_job and polls % 8 == 7 else ""
        if state in ENDED:
            ended = f"job {running_job} ended ({state}) first"
            break
        polls += 1
        time.sleep(0.25)
    text = log.read_text()[-4000:] if log.exists() else "(no log)"
    why = ended or f"timed out after {timeout}s"
    raise AssertionError(f"{why} waiting for {what}; log {log}:\n{text}\n{slurm.logs_hint()}")


def assert_trained(log: Path, dump: Path, job_id: str) -> list[dict]:
    """The job trained STEPS steps, wrote its metrics, and saved its provenance beside them."""
    text = log.read_text()
    steps = sorted({int(s) for s in re.findall(r"- INFO - step +(\d+)/", text)})
    assert steps and steps[-1] == STEPS, f"log shows steps {steps}, expected up to {STEPS}:\n{text[-4000:]}"
    metrics = dump / "metrics.jsonl"
    assert metrics.exists(), f"no metrics in {dump}: {sorted(p.name for p in dump.iterdir())}"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    assert rows, "metrics.jsonl is empty"
    run = sorted((dump / "jobs").glob(f"{job_id}.*"))[-1]
    commit = (run / "git.txt").read_text().split()[0]
    # HEAD itself, or an ancestor if someone committed while the job ran.
    ancestor = subprocess.run(["git", "-C", str(REPO), "merge-base", "--is-ancestor", commit, "HEAD"])
    assert re.fullmatch(r"[0-9a-f]{40}", commit) and ancestor.returncode == 0, f"git.txt names {commit!r}"
    assert (run / "recipe.toml").read_text() == DEBUG_CPU.read_text()
    assert f"SLURM_JOB_ID={job_id}" in (run / "env.txt").read_text()
    assert re.search(r"^torch ?(==| @ )", (run / "packages.txt").read_text(), flags=re.M), "pip freeze of the job's venv"
    assert (run / "job.sbatch").read_text().startswith("#!/bin/bash\n#SBATCH --job-name=")
    command = (run / "command.txt").read_text()
    assert f"--rdzv-id {job_id}" in command and "--checkpoint.enable" in command
    return rows


def wandb_run_ids(dump: Path) -> list[str]:
    """The ids of the offline W&B runs in a dump folder, one per start of the job."""
    return sorted(p.name.split("-", 3)[-1] for p in dump.rglob("offline-run-*") if p.is_dir())  # offline-run-DATE-ID


@pytest.fixture(scope="module")
def base(background) -> Path:
    """One dump folder for the module's jobs: each run must find its own folder inside it."""
    return background.base


def finished(slurm: LocalSlurm, job_id: str, log: Path, dump: Path) -> tuple[str, Path, Path]:
    """Wait for the job to end; it must have completed. Returns (job id, its log, its dump folder)."""
    wait_for(f"job {job_id} to finish", lambda: slurm.job_state(job_id) in ENDED, 300, slurm, log)
    state = slurm.job_state(job_id)
    text = log.read_text()[-6000:] if log.exists() else "(no log)"
    assert state in ("COMPLETED", "GONE"), f"job {job_id} ended {state}; log {log}:\n{text}\n{slurm.logs_hint()}"
    return job_id, log, dump


@pytest.fixture(scope="module")
def one_node_run(background):
    """EP=2 on gloo through the real template, requeued after its first checkpoint."""
    return result(background.one_node)


@pytest.fixture(scope="module")
def two_node_run(background):
    """Two fake nodes, one process each: the c10d rendezvous across srun tasks really runs."""
    return result(background.two_nodes)


def test_cpu_recipe_one_node_requeued_resumes_from_checkpoint(one_node_run):
    job_id, log, dump = one_node_run
    text = log.read_text()
    assert "restart 0" in text and "restart 1" in text, "the requeued run must append to the same log"
    assert re.search(r"Loading the checkpoint from \S+/checkpoint/step-\d", text), text[-4000:]
    assert (dump / "jobs" / f"{job_id}.0").is_dir() and (dump / "jobs" / f"{job_id}.1").is_dir()
    assert_trained(log, dump, job_id)
    assert "on 1 node(s) x 2 process(es)" in text


def test_a_requeued_job_continues_its_wandb_run(one_node_run):
    """Each start of the job logs to W&B (offline here) under the id of the Slurm job; a restart
    that superseded steps the first start had logged (moe_comm.metrics.history) under its own."""
    job_id, log, dump = one_node_run
    first, again = sorted(wandb_run_ids(dump), key=len)
    assert first.startswith(f"moecomm-{job_id}-") and again in (first, first + "-r1"), (first, again)
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # one row per step


def test_a_finished_run_submitted_again_has_nothing_to_do(background, one_node_run):
    """The second submit of a finished job finds its own folder and its last checkpoint (a full
    one: TorchTitan's default model-only last save made it die loading it), says there is
    nothing to do and ends without starting torchrun (it used to print "Training starts at
    step 4" for a 3-step run and exit). tests/test_train_lifecycle.py resumes such a save."""
    _, _, dump = one_node_run
    job_id, log, again = result(background.again)
    assert again == dump, "the same run must find its own folder again"
    text = log.read_text()
    assert f"moe_comm: nothing to do: {dump}/checkpoint/step-{STEPS} is at [training] steps = {STEPS}" in text, text[-4000:]
    assert "torch.distributed.run" not in text.split(f"job {job_id}", 1)[-1]
    log.unlink()


def test_cpu_recipe_two_nodes_rendezvous(two_node_run):
    job_id, log, dump = two_node_run
    text = log.read_text()
    assert "on 2 node(s) x 1 process(es); rendezvous 127.0.0.1:" in text
    labels = {int(m) for m in re.findall(r"^(\d+): ", text, flags=re.M)}
    assert labels == {0, 1}, f"expected output from srun tasks 0 and 1, got {labels}"
    assert_trained(log, dump, job_id)


def test_runs_of_one_recipe_have_their_own_identity(base, one_node_run, two_node_run):
    """Two runs of debug_cpu.toml into one base folder (1 node x 2 and 2 nodes x 1): their own job
    names, dump folders, metrics and W&B runs; nothing mixed."""
    (_, log1, dump1), (_, log2, dump2) = one_node_run, two_node_run
    assert dump1.parent == dump2.parent == base and dump1 != dump2
    assert dump1.name == "debug_cpu-nccl-1x2-ep2-b2x128-fp32" and dump2.name == "debug_cpu-nccl-2x1-ep2-b2x128-fp32"
    assert log1.name.startswith(dump1.name + "-") and log2.name.startswith(dump2.name + "-")
    for dump, nodes in ((dump1, 1), (dump2, 2)):
        assert json.loads((dump / "identity.json").read_text())["nodes"] == nodes
        rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
        assert {r["step"] for r in rows} == set(range(1, STEPS + 1))  # only this run's steps
    assert not set(wandb_run_ids(dump1)) & set(wandb_run_ids(dump2))


def _held_flagship(slurm: LocalSlurm) -> tuple[str, str]:
    """Submit the 671B job held; (its job id, what Slurm made of its directives)."""
    # A real submit checks the recipe's files; the DeepSeek-V3 tokenizer and the c4 shards on
    # /data are not in CI, the tiny ones stand in (the held job never runs).
    proc = submit(slurm, RECIPES_B200["671B"], "--cluster.partition", GPU_PARTITION,
                  "--cluster.time", "02:00:00", "--cluster.sbatch_args", "--hold",
                  "--model.hf_assets_path", "./assets/tiny", "--training.dataset", "c4_test",
                  "--training.dataset_path", "./assets/tiny/c4_tiny")
    assert proc.returncode == 0, proc.stderr
    job_id = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    try:
        return job_id, slurm.run("scontrol", "show", "job", job_id).stdout
    finally:
        slurm.run("scancel", job_id, check=False)


def test_directives_are_honoured_by_slurm(background):
    """The 671B job submitted held (`in_background`): what Slurm made of its directives."""
    job_id, info = result(background.held_flagship)
    name = "deepseek_v3_671b_b200-nvshmem-sm20-chunked-32x8-ep32-pp8-b64x4096"  # the run's identity (moe_comm.metrics.naming)
    for expected in (f"JobName={name}\n", "NumNodes=32", "NumTasks=32", "NtasksPerN:B:S:C=1:",
                     "TresPerNode=gres:gpu:8", "OverSubscribe=NO", "Requeue=1", f"Partition={GPU_PARTITION}",
                     "TimeLimit=02:00:00", f"StdOut={REPO}/slurm/logs/{name}-{job_id}.out"):
        assert expected in info, f"{expected} not in:\n{info}"


@pytest.mark.parametrize("flavor", sorted(RECIPES_B200))
def test_b200_job_fits_fake_8_gpu_nodes(slurm, flavor):
    recipe = RECIPES_B200[flavor]
    assert recipe.exists(), f"{recipe} is missing: the B200 recipes come with the recipe issue"
    proc = render(recipe, "--cluster.partition", GPU_PARTITION)
    assert proc.returncode == 0, proc.stderr
    script = Path(slurm.root) / f"{flavor}.sbatch"
    script.write_text(proc.stdout)
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", proc.stdout, flags=re.M).group(1))
    test = slurm.run("sbatch", "--test-only", str(script), check=False)
    assert test.returncode == 0, test.stderr
    m = re.search(r"on nodes (mcgpu\S*) in partition", test.stderr)
    assert m, test.stderr
    hosts = slurm.run("scontrol", "show", "hostnames", m.group(1)).stdout.split()
    assert len(hosts) == nodes, f"Slurm planned {hosts} for a {nodes}-node job"


def test_too_many_gpus_per_node_is_refused_by_slurm(slurm, tmp_path):
    """The fake gres is real to Slurm: the 16B job asking 9 GPUs per node does not fit."""
    proc = render(RECIPES_B200["16B"], "--cluster.partition", GPU_PARTITION)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --gpus-per-node=8\n" in proc.stdout
    script = tmp_path / "nine.sbatch"
    script.write_text(proc.stdout.replace("#SBATCH --gpus-per-node=8\n", "#SBATCH --gpus-per-node=9\n"))
    test = slurm.run("sbatch", "--test-only", str(script), check=False)
    assert test.returncode != 0 and "Requested node configuration is not available" in test.stderr, test.stderr
