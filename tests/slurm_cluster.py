"""A real, throw-away Slurm cluster on this one machine, for the `slurm` tests and .ci/run.

Why a real Slurm and not a mock: the traps this project guards against (directives after the
first command are ignored, one task per node, c10d rendezvous on the head node) only show up
when sbatch/srun/slurmd actually parse and run the script.

Layout (measured recipe, ../shared/NOTES.md §5):
- munged with its own key and socket in a temp folder; Slurm finds it through
  `AuthInfo=socket=...`.
- slurmctld and one slurmd per "live" node, all in the foreground (-D) so we own their pids;
  two live nodes share this host through /etc/hosts names and distinct slurmd ports.
- proctrack/linuxproc + task/none (no cgroups or systemd here), select/cons_tres.
- Every node advertises 8 GPUs of gres, backed by fake character devices (mknod c 195 N),
  and more CPUs than the host has (SlurmdParameters=config_overrides).
- 32 more nodes (one slurmd each, ~10 MB apiece) in their own partition, so that
  `sbatch --test-only` can plan the 32-node 671B job. Nodes whose slurmd never registered are
  refused even by --test-only ("Requested node configuration is not available"), so they must
  really run.

Command line (used by .ci/run):  python tests/slurm_cluster.py install
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
BINARIES = ("sbatch", "srun", "squeue", "scontrol", "slurmctld", "slurmd", "munged")
HOSTS_MARK = "# moe-comm local slurm test node"
# three: the module's one-node and two-node jobs run side by side (each job takes its nodes whole)
LIVE_NODES = ("mcnode1", "mcnode2", "mcnode3")
LIVE_PARTITION = "live"
GPU_NODES = tuple(f"mcgpu{i}" for i in range(1, 33))
GPU_PARTITION = "b200"  # 32 nodes x 8 fake GPUs, the shape of the 671B job, for sbatch --test-only
CPUS_PER_NODE = 16
GPUS_PER_NODE = 8
FAKE_GPU_MAJOR = 195  # the NVIDIA character-device major number


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def install() -> None:
    """Install Debian's slurm-wlm and munge if any of their programs is missing (needs root)."""
    if not missing_binaries():
        return
    if os.geteuid() != 0:
        raise RuntimeError(
            f"Slurm programs {missing_binaries()} are missing and installing them needs root: "
            f"run `apt-get install -y {' '.join(PACKAGES)}` as root, then rerun."
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", *PACKAGES], check=True, env=env)
    still = missing_binaries()
    if still:
        raise RuntimeError(f"apt-get installed {PACKAGES} but {still} are still not on PATH")


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for bind(0) and outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _free_port_block(n: int) -> int:
    """First of n consecutive free TCP ports (so parallel CI jobs on one host do not collide),
    below the ephemeral range: the daemons bind them seconds after this check, and in between
    every gloo connection and bind(0) of the suite's trainings takes ephemeral ports (a slurmd
    once found its port taken: "Unable to bind listen port (38304): Address already in use")."""
    top = min(_ephemeral_low(), 65000) - n
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, top)
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no block of free TCP ports found for the local Slurm")


