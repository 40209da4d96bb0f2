"""What `train` prints when a run is stopped or a rank dies (moe_comm.launch with moe_comm.relay),
against a stand-in torchrun that writes what torchrun 2.x writes to stderr in those cases.

Before: Ctrl-C printed torchrun's shutdown warnings, a KeyboardInterrupt traceback per shown
rank and torchrun's own SignalException traceback before `moe_comm: stopped by SIGINT`; kill -9
of rank 0 printed torchrun's 100-line report (the other rank's gloo "Connection reset by peer"
traceback) and no moe_comm footer, since the shown rank was dead."""

import os
import signal
import sys
import textwrap
import threading
import time

from moe_comm import launch

# Stands in for torchrun: on SIGINT it says what torchrun says while stopping its workers;
# with "killed" it reports rank 0 killed and rank 1's gloo error, as torchrun's ChildFailedError.
FAKE_TORCHRUN = textwrap.dedent('''
    import signal, sys, time
    def stop(signum, frame):
        err = sys.stderr
        err.write("W1202 03:17:52 12741 torch/distributed/elastic/agent/server/api.py:753] Received 2 death signal, shutting down workers\\n")
        err.write("[rank0]: Traceback (most recent call last):\\n[rank0]:   File \\"train.py\\", line 1\\n[rank0]: KeyboardInterrupt\\n")
        err.write("Traceback (most recent call last):\\n  File \\"run.py\\", line 1\\n")
        err.write("torch.distributed.elastic.multiprocessing.api.SignalException: Process 1 got signal: 2\\n")
        sys.exit(1)
    signal.signal(signal.SIGINT, stop)
    if sys.argv[1] == "killed":
        err = sys.stderr
        err.write("E1202 03:19:14 12949 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 0 (pid: 12956)\\n")
        err.write("Traceback (most recent call last):\\n  File \\"run.py\\", line 1032\\n")
        err.write("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \\n" + "=" * 60 + "\\n")
        err.write("torchtitan.train FAILED\\n" + "-" * 60 + "\\nFailures:\\n[1]:\\n  rank      : 1 (local_rank: 1)\\n")
        err.write("  traceback : Traceback (most recent call last):\\n" + "    File \\"x.py\\", line 1\\n" * 90)
        err.write("  RuntimeError: [pair.cc:537] Read error [127.0.0.1]:54155: Connection reset by peer\\n")
        err.write("-" * 60 + "\\nRoot Cause (first observed failure):\\n[0]:\\n  time      : 2026-12-02_03:19:14\\n")
        err.write("  rank      : 0 (local_rank: 0)\\n  exitcode  : -9 (pid: 12956)  (SIGKILL)\\n  error_file: <N/A>\\n")
        err.write("  traceback : Signal 9 (SIGKILL) received by PID 12956\\n" + "=" * 60 + "\\n")
        sys.exit(1)
    print("ready", flush=True)
    time.sleep(60)
''')


def _run(tmp_path, mode: str, **kwargs) -> int:
    script = tmp_path / "fake_torchrun.py"
    script.write_text(FAKE_TORCHRUN)
    beats = tmp_path / "beats"
    beats.mkdir(exist_ok=True)
    return launch.run_torchrun([sys.executable, str(script), mode], dict(os.environ), beats,
                               logs=tmp_path / "logs", **kwargs)


def test_ctrl_c_prints_one_line(tmp_path, capfd):
    timer = threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGINT))  # Ctrl-C reaches the launcher
    timer.start()
    try:
        rc = _run(tmp_path, "wait")
    finally:
        timer.cancel()
    out, err = capfd.readouterr()
    assert rc == 128 + signal.SIGINT
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"moe_comm: stopped by SIGINT; torchrun and every rank have exited; logs in {tmp_path / 'logs'}"]
    log = next((tmp_path / "logs").glob("torchrun-*.log")).read_text()
    assert "KeyboardInterrupt" in log and "SignalException" in log and "Received 2 death signal" in log


def test_a_killed_rank_gives_a_summary_and_another_ranks_footer(tmp_path, capfd):
    """Rank 0 (the one shown) killed: no report on the console, one line naming the first failure
    and the file, and rank 1's footer from its log."""
    logs = tmp_path / "logs"
    logs.mkdir()
    started = "===== moe_comm: run started 2026-12-02 03:18:00 =====\n"
    (logs / "rank0.log").write_text(started + "[titan] 2026 - root - INFO - step 2/1000 ...\n")
    footer = ("moe_comm: FAILED in step 3/1000 after 0:40: RuntimeError: [pair.cc:537] Read error: Connection "
              "reset by peer; loss 8.1566 -> 6.5620; the rank logs are in /tmp/x/logs")
    (logs / "rank1.log").write_text("moe_comm: done at step 9/9 in 0:05 (an earlier run)\n" + started
                                    + f"[titan] 2026 - root - INFO - {footer}\n")
    os.utime(logs / "rank1.log", (time.time() + 5, time.time() + 5))
    rc = _run(tmp_path, "killed", shown={0})
    out, err = capfd.readouterr()
    assert rc == 1
    assert "Traceback" not in err and "Connection reset by peer" not in err.split(footer)[0], err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith("E1202 03:19:14") and "failed (exitcode: -9) local_rank: 0" in lines[0]
    assert lines[1].startswith(f"moe_comm: torchrun's failure report (") and str(logs) in lines[1]
    assert lines[1].endswith("the first failure it saw: rank 0, exitcode -9 (pid: 12956)  (SIGKILL): "
                             "Signal 9 (SIGKILL) received by PID 12956")
    assert lines[2] == f"{footer} (rank 1's footer: the rank shown here printed none)"
    assert len(lines) == 3
    assert "Connection reset by peer" in next(logs.glob("torchrun-*.log")).read_text()
