"""Rank liveness, so that a hung job names the rank that hung.

When one rank stops (a frozen process, a node that stopped scheduling it), the others block in
their next collective until the comm timeout and then fail; torchrun's "Root Cause" is the
first rank that raised, which is a healthy one. So every rank `python -m moe_comm train`
starts touches a file in a folder the launcher owns (MOE_COMM_HEARTBEAT_DIR) once per
HEARTBEAT_S from a daemon thread, which keeps beating while the rank computes or waits and
stops only when the process itself stops. After a failure the launcher names the ranks whose
beat ended well before the others' (`stopped_ranks`).

The same module makes ranks die with their torchrun: a rank whose torchrun was killed outright
(SIGKILL, an OOM kill) gets SIGKILL instead of training on as an orphan.
"""

import ctypes
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

DIR_ENV = "MOE_COMM_HEARTBEAT_DIR"
HEARTBEAT_S = 1.0
STALE_S = 5 * HEARTBEAT_S  # a beat this much older than the newest one means the rank stopped
_PR_SET_PDEATHSIG = 1

_started = False
try:  # resolved at import, so that a forked child (preexec_fn) only makes the system call
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: ranks then only stop through torchrun
    _prctl = None


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Linux: deliver `sig` to this process when its parent exits (prctl PR_SET_PDEATHSIG)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def start() -> None:
    """In a rank started by `moe_comm train` (MOE_COMM_HEARTBEAT_DIR set): beat, and die with
    torchrun. Elsewhere (tests, mp.spawn, plain torchrun) nothing happens. Idempotent."""
    global _started
    folder = os.environ.get(DIR_ENV)
    if _started or not folder or "RANK" not in os.environ:
        return
    _started = True
    die_with_parent()
    path = Path(folder) / f"rank{os.environ['RANK']}"
    path.write_text(f"{os.getpid()} {socket.gethostname()}\n")

    def beat() -> None:
        while True:
            try:
                os.utime(path)
            except OSError:  # the launcher removed its folder: the run is over
                return
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, name="moe_comm-heartbeat", daemon=True).start()


FOLDER_PREFIX = "moe_comm-heartbeat-"


def make_folder() -> Path:
    """A fresh heartbeat folder for this launcher in the host's temp dir, named with its pid;
    folders left by launchers of this host that were killed outright (SIGKILL skips the
    launcher's own clean-up) are removed first."""
    import shutil
    import tempfile

    for old in Path(tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*"):
        pid = old.name[len(FOLDER_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-"))


@dataclass(frozen=True)
class Beat:
    rank: int
    pid: int
    host: str
    last: float  # time of the last beat (mtime)


def read(folder: Path) -> list[Beat]:
    beats = []
    for path in sorted(folder.glob("rank*")):
        try:
            pid, host = path.read_text().split()
            beats.append(Beat(int(path.name[4:]), int(pid), host, path.stat().st_mtime))
        except (OSError, ValueError):
            continue
    return beats


def stopped_ranks(beats: list[Beat]) -> list[tuple[Beat, float]]:
    """The ranks whose beat ended more than STALE_S before the newest one, with how much earlier."""
    if not beats:
        return []
    newest = max(b.last for b in beats)
    return [(b, newest - b.last) for b in beats if newest - b.last > STALE_S]
