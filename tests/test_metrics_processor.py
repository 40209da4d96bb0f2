"""The metrics processor on 2 gloo ranks with fake instrumented layers: TorchTitan's metrics plus
ours reach the JSONL and an offline W&B run, the console shows one step line, MFU follows the
peak rules, and `wandb sync` is printed at the end. Every scenario runs in one pair of rank
processes (tests/ranks.py). Then, in this process: how steps between step
lines are counted, and what the footer says."""

import glob
import json
import logging
import math
import os
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ranks
from metrics_fakes import free_port, init_gloo, make_fake
from moe_comm.metrics import build_metrics_processor, instrument, keys


def _job_config(dump_folder: str, extra: list[str]):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(
        [
            "--job.custom_config_module", "moe_comm.config",
            "--job.dump_folder", dump_folder,
            "--metrics.log_freq", "1",
            "--parallelism.expert_parallel_degree", "2",
            "--training.local_batch_size", "2",
            "--training.seq_len", "3",
        ]
        + extra
    )


def _parallel_dims():
    from torchtitan.distributed import ParallelDims

    return ParallelDims(
        dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=2, etp=1, world_size=2
    )


def _scenario(rank, dump_folder, extra, device_name):
    """One processor's life over two steps with two fake instrumented MoE layers."""
    import gc

    from moe_comm.titan import cpu

    name = cpu.CpuDeviceModule.get_device_name
    if device_name:  # what torch.cuda.get_device_name() would say on that GPU
        cpu.CpuDeviceModule.get_device_name = lambda device=None: device_name
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    from torchtitan.tools.logging import logger

    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    layers = []
    try:
        job_config = _job_config(dump_folder, extra)
        processor = build_metrics_processor(job_config, _parallel_dims())
        processor.num_flops_per_token = 1_000_000
        layers = [instrument(make_fake("nvshmem")) for _ in range(2)]
        topk_idx_TK = torch.tensor([[0, 2], [2, 3], [1, 0]])
        for step in (1, 2):
            processor.ntokens_since_last_log += 6  # TorchTitan loads the step's batch first
            processor.data_loading_times.append(0.001)
            x_TD = torch.randn(3, 8, requires_grad=True)
            for layer in layers:
                result = layer.dispatch(x_TD, topk_idx_TK, torch.rand(3, 2))
                x_TD = layer.combine(result.recv_x_RD, result.handle)
            x_TD.sum().backward()
            time.sleep(0.05)  # a step of realistic length, so microseconds of logging don't count
            processor.log(step, 1.0 / step, 1.0 / step, 0.5)
        processor.close()
        return {"log": records, "peak": processor.peak.tflops}
    finally:
        logger.removeHandler(handler)
        cpu.CpuDeviceModule.get_device_name = name
        del layers
        gc.collect()  # this scenario's layers leave the instrumented registry


# W&B as an unconfigured user's: offline, no credentials, no run naming from the environment
WANDB_UNSET = ("WANDB_API_KEY", "WANDB_MODE", "WANDB_RUN_NAME", "WANDB_RUN_GROUP", "WANDB_PROJECT")


def _worker(rank, port, scenarios, results):
    """Every scenario in one pair of processes."""
    from moe_comm.titan import cpu

    for var in WANDB_UNSET:
        os.environ.pop(var, None)
    os.environ["WANDB_SILENT"] = "true"
    cpu.apply()
    init_gloo(rank, 2, port)
    try:
        for name, (dump_folder, extra, device_name) in scenarios.items():
            results[(name, rank)] = _scenario(rank, dump_folder, extra, device_name)
    finally:
        dist.destroy_process_group()


SCENARIOS = {
    "wandb": (["--metrics.enable_wandb", "--moe_comm.backend", "nvshmem", "--moe_comm.num_sms", "24",
               "--moe_comm.peak_tflops", "100"], None),
    "cpu": ([], None),
    "unknown_gpu": ([], "NVIDIA L4"),
    "float8_h200": (["--model.converters", "quantize.linear.float8,quantize.grouped_mm.float8"], "NVIDIA H200"),
}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """{name: (dump folder, {rank: result})} of SCENARIOS, run in one pair of ranks with W&B offline."""
    tmp = tmp_path_factory.mktemp("processor")
    cwd = os.getcwd()
    os.chdir(tmp)  # the ranks start where their parent is
    try:
        plan = {name: (str(tmp / name), extra, device) for name, (extra, device) in SCENARIOS.items()}
        results = mp.Manager().dict()
        ranks.spawn(_worker, args=(free_port(), plan, results), nprocs=2)
        results = dict(results)
    finally:
        os.chdir(cwd)
    return {name: (plan[name][0], {r: results[(name, r)] for r in (0, 1)}) for name in SCENARIOS}


