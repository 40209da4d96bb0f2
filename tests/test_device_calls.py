"""The device calls' scripts (results/*/raw/run*/device_call.sh, and experiments/device_prelude.sh
they source) parse as bash: a prepared call with a syntax error would spend a device machine's
start-up and build before it stopped (device minutes are few: results/h200x1/README.md)."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(ROOT.glob("results/*/raw/run*/device_call.sh")) + [ROOT / "experiments/device_prelude.sh"]


def test_there_are_device_calls():
    assert len(SCRIPTS) > 10 and (ROOT / "results/h200x1/raw/run65/device_call.sh") in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_device_call_parses(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_prelude_defines_its_helpers():
    """The helpers its header names (and the prepared calls use) are its functions."""
    prelude = (ROOT / "experiments/device_prelude.sh").read_text()
    defined = set(re.findall(r"^(\w+)\(\) \{", prelude, re.M))
    assert {"stamp", "pack", "train", "bench_again", "fp8_experts_bench"} <= defined
    for helper in ("bench_again", "fp8_experts_bench", "train"):
        assert f"`{helper} " in prelude  # documented
