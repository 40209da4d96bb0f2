"""What `train` shows of torchrun's stderr, and the footer when the shown rank cannot print it.

torchrun's stderr (its own messages, and the stderr of the rank it shows) passes through the
launcher (moe_comm.launch), which writes all of it to DUMP/logs/torchrun-{host}.log and shows it
line by line, except:
  - after a stop signal (SIGTERM, SIGINT, SIGHUP), nothing more: what follows is torchrun
    shutting the ranks down (its warnings, each rank's KeyboardInterrupt traceback, its own
    SignalException traceback), and the launcher says in one line that the run stopped and
    where the logs are;
  - torchrun's failure report (its own traceback, then a box that repeats each failed rank's
    traceback: a hundred lines when one rank was killed and the others lost their connection
    to it) is kept for the file and summed up in one line: the first failure torchrun saw.
The rank's own stdout (the step lines, the footer) does not pass here. When the shown rank
dies without its footer (killed), `missing_footer` finds another rank's in the rank logs.
"""

import re
import socket
import sys
import threading
import time
from pathlib import Path

# moe_comm.metrics.processor's footer lines (the end of every run that reached its processor)
FOOTER_RE = re.compile(r"moe_comm: (done at step|stopped early|FAILED|no training step ran)\b.*")
RUN_STARTED = "===== moe_comm: run started"  # moe_comm.console.RankLogFile's first line of a run
_RANK_PREFIX = re.compile(r"^\[(rank|default)?\d+\]:")  # torchrun's prefix of a rank's lines


def log_path(logs: Path) -> Path:
    return logs / f"torchrun-{socket.gethostname()}.log"


class Relay:
    """Copies a torchrun's stderr (a binary pipe) to `log` and, as said above, to the console."""

    def __init__(self, stream, log: Path, console=None):
        self.stream = stream
        self.log = log
        self.console = console or sys.stderr
        self.quiet = False  # set on a stop signal
        self.report: list[str] = []  # torchrun's failure report, held
        self._thread = threading.Thread(target=self._run, name="moe_comm-torchrun-stderr", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as out:
            out.write(f"===== moe_comm: torchrun started {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n")
            for raw in iter(self.stream.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                out.write(line)
                out.flush()
                if self.report or (line.startswith("Traceback (most recent call last)")
                                   and not _RANK_PREFIX.match(line)):
                    self.report.append(line.rstrip("\n"))  # torchrun's own: its report follows
                elif not self.quiet:
                    self.console.write(line)
                    self.console.flush()

    def join(self, timeout: float = 10.0) -> None:
        self._thread.join(timeout)

    def summary(self) -> str:
        """One line for torchrun's held failure report ("" when there was none)."""
        if not self.report:
            return ""
        first = _first_failure(self.report)
        return (f"moe_comm: torchrun's failure report ({len(self.report)} lines) is in {self.log}"
                + (f"; the first failure it saw: {first}" if first else ""))


def _first_failure(report: list[str]) -> str:
    """'rank 0 (pid 12956) exitcode -9 (SIGKILL): Signal 9 ...' from torchrun's "Root Cause"
    entry, or the report's last line (torchrun's own exception) without one."""
    try:
        start = next(i for i, line in enumerate(report) if line.startswith("Root Cause"))
    except StopIteration:
        return report[-1].strip()
    fields: dict[str, str] = {}
    for line in report[start + 1:]:
        if line.startswith("===="):
            break
        m = re.match(r"  (\w+)\s*: (.*)", line)
        if m and "traceback" not in fields:
            fields.setdefault(m.group(1), m.group(2).strip())
        elif "traceback" in fields and line.strip():  # a traceback's lines: the last says what
            fields["traceback"] = line.strip()
    rank = fields.get("rank", "?").split(" ")[0]
    exitcode = fields.get("exitcode", "?")
    why = fields.get("traceback", "")
    if why.startswith("moe_comm.errors.RecipeError"):  # the rank said it in one line (moe_comm.console)
        why = "the recipe error its rank printed"
    return f"rank {rank}, exitcode {exitcode}" + (f": {why}" if why else "")


def missing_footer(logs: Path, shown: set[int] | None, since: float) -> str:
    """The footer of the lowest rank that printed one in its log (DUMP/logs/rank{R}.log written
    after `since`), when none of the `shown` ranks did, so the console never showed one ("" when
    it did, or when `shown` is None: every rank shown, or not known here)."""
    if shown is None:
        return ""
    footers: dict[int, str] = {}
    for path in logs.glob("rank*.log"):
        rank = path.stem[4:]
        if not rank.isdigit():
            continue
        try:
            if path.stat().st_mtime < since:
                continue
            run = path.read_text(errors="replace").rsplit(RUN_STARTED, 1)[-1]
        except OSError:
            continue
        found = [m.group(0) for m in FOOTER_RE.finditer(run)]
        if found:
            footers[int(rank)] = found[-1]
    if not footers or shown & set(footers):
        return ""
    rank = min(footers)
    return f"{footers[rank]} (rank {rank}'s footer: the rank shown here printed none)"


def shown_ranks(log_rank: str, nnodes: int | None) -> set[int] | None:
    """The global ranks whose output torchrun shows (--local-ranks-filter) when that is known:
    on one node; None for 'all' and on several nodes."""
    if log_rank == "all" or nnodes not in (None, 1):
        return None
    return {int(r) for r in log_rank.split(",") if r.strip().isdigit()}
