"""What a training run prints (moe_comm.console, moe_comm.metrics.step_line).

- The step line's fields, in order, on CPU and on GPU (bf16 and 8-bit peaks), under PP, with
  comm not measured, and with colour codes only when a terminal asked for them.
- The console filter and the per-rank log file: which records reach the console, that expected
  warnings are kept out of it but explained in the file, that nothing before the file opens is
  lost.
- The start-up watch names the running phase when a step is slow to come, and times
  torch.compile for step 1's line.
- The real CPU default job (`python -m moe_comm train recipes/debug_cpu.toml`, conftest's shared run): one line per
  step plus a short header and footer, no colour codes in a pipe, the rest in the log file.
"""

import logging
import math
import re
import time

import pytest
from torchtitan.tools.utils import Color

from moe_comm import console
from moe_comm.metrics.peaks import resolve_peak
from moe_comm.metrics.step_line import format_duration, StepLine


# The step line, field by field (moe_comm.metrics.step_line): what the CPU job test parses.
STEP_LINE_RE = re.compile(
    r"^step +(?P<step>\d+)/(?P<total>\d+)"
    r"(?:  pp(?P<pp>\d+) of (?P<pp_size>\d+))?"
    r"  (?P<seconds>\d+\.\d\d) s/step"
    r"  eta (?P<eta>--|\d+:\d\d(?::\d\d)?)"
    r"  loss (?P<loss>-?\d+\.\d{4})"
    r"  gnorm (?P<gnorm>\d+\.\d\d)"
    r"  tok/s (?P<tps>[\d,]+)"
    r"  mfu (?P<mfu>n/a|\d+\.\d% of [\d.]+ TFLOPS (?:bf16|fp8))"
    r"  mem (?P<mem>n/a|\d+\.\dGiB \(\d+%\))"
    r"  (?:dispatch (?P<dispatch>\d+\.\d)ms combine (?P<combine>\d+\.\d)ms \((?P<comm_pct>\d+\.\d)% of step\)"
    r"|comm n/a \((?P<comm_note>[^)]*)\))"
    r"(?:  \(first step: (?P<first_step>[^)]*)\))?$"
)


def _line(**overrides) -> StepLine:
    fields = dict(
        step=3, total_steps=5, seconds_per_step=1.912, eta_s=3.8, loss=6.23801, grad_norm=7.4585,
        tokens_per_s=268.2, mfu_pct=math.nan, peak=resolve_peak("CPU", []), mem_gib=None,
        mem_pct=None, dispatch_ms=47.51, combine_ms=28.3, comm_pct=3.97,
    )
    fields.update(overrides)
    return StepLine(**fields)


def test_step_line_on_cpu():
    assert _line().format() == (
        "step 3/5  1.91 s/step  eta 0:04  loss 6.2380  gnorm 7.46  tok/s 268  mfu n/a  mem n/a  "
        "dispatch 47.5ms combine 28.3ms (4.0% of step)"
    )


def test_step_line_on_gpu_names_the_mfu_peak():
    bf16 = _line(step=40, total_steps=100, seconds_per_step=0.7304, eta_s=43.8, tokens_per_s=22620.4,
                 mfu_pct=43.74, peak=resolve_peak("NVIDIA H200", []), mem_gib=134.61, mem_pct=96.3,
                 dispatch_ms=4.12, combine_ms=3.21, comm_pct=1.0)
    assert bf16.format() == (
        "step  40/100  0.73 s/step  eta 0:44  loss 6.2380  gnorm 7.46  tok/s 22,620  "
        "mfu 43.7% of 989 TFLOPS bf16  mem 134.6GiB (96%)  dispatch 4.1ms combine 3.2ms (1.0% of step)"
    )
    fp8 = _line(mfu_pct=21.4, peak=resolve_peak("NVIDIA B200", ["quantize.grouped_mm.mx"]))
    assert "  mfu 21.4% of 4500 TFLOPS fp8  " in fp8.format()
    for line in (bf16, fp8):
        assert STEP_LINE_RE.match(line.format()), line.format()


def test_step_line_first_step_pp_and_unmeasured_comm():
    first = _line(step=1, eta_s=None, pp_stage=(1, 8), dispatch_ms=None, combine_ms=None,
                  comm_pct=None, comm_note="MOE_COMM_INSTRUMENT=0",
                  first_step="torch.compile 31.0s, first nvshmem dispatch 4.2s")
    text = first.format()
    assert text == (
        "step 1/5  pp1 of 8  1.91 s/step  eta --  loss 6.2380  gnorm 7.46  tok/s 268  mfu n/a  "
        "mem n/a  comm n/a (MOE_COMM_INSTRUMENT=0)  (first step: torch.compile 31.0s, first nvshmem dispatch 4.2s)"
    )
    m = STEP_LINE_RE.match(text)
    assert m and m["pp"] == "1" and m["comm_note"] == "MOE_COMM_INSTRUMENT=0" and m["eta"] == "--"
    assert format_duration(3 * 3600 + 125) == "3:02:05" and format_duration(59.6) == "1:00"


def test_step_line_colour_only_when_asked():
    plain_line = _line().format()
    assert "\x1b[" not in plain_line
    coloured = _line().format(Color())
    assert "\x1b[" in coloured and console.plain(coloured) == plain_line


def _record(msg: str, level: int = logging.INFO, **extra) -> logging.LogRecord:
    record = logging.LogRecord("root", level, __file__, 1, msg, None, None)
    record.__dict__.update(extra)
    return record


