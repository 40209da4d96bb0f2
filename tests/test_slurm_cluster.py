"""The local Slurm fixture itself: it starts a working cluster and leaves nothing behind."""

import os
from pathlib import Path

import pytest

from slurm_cluster import GPU_NODES, HOSTS_MARK, LIVE_NODES, LocalSlurm

pytestmark = pytest.mark.slurm


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_local_slurm_starts_and_stops_every_daemon_by_pid():
    cluster = LocalSlurm()
    try:
        cluster.start()
        pids = {name: p.pid for name, p in cluster.procs.items()}
        assert set(pids) == {"munged", "slurmctld", *(f"slurmd-{n}" for n in LIVE_NODES + GPU_NODES)}
        states = cluster.run("sinfo", "-h", "-N", "-o", "%N %t %G").stdout
        assert states.count(" idle gpu:8") == len(LIVE_NODES) + len(GPU_NODES), states
        job = cluster.run("srun", "--nodes=2", "--ntasks-per-node=1", "--partition=live", "hostname").stdout
        assert job.split() == [os.uname().nodename] * 2
        added = list(cluster.added_hosts_lines)
        assert added and all(f"{HOSTS_MARK} ({cluster.root})" in line for line in added)
    finally:
        cluster.stop()
    assert not [name for name, pid in pids.items() if _alive(pid)]
    assert cluster.procs == {}
    hosts = Path("/etc/hosts").read_text().splitlines()
    assert not [line for line in added if line in hosts], "stop() must remove the /etc/hosts lines it added"
