"""One run per dump folder (moe_comm.claim): a second run is refused naming the holder, a stale
claim is taken over saying so, the nodes of one Slurm job share one claim and a requeued job
takes over from its earlier start. The real two-runs-at-once case runs in
tests/test_train_lifecycle.py (a second `train` while the first trains)."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from moe_comm import claim
from moe_comm.errors import RecipeError

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT")


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch):
    for var in SLURM_VARS:
        monkeypatch.delenv(var, raising=False)


def _slurm(monkeypatch, job: str, step: str = "0", restart: str = "0") -> None:
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setenv("SLURM_STEP_ID", step)
    monkeypatch.setenv("SLURM_RESTART_COUNT", restart)


def _foreign(folder, host: str, age_s: float, **fields) -> claim.Holder:
    """A claim made by another launcher, last refreshed `age_s` ago."""
    holder = claim.Holder(**{**vars(claim.me("train other")), "host": host, "pid": 4242, "pid_started": "99", **fields})
    path = folder / claim.CLAIM_FILE
    written = folder / "claim.json.other"  # written whole, then put in place: as a launcher's link,
    written.write_text(json.dumps(vars(holder)))  # a reader (a refresher thread) never sees it half done
    os.replace(written, path)
    old = time.time() - age_s
    os.utime(path, (old, old))
    return holder


def test_a_second_run_is_refused_naming_the_holder_and_the_way_out(tmp_path):
    first = claim.Claim(str(tmp_path), claim.me("train first"))
    assert first.take() == [] and first.owner
    with pytest.raises(RecipeError) as e:
        claim.Claim(str(tmp_path), claim.me("train second")).take()
    message = str(e.value)
    assert f"[job] dump_folder = {str(tmp_path)!r} is in use by a run (pid {os.getpid()} on {socket.gethostname()}" in message
    assert "--job.dump_folder DIR" in message and f"`kill {os.getpid()}`" in message
    first.release()
    assert not (tmp_path / claim.CLAIM_FILE).exists()
    again = claim.Claim(str(tmp_path), claim.me("train third"))
    assert again.take() == []
    again.release()


def test_a_claim_whose_process_is_gone_is_taken_over_saying_so(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _foreign(tmp_path, socket.gethostname(), 0, pid=dead.pid, pid_started="1")
    (message,) = claim.Claim(str(tmp_path), claim.me("train")).take()
    assert message.startswith(f"took over the claim on {tmp_path} from a run (pid {dead.pid} on {socket.gethostname()}")
    assert f"its process {dead.pid} on {socket.gethostname()} is gone" in message


def test_a_reused_pid_does_not_hold_the_claim(tmp_path):
    _foreign(tmp_path, socket.gethostname(), 0, pid=os.getpid(), pid_started="1")  # this pid, another start time
    (message,) = claim.Claim(str(tmp_path), claim.me("train")).take()
    assert "is gone" in message


def test_another_hosts_claim_holds_until_it_goes_unrefreshed(tmp_path):
    _foreign(tmp_path, "node-7", claim.STALE_S / 2, slurm_job="41", job="slurm 41 step 0 restart 0")
    with pytest.raises(RecipeError, match=r"in use by Slurm job 41 \(pid 4242 on node-7.*`scancel 41`"):
        claim.Claim(str(tmp_path), claim.me("train")).take()
    _foreign(tmp_path, "node-7", claim.STALE_S + 30, slurm_job="41", job="slurm 41 step 0 restart 0")
    (message,) = claim.Claim(str(tmp_path), claim.me("train")).take()
    assert "from Slurm job 41 (pid 4242 on node-7" in message and "last refreshed 1" in message


def test_the_nodes_of_one_job_share_the_claim_and_other_jobs_are_refused(tmp_path, monkeypatch):
    _slurm(monkeypatch, "42")
    node0 = claim.Claim(str(tmp_path), claim.me("train"))
    assert node0.take() == []
    node1 = claim.Claim(str(tmp_path), claim.Holder(**{**vars(claim.me("train")), "host": "node-1"}))
    (joined,) = node1.take()
    assert joined.startswith(f"joined the claim of this job on {tmp_path / claim.CLAIM_FILE}")
    assert node1.still_ours() is None and not node1.owner
    _slurm(monkeypatch, "43")  # a resubmitted copy of the job while the first still runs
    with pytest.raises(RecipeError, match="in use by Slurm job 42"):
        claim.Claim(str(tmp_path), claim.me("train")).take()
    _slurm(monkeypatch, "42", step="1")  # another step of the same allocation
    with pytest.raises(RecipeError, match="in use by Slurm job 42"):
        claim.Claim(str(tmp_path), claim.me("train")).take()
    node1.release()  # a node that joined leaves the claim in place
    assert (tmp_path / claim.CLAIM_FILE).exists()
    node0.release()
    assert not (tmp_path / claim.CLAIM_FILE).exists()


def test_a_requeued_job_takes_over_from_its_earlier_start(tmp_path, monkeypatch):
    _foreign(tmp_path, "node-3", 5, slurm_job="42", restart="0", job="slurm 42 step 0 restart 0")
    _slurm(monkeypatch, "42", restart="1")
    (message,) = claim.Claim(str(tmp_path), claim.me("train")).take()
    assert "made by restart 0 of this job, which Slurm ended" in message


def test_losing_the_claim_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(claim, "REFRESH_S", 0.05)
    mine = claim.Claim(str(tmp_path), claim.me("train"))
    mine.take()
    lost = []
    mine.keep_fresh(lost.append)
    time.sleep(0.2)
    assert lost == [] and time.time() - (tmp_path / claim.CLAIM_FILE).stat().st_mtime < 1  # refreshed
    _foreign(tmp_path, "node-9", 0)  # taken over while this launcher was stalled
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost and "now held by a run (pid 4242 on node-9" in lost[0]
    mine.release()
    assert json.loads((tmp_path / claim.CLAIM_FILE).read_text())["host"] == "node-9"  # theirs is left alone


def test_a_stale_claim_taken_over_by_two_runs_at_once_has_one_winner(tmp_path):
    holder = _foreign(tmp_path, "node-5", claim.STALE_S + 10)
    a = claim.Claim(str(tmp_path), claim.me("a"))
    b = claim.Claim(str(tmp_path), claim.me("b"))
    assert a._remove_if(holder.token) and a._create()
    assert not b._remove_if(holder.token)  # b decided on the stale claim, but a's fresh one is there now
    assert json.loads((tmp_path / claim.CLAIM_FILE).read_text())["token"] == a.holder.token


def test_submit_sees_a_live_holder(tmp_path):
    assert claim.holder_of(str(tmp_path)) is None
    _foreign(tmp_path, "node-2", 3, slurm_job="7", job="slurm 7 step 0 restart 0")
    assert claim.holder_of(str(tmp_path)).slurm_job == "7"
    _foreign(tmp_path, "node-2", claim.STALE_S + 1, slurm_job="7", job="slurm 7 step 0 restart 0")
    assert claim.holder_of(str(tmp_path)) is None


def test_a_killed_launchers_heartbeat_folder_is_removed_by_the_next_one(tmp_path, monkeypatch):
    """SIGKILL skips the launcher's clean-up; the next launcher on the host removes what it left."""
    import tempfile

    from moe_comm import heartbeat

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / f"{heartbeat.FOLDER_PREFIX}{dead.pid}-abc"
    (left / "rank0").parent.mkdir()
    (left / "rank0").write_text("1 host\n")
    live = tmp_path / f"{heartbeat.FOLDER_PREFIX}{os.getpid()}-def"  # another launcher, still running
    live.mkdir()
    made = heartbeat.make_folder()
    assert made.is_dir() and made.name.startswith(f"{heartbeat.FOLDER_PREFIX}{os.getpid()}-")
    assert not left.exists() and live.exists()


def test_submit_warns_when_the_jobs_folder_is_in_use(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from moe_comm.__main__ import main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    folder = tmp_path / "debug_cpu-nccl-1x2-ep2-b2x128-fp32"
    folder.mkdir()
    _foreign(folder, "login-1", 2, slurm_job="77", job="slurm 77 step 0 restart 0")
    assert main(["submit", "recipes/debug_cpu.toml", "--dry-run", "--job.dump_folder", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert f"submit: warning: {folder} is in use by Slurm job 77" in err
    assert "--cluster.sbatch_args --dependency=afterany:77" in err
