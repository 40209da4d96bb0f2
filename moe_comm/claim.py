"""One run per dump folder: a claim file the launcher holds while its run trains.

Two runs in one folder resume each other's half-written checkpoints, save the same step to the
same path and interleave their metrics (1,2,3,4,5,6,4,5,6). On a cluster that is a resubmitted
job whose first copy still runs. So `train` claims {dump_folder}/claim.json before torchrun
starts, and a second run is refused there, naming the holder and how to proceed.

Why this primitive: the folder lives on whatever filesystem the user chose, on Soperator the
jail every node shares (network storage, no lock daemon we can count on). What such
filesystems give reliably is an atomic create of a name that fails if it exists: the claim is
written to a private file first, then hard-linked to claim.json (`link` fails with EEXIST when
the name is taken; a lost reply of a retried link is recognised by the private file's link
count, the recipe of open(2) for NFS). A reader never sees a half-written claim.

Liveness: the holding launcher refreshes the claim's modification time every REFRESH_S from a
thread. A claim is stale when its process is gone (same host: the pid, and the process's start
time so a reused pid does not count) or, from another host, when it was not refreshed for
STALE_S, measured against a file just written to the same folder (the filesystem's own clock,
so clock skew between nodes does not matter). A stale claim is taken over, saying so.

All nodes of one job share the claim: under Slurm `train` runs once per node (srun), and the
launchers of one job step (same SLURM_JOB_ID, step and restart count) join the claim the first
of them made; every one of them refreshes it, the one that made it removes it at the end.
A requeued job (the same job id, a later restart count) takes over the claim of its earlier
start, which Slurm has ended. Any other job is refused. Without Slurm, the launchers of one
multi-node run share by their --rdzv-id.
"""

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from moe_comm.errors import RecipeError

CLAIM_FILE = "claim.json"
REFRESH_S = 10.0
STALE_S = 120.0  # twelve missed refreshes: longer than any filesystem stall a run survives


@dataclass(frozen=True)
class Holder:
    """Who holds a claim (what claim.json says)."""

    token: str  # this claim, unique: a takeover checks it replaced exactly the stale one
    host: str
    pid: int
    pid_started: str  # the process's start time (/proc/PID/stat), to tell a reused pid
    job: str  # the run's job: "slurm 42 step 0 restart 0", "rdzv ID", or "" (this launcher only)
    slurm_job: str  # SLURM_JOB_ID or ""
    restart: str  # SLURM_RESTART_COUNT or ""
    started: float  # wall time the claim was made, for messages
    command: str

    def describe(self) -> str:
        job = f"Slurm job {self.slurm_job}" if self.slurm_job else (self.job or "a run")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"{job} (pid {self.pid} on {self.host}, since {when})"


