"""What a training run prints: a short header, one line per step, a short footer.

TorchTitan's trainer logs about a hundred INFO lines on every rank (its model arguments, mesh
set-up, tokenizer, GC), warnings this code path expects (no grouped GEMM on CPU, its own
peak-FLOPS lookup that moe_comm.metrics replaces), Python warnings from libraries, and a step
line of its own next to ours. A person watching a run wants progress; a person debugging one
wants everything. So from the moment TorchTitan imports `moe_comm.titan` (the recipe's
custom_import; only TorchTitan's first two lines, its version and "Starting job", come
earlier, and the version is held for the file by moe_comm.trainer), `setup()` routes
TorchTitan's root logger:

- every record goes, without colour codes, to this rank's log file DUMP/logs/rank{R}.log: held
  in memory until the metrics processor knows the dump folder (`open_log_file`), written to
  stderr instead if an exception ends the run before that;
- the console (TorchTitan's own stdout handler) keeps only the lines this package sends it
  (`show`: the header, the step line, the footer, start-up progress), the TorchTitan INFO lines
  that say where a run is (`TITAN_PROGRESS`: model size, batch summary, first step, checkpoint
  saves and loads), and every warning and error except the `EXPECTED` ones, which
  only the file keeps, each with the reason it is expected;
- Python warnings go through logging (`logging.captureWarnings`), so the same rules apply.

`StartupWatch` covers the silent seconds before the first step line (model set-up, checkpoint
load, torch.compile, a backend's first dispatch): when they last long it names what is running,
and step 1's line reports how long the one-time work took.
Colour is for terminals only (`use_color`).
"""

import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass

from torchtitan.tools.logging import logger

from moe_comm.errors import RecipeError

# Record attribute that marks a line for the console: logger.info(msg, extra={CONSOLE: True}).
CONSOLE = "moe_comm_console"

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")

# TorchTitan 0.2.2 INFO lines (colour codes removed) that tell where a run is: on the console.
TITAN_PROGRESS = (
    "Model ",  # "Model deepseek_v3_moe_comm 671B size: N total parameters" (train.py)
    "Trainer is initialized with",  # batch sizes, gradient accumulation, total steps
    "Training starts at step",  # the first step begins (a resumed run: after its checkpoint)
    "Loading the checkpoint from",
    "Finished loading the checkpoint",
    "Finished saving the checkpoint",
)


@dataclass(frozen=True)
class Expected:
    """A warning this code path produces by design: kept out of the console, explained in the file."""

    text: str  # a substring of the warning
    why: str


EXPECTED = (
    Expected(
        "will be overridden to 3 based on job config",
        "TorchTitan sets TORCH_NCCL_ASYNC_ERROR_HANDLING from [comm]; torchrun's default is replaced as intended",
    ),
    Expected(
        "Failed to use grouped mm, which is only supported on SM90 or later",
        "no grouped GEMM on CPU or before Hopper: TorchTitan runs the experts one by one (same numbers)",
    ),
    Expected(
        "Error running lspci",
        "TorchTitan's own peak-FLOPS lookup; the MFU on the step line uses moe_comm.metrics.peaks",
    ),
    Expected(
        "Peak flops undefined for",
        "TorchTitan's own peak-FLOPS lookup; the MFU on the step line uses moe_comm.metrics.peaks",
    ),
    Expected(
        "model.safetensors.index.json not found at hf_assets_path",
        "the assets folder holds a tokenizer, not a Hugging Face checkpoint; matters only when "
        "saving checkpoints in HF format",
    ),
    Expected(
        "Pipeline Parallel loss is not visible",
        "moe_comm's step line shows the last pipeline stage's loss on every rank",
    ),
    Expected(
        "DTensor random operators may not have complete support on cpu device mesh",
        "CPU runs: DTensor's RNG tracker has no CPU generator; weights are initialised before "
        "sharding, so the seeded numbers are the same",
    ),
    Expected(
        "DTensor manual_seed() may not have complete support on cpu device mesh",
        "CPU runs: the same DTensor RNG note, from TorchTitan's seeding",
    ),
    Expected(
        "Failed to load JSON from file",
        "datasets' JSON reader on a bad record (its row counts within a block, not the file): "
        "moe_comm.titan.data names the file, line and field",
    ),
    Expected(
        "'set_vital' is deprecated",
        "torchdata's StatefulDataLoader calls a deprecated torch API; nothing to do here",
    ),
)