def test_jsonl_wandb_console(scenarios):
    dump, results = scenarios["wandb"]
    lines = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))]
    assert [line["step"] for line in lines] == [1, 2]  # rank 0 only, one object per step
    last = lines[-1]
    for key in (keys.TPS, keys.MFU, keys.MEM_RESERVED, keys.LOSS) + (
        keys.DISPATCH_MS, keys.COMBINE_MS, keys.DISPATCH_BWD_MS, keys.COMM_EXPOSED_PCT,
        keys.STEP_MS, keys.IMBALANCE_RANK, keys.IMBALANCE_EXPERT, keys.SENT_GB, keys.COMM_BW,
    ):
        assert isinstance(last[key], (int, float)), key
    assert last[keys.BACKEND] == "nvshmem"
    assert last[keys.BACKEND_OPTIONS]["num_sms"] == 24
    assert last[keys.SENDS_PER] == "rank"
    assert last[keys.PEAK_TFLOPS] == 100.0
    # MFU = flops/token * tokens/s / peak, with TorchTitan's tokens/s
    assert last[keys.MFU] == pytest.approx(100 * 1e6 * last[keys.TPS] / 100e12, rel=1e-9)
    assert 0 < last[keys.COMM_EXPOSED_PCT] < 100
    # both ranks send 2 dedup rows per layer: 2 layers x 4 passes x 2 rows x 8 x fp32
    assert last[keys.SENT_GB] == pytest.approx(2 * 4 * 2 * 8 * 4 / 1e9)
    # global routing [2,1,2,1] on both ranks: experts 4/3 per layer... max 4 / mean 3
    assert last[keys.IMBALANCE_EXPERT] == pytest.approx(4 / 3)

    log0 = results[0]["log"]
    step_lines = [m for m in log0 if m.startswith("step ")]
    assert len(step_lines) == 2, log0  # one console line per step: TorchTitan's and ours in one
    assert re.match(r"step +2/10000  ", step_lines[1]) and "loss 0.5000" in step_lines[1]
    assert "dispatch " in step_lines[1] and "% of step)" in step_lines[1]
    assert "mfu " in step_lines[1] and "of 100 TFLOPS bf16" in step_lines[1]
    sync_lines = [m for m in log0 if "wandb sync" in m]
    assert len(sync_lines) == 1
    run_dir = sync_lines[0].split("wandb sync ")[1].strip()
    assert os.path.basename(run_dir).startswith("offline-run-")
    assert glob.glob(os.path.join(run_dir, "run-*.wandb"))
    assert not any("wandb sync" in m for m in results[1]["log"])  # one run, from rank 0

    # The offline run file holds protobuf records (wandb 0.31 ships no reader for it): its
    # history keys, run name, group and config values are stored as plain strings, so a
    # small run (under the 32 KiB record block) can be checked by searching its bytes.
    run_bytes = open(glob.glob(os.path.join(run_dir, "run-*.wandb"))[0], "rb").read()
    for needle in (keys.COMM_EXPOSED_PCT, keys.DISPATCH_MS, keys.IMBALANCE_RANK, keys.MFU,
                   "nvshmem-sm24", "default_job", "recv_capacity_factor", "ep2"):
        assert needle.encode() in run_bytes, needle


def test_cpu_gives_nan_mfu_and_says_so_once(scenarios):
    dump, results = scenarios["cpu"]
    last = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))][-1]
    assert last[keys.MFU] is None  # NaN is written as null
    assert last[keys.TFLOPS] > 0
    assert math.isnan(results[0]["peak"])
    log0 = results[0]["log"]
    # no CPU has a peak: the header says so once, instead of a warning
    assert not any("No dense bf16 peak known" in m for m in log0)
    assert any("MFU n/a on CPU" in m for m in log0)
    assert all("mfu n/a" in m for m in log0 if m.startswith("step "))


def test_unknown_gpu_warns_and_names_the_override(scenarios):
    dump, results = scenarios["unknown_gpu"]
    log0 = results[0]["log"]
    assert any("No dense bf16 peak known for GPU 'NVIDIA L4'" in m and "peak_tflops" in m for m in log0)
    assert any("MFU n/a: no peak known for 'NVIDIA L4'" in m for m in log0)


def test_float8_on_h200_divides_by_the_8bit_peak(scenarios):
    dump, results = scenarios["float8_h200"]
    last = [json.loads(line) for line in open(os.path.join(dump, "metrics.jsonl"))][-1]
    assert last[keys.PEAK_DTYPE] == "fp8" and last[keys.PEAK_TFLOPS] == 1979.0
    assert last[keys.MFU] == pytest.approx(100 * 1e6 * last[keys.TPS] / 1979e12, rel=1e-9)
    # the bf16-peak figure is TorchTitan's MFU rescaled: the same tokens/s, however loaded the machine
    assert last[keys.MFU_BF16] == pytest.approx(last[keys.MFU] * 1979 / 989, rel=1e-12)
    log0 = results[0]["log"]
    assert any("lower bound" in m and "Compare bf16 and 8-bit runs by tokens/s" in m for m in log0)
    step_lines = [m for m in log0 if m.startswith("step ")]
    assert step_lines and all("of 1979 TFLOPS fp8" in m for m in step_lines)  # one MFU, named
    assert any("MFU against 1979 TFLOPS dense fp8" in m and keys.MFU_BF16 in m for m in log0)


# ---- in one process: how steps are counted and what the footer says ---------------------------

