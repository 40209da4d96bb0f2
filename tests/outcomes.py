"""What a module's `in_background` work (tests/conftest.py) produced, failure included: each
test that reads an outcome raises its failure, so one failed job fails the tests that need it,
not the module's set-up."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def kept(fn, *args):
    """fn(*args), or the exception it raised (re-raised by `result` in the test that reads it)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - kept for the test that reads it
        return e


def result(outcome):
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def run_script(script: str, *argv: str, nice: int, env: dict[str, str] | None = None) -> None:
    """`python SCRIPT ARGV...` from the repository root, as its command line runs it, in a process
    of its own at niceness `nice` (with `env` added to this environment); its exit status must be
    0, else the error carries its output's end."""
    proc = subprocess.run(["nice", "-n", str(nice), sys.executable, script, *argv], cwd=REPO,
                          env=dict(os.environ, **(env or {})), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