def plain(text: str) -> str:
    """Text without ANSI colour codes."""
    return _ANSI_RE.sub("", text)


def expected(text: str) -> Expected | None:
    return next((e for e in EXPECTED if e.text in text), None)


def use_color() -> bool:
    """Colour codes only where a terminal shows them (not in Slurm logs, files or pipes)."""
    return sys.stdout.isatty() and os.environ.get("NO_COLOR", "") == ""


def show(message: str) -> None:
    """Print a line on the console (and into the log file)."""
    logger.info(message, extra={CONSOLE: True})


class ConsoleFilter(logging.Filter):
    """What TorchTitan's stdout handler still prints (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, CONSOLE, False):
            return True
        text = plain(record.getMessage())
        if record.levelno >= logging.WARNING:
            return expected(text) is None
        return text.startswith(TITAN_PROGRESS)


class FileFormatter(logging.Formatter):
    """TorchTitan's line format, without colour codes; an expected warning is explained the
    first time it appears."""

    def __init__(self):
        super().__init__("[titan] %(asctime)s - %(name)s - %(levelname)s - %(message)s")
        self._explained: set[str] = set()

    def format(self, record: logging.LogRecord) -> str:
        text = plain(super().format(record))
        known = expected(text) if record.levelno >= logging.WARNING else None
        if known is None:
            return text
        if known.text in self._explained:
            return f"{text}  [expected, see above]"
        self._explained.add(known.text)
        return f"{text}  [expected: {known.why}]"


class RankLogFile(logging.Handler):
    """Every record of this rank; in memory until `open(path)`, then appended to the file."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.setFormatter(FileFormatter())
        self.path: str | None = None
        self._file = None
        self._pending: list[logging.LogRecord] = []

    def open(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.acquire()
        try:
            if self._file is None:
                self._file = open(path, "a")
                self.path = path
                self._file.write(f"===== moe_comm: run started {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n")
                for record in self._pending:
                    self._file.write(self.format(record) + "\n")
                self._pending.clear()
                self._file.flush()
        finally:
            self.release()

    def emit(self, record: logging.LogRecord) -> None:
        if self._file is None:
            self._pending.append(record)
            return
        self._file.write(self.format(record) + "\n")
        self._file.flush()

    def write_pending_to_stderr(self) -> None:
        """A crash before the log file opened: nothing is lost."""
        if self._file is None and self._pending:
            sys.stderr.write("moe_comm: the run stopped before its log file was opened; its log so far:\n")
            for record in self._pending:
                sys.stderr.write(self.format(record) + "\n")
            self._pending.clear()


_log_file: RankLogFile | None = None
failure_shown = False  # the footer named the exception that ends the run (moe_comm.metrics.processor)

# TorchTitan's lines logged before it imports moe_comm.titan that only the rank's log file keeps
# (its version, which it prints on every run); moe_comm.trainer holds them from the start
FILE_ONLY_EARLY = ("torchtitan version: ",)


class _HoldEarly(logging.Filter):
    """On TorchTitan's logger until `setup`: keeps the FILE_ONLY_EARLY records for the log file."""

    def __init__(self):
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if plain(record.getMessage()).startswith(FILE_ONLY_EARLY):
            self.held.append(record)
            return False
        return True


_early = _HoldEarly()


def hold_early_lines() -> None:
    """Before TorchTitan's trainer starts (moe_comm.trainer): its FILE_ONLY_EARLY lines go to
    the rank's log file, not the console. A filter on its logger, which its init_logger keeps."""
    logger.addFilter(_early)


def _write_pending_on_crash(log: RankLogFile) -> None:
    """An exception that ends the process before the log file opened (a missing tokenizer, a
    bad mesh) also prints the log so far, which says what led to it; once the file is open, the
    traceback also goes into it (the console may not show this rank)."""
    previous = sys.excepthook

    def hook(*exc_info):
        if not isinstance(exc_info[1], RecipeError):  # its one line says all
            log.write_pending_to_stderr()
        if log.path is not None:
            import traceback

            log.acquire()
            try:
                log._file.write("".join(traceback.format_exception(*exc_info)))
                log._file.flush()
            finally:
                log.release()
        if isinstance(exc_info[1], RecipeError):  # bad input only the ranks could see: one line says it
            if not failure_shown:
                sys.stderr.write(f"moe_comm: rank {os.environ.get('RANK', '0')}: {exc_info[1]}\n")
            return
        previous(*exc_info)

    sys.excepthook = hook


def setup() -> None:
    """Route TorchTitan's root logger as the module docstring says (idempotent). Only inside
    TorchTitan's trainer, whose init_logger put a StreamHandler to stdout on the root logger:
    other importers of moe_comm.titan (`check` reads its flavors) keep their logging as it is."""
    global _log_file
    console = [h for h in logger.handlers if isinstance(h, logging.StreamHandler) and h.stream is sys.stdout]
    if _log_file is not None or not console:
        return
    _log_file = RankLogFile()
    logger.removeFilter(_early)
    _log_file._pending += _early.held  # for the file only: they never reached the console
    for handler in console:
        handler.addFilter(ConsoleFilter())
    logger.addHandler(_log_file)
    logging.captureWarnings(True)  # py.warnings propagates to the root logger
    _write_pending_on_crash(_log_file)
    import datasets

    library = logging.getLogger("datasets")  # its own stderr handler: its records go the way of the others
    for handler in list(library.handlers):
        library.removeHandler(handler)
    if not sys.stderr.isatty():
        # "Generating train split: 600 examples" progress bars, redrawn with \r, in a log file
        datasets.disable_progress_bars()
    watch.register_compile_callbacks()


def open_log_file(dump_folder: str, rank: int) -> str | None:
    """Start writing this rank's log into DUMP/logs/rank{R}.log; returns its path (None
    without setup(), e.g. a processor built by a test)."""
    if _log_file is None:
        return None
    _log_file.open(os.path.join(dump_folder, "logs", f"rank{rank}.log"))
    return _log_file.path


class StartupWatch:
    """What the run is doing before its first step line.

    `phase(text)` names the current one-time work; a background thread prints it `quiet_s`
    seconds after `start`, then every `every_s`, until `stop` (the first step line). So a CPU
    run, whose first step comes within seconds, prints nothing extra. torch.compile and a
    backend's first dispatch also add up their time (`summary()`, for step 1's line), and the
    first compilation is announced as it starts: it is the longest silence of a compiled recipe.
    """

    def __init__(self, quiet_s: float = 20.0, every_s: float = 60.0):
        self.quiet_s = quiet_s
        self.every_s = every_s
        self._phase = ""
        self._started = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._compile_started: list[float] = []
        self._compiles = 0
        self.timings: dict[str, float] = {}  # one-time work on the way to the first step line

    def start(self, phase: str) -> None:
        self._phase = phase
        self._started = time.monotonic()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="moe_comm-startup-watch", daemon=True)
            self._thread.start()

    def phase(self, text: str) -> None:
        self._phase = text

    def add_time(self, what: str, seconds: float) -> None:
        with self._lock:
            self.timings[what] = self.timings.get(what, 0.0) + seconds

    def stop(self) -> None:
        self._stop.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stop.is_set()

    def summary(self) -> str:
        """'torch.compile 31.0s, first nvshmem dispatch 4.2s': what step 1 spent on one-time work."""
        return ", ".join(f"{what} {s:.1f}s" for what, s in self.timings.items() if s >= 0.5)

    def _run(self) -> None:
        wait = self.quiet_s
        while not self._stop.wait(wait):
            if self._phase:
                show(f"still {self._phase} ({time.monotonic() - self._started:.0f} s so far)")
            wait = self.every_s

    def register_compile_callbacks(self) -> None:
        try:
            from torch._dynamo import callback as dynamo_callback
        except ImportError:  # a torch without dynamo's callback hooks: the heartbeat still runs
            return
        dynamo_callback.on_compile_start(self._on_compile_start)
        dynamo_callback.on_compile_end(self._on_compile_end)

    def _on_compile_start(self, args=None) -> None:
        if not self.running:
            return
        self._compiles += 1
        self._compile_started.append(time.monotonic())
        if self._compiles == 1:
            show("torch.compile is compiling the model (one-time, during the first steps)")
        self._phase = f"compiling with torch.compile (graph {self._compiles})"

    def _on_compile_end(self, args=None) -> None:
        if self._compile_started:
            self.add_time("torch.compile", time.monotonic() - self._compile_started.pop())
        if self.running:
            self._phase = "running the first step"


watch = StartupWatch()