def _processor(tmp_path, caplog, *extra: str):
    """The processor as TorchTitan builds it, on one rank without a process group."""
    import moe_comm.titan  # noqa: F401  the CPU adaptations
    from torchtitan.distributed import ParallelDims

    caplog.set_level(logging.INFO)
    job_config = _job_config(str(tmp_path / "dump"), ["--metrics.no-enable_wandb", *extra])
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    processor = build_metrics_processor(job_config, dims)
    processor.num_flops_per_token = 1_000_000
    return processor


def _train_step(processor, seconds: float) -> None:
    """What TorchTitan's loop does to the processor in one step: load a batch, then compute."""
    processor.ntokens_since_last_log += 6
    processor.data_loading_times.append(0.0)
    time.sleep(seconds)


def _console(caplog) -> list[str]:
    from moe_comm import console

    return [r.getMessage() for r in caplog.records if getattr(r, console.CONSOLE, False)]


def test_the_first_step_after_a_resume_is_timed_as_one_step(tmp_path, caplog):
    """Resumed at step 10: the first line is step 11, one step of this process. It used to be
    divided by 11 (0.35-0.50 s/step against 5.5 s real; dispatch 7 ms against ~100 ms), and it
    included the model set-up and checkpoint load."""
    processor = _processor(tmp_path, caplog, "--training.steps", "20", "--metrics.log_freq", "2")
    time.sleep(0.4)  # set-up and checkpoint load: not a training step
    _train_step(processor, 0.2)
    processor.log(11, 2.0, 2.0, 0.5)
    _train_step(processor, 0.2)
    _train_step(processor, 0.2)
    processor.log(13, 1.9, 1.9, 0.5)  # two steps since the last line
    rows = [json.loads(line) for line in open(tmp_path / "dump" / "metrics.jsonl")]
    first, second = (row[keys.STEP_MS] for row in rows)
    assert 180 < first < 350 and 180 < second < 350, (first, second)
    lines = [m for m in _console(caplog) if m.startswith("step ")]
    assert re.match(r"step 11/20  0\.[23]\d s/step", lines[0]), lines[0]
    processor.close()
    assert _console(caplog)[-1].startswith("moe_comm: stopped early at step 13/20")


def test_a_step_is_timed_from_one_log_call_to_the_next(tmp_path, caplog, monkeypatch):
    """The step line's time is the wall time between steps, the log call's own work included (a
    slow MoE summary, say): timed from the previous call's end it left that out (0.364 against
    0.375 s in the one-GPU recipe, run 44)."""
    from moe_comm.metrics import processor as processor_module

    processor = _processor(tmp_path, caplog, "--training.steps", "20")
    real = processor_module.summarize

    def slow_summary(*args, **kwargs):
        time.sleep(0.15)
        return real(*args, **kwargs)

    monkeypatch.setattr(processor_module, "summarize", slow_summary)
    for step in (1, 2, 3):
        _train_step(processor, 0.1)
        processor.log(step, 2.0, 2.0, 0.5)
    rows = [json.loads(line) for line in open(tmp_path / "dump" / "metrics.jsonl")]
    later = [row[keys.STEP_MS] for row in rows[1:]]
    assert all(240 < ms < 400 for ms in later), later  # 100 ms of step + 150 of the previous log call
    processor.close()


def test_a_finished_run_says_done(tmp_path, caplog):
    processor = _processor(tmp_path, caplog, "--training.steps", "2", "--metrics.log_freq", "1")
    for step in (1, 2):
        _train_step(processor, 0.01)
        processor.log(step, 1.0, 1.0, 0.5)
    processor.close()
    assert re.match(r"moe_comm: done at step 2/2 in 0:0\d; loss 1\.0000 -> 1\.0000", _console(caplog)[-1])


def test_a_failed_run_says_it_failed_and_where(tmp_path, caplog):
    """TorchTitan closes the trainer on its way out of an exception too; the footer used to say
    `done at step 2/60` for a run that hung in step 3."""
    processor = _processor(tmp_path, caplog, "--training.steps", "60", "--metrics.log_freq", "1")
    for step in (1, 2):
        _train_step(processor, 0.01)
        processor.log(step, 1.0, 1.0, 0.5)
    _train_step(processor, 0.01)  # step 3 loads its batch, then a collective times out
    try:
        raise RuntimeError("[Gloo] Timed out waiting 10000ms for recv operation to complete")
    except RuntimeError:
        processor.close()
    footer = _console(caplog)[-1]
    assert footer.startswith("moe_comm: FAILED in step 3/60 after 0:0") and "done" not in footer, footer
    assert "RuntimeError: [Gloo] Timed out waiting 10000ms" in footer and str(tmp_path / "dump" / "logs") in footer


def test_a_run_that_fails_before_its_first_step_line_says_so(tmp_path, caplog):
    processor = _processor(tmp_path, caplog)
    try:
        raise ValueError("bad shard")
    except ValueError:
        processor.close()
    assert _console(caplog)[-1].startswith("moe_comm: FAILED before its first step line (set-up, checkpoint load")
