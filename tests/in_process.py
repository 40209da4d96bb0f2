"""Run an experiments/ script, or a `python -m moe_comm` verb, in this process as its command
line would, for tests that read its exit status and output.

Why: a fresh interpreter spends 5-25 s importing torch, TorchTitan and matplotlib on a 2-core
machine, which the suite's own process has already paid; the script itself runs in milliseconds
to seconds. What the script starts (its launcher's runs) still runs in processes of its own.
"""

import contextlib
import faulthandler
import io
import os
import runpy
import subprocess
import sys
import traceback
from pathlib import Path


def _captured(call, cwd: Path | None) -> tuple[int, str, str]:
    """call() from `cwd` with stdout and stderr captured: (exit status, stdout, stderr). The status
    is call()'s return value or SystemExit's code, 1 for an uncaught exception, whose traceback
    goes to stderr as the interpreter would print it."""
    out, err = io.StringIO(), io.StringIO()
    saved_cwd = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    enable = faulthandler.enable
    # faulthandler writes to a file descriptor, which the captured stderr has not: the process's own
    faulthandler.enable = lambda file=sys.__stderr__, all_threads=True: enable(file, all_threads)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = call() or 0
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:  # sys.exit("message"): printed to stderr, status 1
                    print(e.code, file=sys.stderr)
                    code = 1
            except Exception:  # noqa: BLE001 - the interpreter would print it and exit 1
                traceback.print_exc()
                code = 1
    finally:
        faulthandler.enable = enable
        os.chdir(saved_cwd)
    return code, out.getvalue(), err.getvalue()


def run_script(script: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGV...` from `cwd`."""
    saved = sys.argv, list(sys.path)
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.parent))  # the script's own folder first, as `python SCRIPT` has it
    try:
        code, out, err = _captured(lambda: runpy.run_path(str(script), run_name="__main__"), cwd)
    finally:
        sys.argv, sys.path[:] = saved
    return subprocess.CompletedProcess([sys.executable, str(script), *argv], code, out, err)


def run_verb(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m moe_comm ARGV...` (from `cwd` when given)."""
    from moe_comm.__main__ import main

    code, out, err = _captured(lambda: main(list(argv)), cwd)
    return subprocess.CompletedProcess([sys.executable, "-m", "moe_comm", *argv], code, out, err)
