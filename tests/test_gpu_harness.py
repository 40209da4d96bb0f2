"""The GPU tests' launcher, on CPU (tests/test_nvshmem_gpu.py runs on the device only)."""

import subprocess
import sys
import time

from test_nvshmem_gpu import wait_all


def _sleeper(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_each_launch_ends_when_it_ends_not_when_its_turn_comes():
    """Launches side by side: the short one's end time is its own, although the long one comes
    first in the batch (run 55 timed an error job by the longer launch beside it)."""
    start = time.time()
    long, short = _sleeper(3.0), _sleeper(0.2)
    ends = wait_all([long, short], timeout_s=30)
    assert ends[1] - start < 2.0 <= ends[0] - start
    assert long.returncode == 0 and short.returncode == 0


def test_a_launch_past_the_limit_is_killed():
    start = time.time()
    proc = _sleeper(60)
    (end,) = wait_all([proc], timeout_s=0.5)
    assert end - start < 10 and proc.returncode != 0