@contextlib.contextmanager
def _hosts_lock():
    """/etc/hosts edits one at a time (clusters of one session start and stop from two threads)."""
    with open(Path(tempfile.gettempdir()) / "moe-comm-slurm-hosts.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@dataclass
class LocalSlurm:
    """Start/stop the cluster; `env` is what a client (sbatch, squeue) needs to talk to it."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="moe-slurm-")))
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    added_hosts_lines: list[str] = field(default_factory=list)
    # the daemons' niceness, which the jobs' processes inherit (slurmd forks slurmstepd)
    nice: int = 0

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    # ---- set-up -------------------------------------------------------------------------
    def start(self) -> "LocalSlurm":
        install()
        for d in ("munge", "state", "log", "spool", "dev"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        self._add_hosts()
        self._fake_gpus()
        all_nodes = LIVE_NODES + GPU_NODES
        base = _free_port_block(1 + len(all_nodes))
        self._write_conf(ctld_port=base, node_ports={n: base + 1 + i for i, n in enumerate(all_nodes)})
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self._start_munge()
        self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        for node in all_nodes:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait_nodes_idle()
        return self

    def _add_hosts(self) -> None:
        """Fake node names resolve to this host; only lines we add are removed in stop(). Each
        cluster adds lines of its own (its folder in them), so one that stops while another of
        the session runs (the Slurm jobs start in the background) leaves the other's names."""
        with _hosts_lock():
            text = Path("/etc/hosts").read_text()
            theirs = [line for line in text.splitlines() if line.strip() and HOSTS_MARK not in line]
            for node in LIVE_NODES:
                if not any(line.split()[1:2] == [node] for line in theirs):
                    self.added_hosts_lines.append(f"127.0.0.1 {node} {HOSTS_MARK} ({self.root})")
            if self.added_hosts_lines:
                with open("/etc/hosts", "a") as f:
                    f.write("".join(line + "\n" for line in self.added_hosts_lines))

    def _fake_gpus(self) -> None:
        for i in range(GPUS_PER_NODE):
            path = self.root / "dev" / f"nvidia{i}"
            if not path.exists():
                os.mknod(path, 0o666 | 0o020000, os.makedev(FAKE_GPU_MAJOR, i))

    def _write_conf(self, ctld_port: int, node_ports: dict[str, int]) -> None:
        r = self.root
        host = socket.gethostname()
        node_spec = (
            f"CPUs={CPUS_PER_NODE} Boards=1 SocketsPerBoard=1 CoresPerSocket={CPUS_PER_NODE} "
            f"ThreadsPerCore=1 RealMemory=16000 Gres=gpu:{GPUS_PER_NODE}"
        )
        nodes = [
            f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={host} Port={p} {node_spec} State=UNKNOWN"
            for n, p in node_ports.items()
        ]
        lines = [
            "ClusterName=moecomm",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={node_ports[LIVE_NODES[0]]}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also sets how long a requeued job waits before it may start again
            # (default 120 s); 10 s keeps the requeue test short.
            f"AuthInfo=socket={r / 'munge' / 'munge.socket.2'},cred_expire=10",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu",
            "SlurmdParameters=config_overrides",
            "MpiDefault=none",
            "ReturnToService=2",
            "MinJobAge=2",
            # job ids of their own: the job logs (slurm/logs/NAME-ID.out) of an earlier cluster
            # on this machine are never appended to, nor read as this one's
            f"FirstJobId={random.Random().randint(1, 9_999) * 1_000}",
            "JobRequeue=1",
            "SchedulerParameters=sched_interval=2,bf_interval=2",  # a requeued job restarts promptly
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=300",
            *nodes,
            f"PartitionName={LIVE_PARTITION} Nodes={','.join(LIVE_NODES)} Default=YES MaxTime=INFINITE State=UP",
            f"PartitionName={GPU_PARTITION} Nodes={','.join(GPU_NODES)} MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        gres = [f"NodeName={n} Name=gpu File={r / 'dev'}/nvidia[0-{GPUS_PER_NODE - 1}]" for n in node_ports]
        (r / "gres.conf").write_text("\n".join(gres) + "\n")

    def _start_munge(self) -> None:
        m = self.root / "munge"
        key = m / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        self._spawn(
            "munged",
            [
                "munged", "-F", "-f", f"--socket={m / 'munge.socket.2'}", f"--key-file={key}",
                f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
                f"--seed-file={m / 'munged.seed'}",
            ],
        )
        self._wait(lambda: (m / "munge.socket.2").exists(), 10, "munged socket")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "w")
        niced = ["nice", "-n", str(self.nice)] if self.nice else []
        self.procs[name] = subprocess.Popen([*niced, *cmd], stdout=log, stderr=subprocess.STDOUT, env=self.env or None)

    def _wait(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode} while waiting for {what}; {self.logs_hint()}")
            if ok():
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out after {timeout}s waiting for {what}; {self.logs_hint()}")

    def _wait_nodes_idle(self) -> None:
        def idle() -> bool:
            r = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"],
                env=self.env, capture_output=True, text=True,
            )
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            return r.returncode == 0 and all(states.get(n) == "idle" for n in LIVE_NODES + GPU_NODES)

        self._wait(idle, 60, "all nodes to be idle")

    def logs_hint(self) -> str:
        return f"daemon logs are in {self.root / 'log'}"

    # ---- use ----------------------------------------------------------------------------
    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, check=check, timeout=timeout)

    def job_state(self, job_id: str) -> str:
        r = self.run("scontrol", "show", "job", job_id, check=False)
        for tok in r.stdout.split():
            if tok.startswith("JobState="):
                return tok.split("=", 1)[1]
        return "GONE"

    # ---- tear-down ----------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel jobs, then stop every daemon we started, by pid; undo /etc/hosts lines."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--user", str(os.geteuid())], env=self.env, capture_output=True, timeout=20)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                r = subprocess.run(["squeue", "-h"], env=self.env, capture_output=True, text=True)
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(0.5)
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=5)
        self.procs.clear()
        if self.added_hosts_lines:
            with _hosts_lock():
                text = Path("/etc/hosts").read_text().splitlines(keepends=True)
                keep = [line for line in text if line.rstrip("\n") not in self.added_hosts_lines]
                Path("/etc/hosts").write_text("".join(keep))
            self.added_hosts_lines.clear()


if __name__ == "__main__":
    verb = sys.argv[1] if len(sys.argv) > 1 else ""
    if verb == "install":
        install()
        print("slurm-wlm and munge are installed:", ", ".join(shutil.which(b) or b for b in BINARIES))
    elif verb == "smoke":
        cluster = LocalSlurm()
        try:
            cluster.start()
            print(cluster.run("sinfo", "-N").stdout)
        finally:
            cluster.stop()
    else:
        sys.exit("usage: python tests/slurm_cluster.py install|smoke")
