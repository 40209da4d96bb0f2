"""Run an experiments/ script in this process as its command line would, for tests that read its
exit status and output.

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


def run_script(script: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGV...` from `cwd`: its exit status (SystemExit's code, 1 for an uncaught
    exception, whose traceback goes to stderr as the interpreter would print it), stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv, list(sys.path), os.getcwd()
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.parent))  # the script's own folder first, as `python SCRIPT` has it
    os.chdir(cwd)
    code = 0
    enable = faulthandler.enable
    # faulthandler writes to a file descriptor, which the captured stderr has not: the process's own
    faulthandler.enable = lambda file=sys.__stderr__, all_threads=True: enable(file, all_threads)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(script), run_name="__main__")
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
        sys.argv, sys.path[:] = saved[0], saved[1]
        os.chdir(saved[2])
    return subprocess.CompletedProcess([sys.executable, str(script), *argv], code, out.getvalue(), err.getvalue())