def test_console_filter_and_log_file(tmp_path):
    keep = console.ConsoleFilter().filter
    assert keep(_record("step 1/5 ...", **{console.CONSOLE: True}))
    assert keep(_record("\x1b[34mModel deepseek_v3_moe_comm debugmodel \x1b[31msize: 33 total parameters"))
    assert keep(_record("Training starts at step 51"))
    assert not keep(_record("Building deepseek_v3_moe_comm debugmodelwith {...}"))
    assert not keep(_record("Failed to use grouped mm, which is only supported on SM90 or later", logging.WARNING))
    assert keep(_record("Warmup (2) + decay (4) steps exceed total steps (5).", logging.WARNING))
    assert keep(_record("anything at all", logging.ERROR))

    log = console.RankLogFile()
    log.handle(_record("before the dump folder is known"))
    log.handle(_record("Peak flops undefined for: CPU, fallback to A100", logging.WARNING))
    log.handle(_record("Peak flops undefined for: CPU, fallback to A100", logging.WARNING))
    path = tmp_path / "logs" / "rank0.log"
    log.open(str(path))
    log.handle(_record("\x1b[32mafter\x1b[39m"))
    text = path.read_text()
    assert "before the dump folder is known" in text and "after" in text and "\x1b[" not in text
    # explained once, where it first appears
    assert re.search(r"Peak flops undefined for: CPU, fallback to A100  \[expected: .*moe_comm.metrics.peaks", text)
    assert text.count("[expected: ") == 1 and "fallback to A100  [expected, see above]" in text


def test_log_written_to_stderr_when_the_run_stops_before_the_file(capsys):
    log = console.RankLogFile()
    log.handle(_record("Loading tokenizer from tokenizer.json"))
    log.write_pending_to_stderr()
    err = capsys.readouterr().err
    assert "stopped before its log file was opened" in err and "Loading tokenizer" in err


def test_startup_watch_names_the_phase_and_times_compile(caplog):
    import torch

    watch = console.StartupWatch(quiet_s=0.2, every_s=10)
    watch.register_compile_callbacks()
    with caplog.at_level(logging.INFO):
        watch.start("setting up the model")
        time.sleep(0.6)
        watch.phase("running the first step")
        torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
        watch.stop()
    messages = [r.getMessage() for r in caplog.records if getattr(r, console.CONSOLE, False)]
    assert any(m.startswith("still setting up the model (") for m in messages), messages
    assert "torch.compile is compiling the model (one-time, during the first steps)" in messages
    assert "torch.compile" in watch.timings
    watch._on_compile_start()  # after the first step line: no more announcements
    assert sum(m.startswith("torch.compile is compiling") for m in messages) == 1


def test_cpu_default_job_prints_one_line_per_step(default_run):
    """The README's main job as a user runs it, output to a pipe (conftest's shared run)."""
    proc, dump = default_run, default_run.dump
    lines = (proc.stdout + proc.stderr).splitlines()
    assert "\x1b[" not in proc.stdout + proc.stderr  # no colour codes outside a terminal
    messages = [line.split(" - INFO - ", 1)[1] if " - INFO - " in line else line for line in lines]
    steps = [STEP_LINE_RE.match(m) for m in messages if m.startswith("step ")]
    assert len(steps) == 5 and all(steps), "\n".join(lines)
    assert [int(m["step"]) for m in steps] == [1, 2, 3, 4, 5] and {m["total"] for m in steps} == {"5"}
    assert steps[0]["eta"] == "--" and all(m["eta"] != "--" for m in steps[1:])
    assert all(m["mfu"] == "n/a" and m["mem"] == "n/a" and m["dispatch"] for m in steps)
    first = messages.index(next(m for m in messages if m.startswith("step ")))
    header, footer = messages[:first], messages[first + 5:]
    # "still ... (N s so far)" progress lines come only while a phase is slow (a loaded machine)
    header = [m for m in header if not m.startswith("still ")]
    assert len(header) <= 8 and len(footer) <= 2, "\n".join(lines)
    assert header[0].startswith("+ ") and "-m moe_comm.trainer" in header[0]  # the command run (TorchTitan's trainer)
    assert not any("torchtitan version" in m for m in messages)  # every run: for the log file only
    assert any(m.startswith("moe_comm: debug_cpu, backend nccl, 2 x CPU (dp_shard 2, ep 2), 5 steps") for m in header)
    assert any("MFU n/a on CPU" in m and "full log" in m for m in header)
    assert re.match(r"moe_comm: done at step 5/5 in \d+:\d\d; loss [\d.]+ -> [\d.]+; median [\d.]+ s/step", footer[0])
    assert footer[1].startswith("W&B run saved offline. Upload it with: wandb sync ")
    assert not any("WARNING" in line or "Warning" in line or "wandb:" in line for line in lines)

    # the console's loss is TorchTitan's, as written to the JSONL
    import json

    records = [json.loads(l) for l in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [f"{r['loss_metrics/global_avg_loss']:.4f}" for r in records] == [m["loss"] for m in steps]

    # everything else is in the rank's log file, expected warnings explained
    log = (dump / "logs" / "rank0.log").read_text()
    assert "Building deepseek_v3_moe_comm debugmodel" in log  # TorchTitan's model dump
    assert "torchtitan version: 0.2.2" in log
    assert "Failed to use grouped mm" in log and "[expected: no grouped GEMM on CPU" in log
    assert "UserWarning: DTensor random operators" in log
    assert (dump / "logs" / "rank1.log").is_file()