def _process_started(pid: int) -> str:
    """Field 22 of /proc/PID/stat (start time in clock ticks); "" where it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def this_job(rdzv_id: str | None = None) -> tuple[str, str, str]:
    """(job key, Slurm job id, restart count) of this launcher; see the module doc."""
    job = os.environ.get("SLURM_JOB_ID", "")
    if job:
        step = os.environ.get("SLURM_STEP_ID", "")
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        return f"slurm {job} step {step or '-'} restart {restart}", job, restart
    return (f"rdzv {rdzv_id}" if rdzv_id else ""), "", ""


def me(command: str, rdzv_id: str | None = None) -> Holder:
    job, slurm_job, restart = this_job(rdzv_id)
    pid = os.getpid()
    return Holder(token=uuid.uuid4().hex, host=socket.gethostname(), pid=pid, pid_started=_process_started(pid),
                  job=job, slurm_job=slurm_job, restart=restart, started=time.time(), command=command)


def _read(path: Path) -> tuple[Holder | None, float]:
    """(the claim in `path` or None if there is none, its modification time). Opening the file
    makes a network filesystem revalidate its attributes (close-to-open)."""
    try:
        with open(path) as f:
            mtime = os.fstat(f.fileno()).st_mtime
            data = json.load(f)
        return Holder(**data), mtime
    except FileNotFoundError:
        return None, 0.0
    except (OSError, ValueError, TypeError) as e:  # not ours, or written by another version
        raise RecipeError(
            f"[job] dump_folder: {path} is not a claim this version can read ({type(e).__name__}: {e}); "
            "if no run uses the folder, remove it"
        ) from e


def _filesystem_now(folder: Path) -> float:
    """The folder's filesystem's clock: the modification time of a file written there now."""
    probe = folder / f".claim-clock-{socket.gethostname()}-{os.getpid()}"
    with open(probe, "w") as f:
        now = os.fstat(f.fileno()).st_mtime
    probe.unlink()
    return now


def stale_reason(holder: Holder, mtime: float, folder: Path) -> str:
    """Why `holder` no longer holds its claim ("" when it may still run)."""
    if holder.host == socket.gethostname():
        if holder.pid_started:
            alive = _process_started(holder.pid) == holder.pid_started
        else:  # no /proc where it was made: the pid alone
            try:
                os.kill(holder.pid, 0)
                alive = True
            except ProcessLookupError:
                alive = False
            except PermissionError:
                alive = True
        return "" if alive else f"its process {holder.pid} on {holder.host} is gone"
    silent = _filesystem_now(folder) - mtime
    if silent > STALE_S:
        return f"it was last refreshed {silent:.0f} s ago (a live launcher refreshes it every {REFRESH_S:.0f} s)"
    return ""


class Claim:
    """This launcher's claim on a dump folder: `take()` before torchrun, `release()` after."""

    def __init__(self, folder: str, holder: Holder):
        self.folder = Path(folder)
        self.path = self.folder / CLAIM_FILE
        self.holder = holder
        self.owner = False  # made the claim file (removes it at the end); else joined its job's claim
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> list[str]:
        """Claim the folder; what to tell the user (a stale claim taken over, a job joined).
        Raises RecipeError naming the holder while another run holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        messages: list[str] = []
        for _ in range(3):  # each retry follows a claim that appeared or vanished meanwhile
            if self._create():
                self.owner = self.held = True
                return messages
            theirs, mtime = _read(self.path)
            if theirs is None:
                continue
            if theirs.job and theirs.job == self.holder.job:
                self.held = True
                return messages + [f"joined the claim of this job on {self.path} (made by pid {theirs.pid} on {theirs.host})"]
            if theirs.slurm_job and theirs.slurm_job == self.holder.slurm_job and theirs.restart != self.holder.restart:
                reason = f"it was made by restart {theirs.restart} of this job, which Slurm ended before requeuing it"
            else:
                reason = stale_reason(theirs, mtime, self.folder)
            if not reason:
                raise RecipeError(self._refusal(theirs, mtime))
            if self._remove_if(theirs.token):
                messages.append(f"took over the claim on {self.folder} from {theirs.describe()}: {reason}")
        raise RecipeError(f"[job] dump_folder = {str(self.folder)!r}: {self.path} keeps changing; another "
                          "launcher is claiming it at the same moment: start one run per folder")

    def _refusal(self, theirs: Holder, mtime: float) -> str:
        age = _filesystem_now(self.folder) - mtime
        stop = f"`scancel {theirs.slurm_job}`" if theirs.slurm_job else f"`kill {theirs.pid}` on {theirs.host}"
        return (
            f"[job] dump_folder = {str(self.folder)!r} is in use by {theirs.describe()}, refreshed {age:.0f} s ago "
            f"({self.path}). Two runs in one folder resume each other's half-written checkpoints and mix their "
            f"metrics. Wait for it to end, stop it ({stop}), or give this run its own folder "
            f"(--job.dump_folder DIR). A claim whose process is gone, or that nobody refreshed for "
            f"{STALE_S:.0f} s, is taken over by the next run."
        )

    def _create(self) -> bool:
        """Atomically make the claim file ours; False when one exists."""
        tmp = self.folder / f".claim-{self.holder.host}-{self.holder.pid}-{self.holder.token[:8]}"
        tmp.write_text(json.dumps(asdict(self.holder), indent=1) + "\n")
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return os.stat(tmp).st_nlink == 2  # the link happened; its reply was lost and retried
        finally:
            tmp.unlink()

    def _remove_if(self, token: str) -> bool:
        """Remove the claim file if it still is the claim `token` (compare and remove: the file
        is moved to a private name first, so two runs taking over one stale claim cannot remove
        each other's fresh one)."""
        private = self.folder / f".claim-takeover-{self.holder.token[:8]}"
        try:
            os.rename(self.path, private)
        except FileNotFoundError:
            return False
        moved, _ = _read(private)
        if moved is not None and moved.token != token:  # a fresh claim appeared in between: put it back
            try:
                os.link(private, self.path)
            except FileExistsError:
                pass
            private.unlink()
            return False
        private.unlink()
        return True

    def still_ours(self) -> Holder | None:
        """None while the claim is this launcher's (or its job's); else who holds it now."""
        theirs, _ = _read(self.path)
        if theirs is not None and (theirs.token == self.holder.token or (theirs.job and theirs.job == self.holder.job)):
            return None
        return theirs or self.holder  # removed: nobody holds it, which also means it is lost

    def keep_fresh(self, on_lost) -> None:
        """Refresh the claim every REFRESH_S until `release`; call `on_lost(message)` once if it
        was taken over (this launcher stalled for longer than STALE_S)."""

        def refresh() -> None:
            while not self._stop.wait(REFRESH_S):
                try:
                    other = self.still_ours()
                    if other is None:
                        os.utime(self.path)
                        continue
                except (OSError, RecipeError):
                    other = None
                if self._stop.is_set():
                    return
                what = f"now held by {other.describe()}" if other and other.token != self.holder.token else "gone"
                on_lost(f"the claim on {self.folder} is {what}: this run stalled for longer than {STALE_S:.0f} s "
                        "and another took the folder over; stopping this one")
                return

        self._thread = threading.Thread(target=refresh, name="moe_comm-claim", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop refreshing; remove the claim if this launcher made it and it still is its own."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.owner and self.held:
            self._remove_if(self.holder.token)
        self.held = False


def holder_of(folder: str) -> Holder | None:
    """Who holds `folder` now, if anybody does and is not stale (for `submit`'s warning)."""
    path = Path(folder) / CLAIM_FILE
    try:
        theirs, mtime = _read(path)
    except RecipeError:
        return None
    if theirs is None or stale_reason(theirs, mtime, Path(folder)):
        return None
    return theirs
