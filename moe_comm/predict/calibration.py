"""The scale model's measured constants, fitted at run time from the measured inputs in
results/model_inputs (its MANIFEST.json says what each file measured, where, with which kernels).

Every constant is recorded with its source as an `Assumption` (results/scale_model.md lists
them). The fits, and which measured figures they use (the validation table marks those rows
"calibration"; every other figure is held out):
  * our kernels (comm bench, nvshmem rows at CALIBRATION_SMS, random and balanced routing):
    transport = floor + per-token-per-SM cost x tokens / SMs + bytes / (efficiency x P2P), by
    least squares; the layout kernels = floor + cost per expert row + cost per slot; the floor
    from the decode shape's CUDA-graph round trip;
  * DeepEP v1.2.1: its fixed cost from its one intranode figure on the same machine
    (moe_comm.predict.assumptions, deepep_us),
    with our kernels' link efficiency;
  * the nccl path: a per-call cost and a per-row cost from its DSV3 and decode round trips; its
    backward per-row cost from a training pair's profiles (nccl vs nvshmem, batch 2 x 4096);
  * compute: every GEMM, attention and memory-bound time comes from the one-GPU layer
    benchmark (moe_comm.predict.layer_compute.BENCH), which must be
    there; only the GPU's idle share comes from a profile (TorchTitan's step-10 profile of the
    671B-shaped layers on 2xH200), as the benchmark times parts, not the gaps between them;
  * nothing is fitted to a public anchor (issue 24): the anchors are read only for the
    validation table. No B200 was measured here, so B200 (and H100) parts run at the H200's
    measured share of their own peak, an assumption listed with the others.
"""

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from moe_comm.backends.nccl import NcclBackend
from moe_comm.backends.nvshmem import NvshmemBackend
from moe_comm.predict import layer_compute
from moe_comm.predict.assumptions import MODEL_INPUTS, READ, REPO, Assumption
from moe_comm.predict.routing_plan import routing_statistics, row_bytes

COMM_BENCH = "comm_bench_h200x2.json"
# The comm bench's rows (experiments/bench_comm.py) carry the backend that ran them: those of our
# kernels' backend calibrate the kernels, those of TorchTitan's all-to-all path that path.
OUR_KERNELS_ROWS, ALL_TO_ALL_ROWS = NvshmemBackend.name, NcclBackend.name
# The SM counts whose comm-bench rows calibrate the kernels' costs; the others are held out.
CALIBRATION_SMS = (20, 64)
# The profiled training run that calibrates the GPU's idle share (current kernels), by sweep and run name.
CALIBRATION_RUN = ("split_kernels", "deepseek_v3_671b_layers_h200x2-nvshmem-b4-s4096")
BENCH_TOKENS, BENCH_TOP_K, BENCH_EXPERTS, BENCH_HIDDEN = 4096, 8, 256, 7168


@dataclass
class OpCost:
    """A communication kernel: floor + per_token_sm x tokens / SMs + bytes / (efficiency x link)."""

    link_efficiency: float
    per_token_sm_us: float


@dataclass
class Calibration:
    p2p_gbps: float  # measured H200 P2P ceiling, both directions busy
    nvlink_copy_efficiency: float  # that ceiling over the datasheet NVLink rate
    kernel_floor_us: float
    ops: dict  # "dispatch" / "combine" -> OpCost, our kernels
    deepep_ops: dict  # the same for DeepEP v1.2.1
    expand: tuple  # (us per expert row, us per slot), H200, hidden 7168 bf16
    reduce: tuple
    layout_hbm_efficiency: float
    nccl_call_us: float  # nccl path: per forward round trip (host syncs, counts exchange)
    nccl_row_us: float  # nccl path: per expert row per forward round trip (permute, unpermute)
    nccl_backward_row_us: float  # the same in the backward pass
    idle_ratio: float  # GPU idle / busy
    # the measured layer parts (layer_compute.BENCH): every GEMM, attention and
    # memory-bound time of the step model (None only in hand-made calibrations of the tests)
    layer_bench: layer_compute.LayerBench | None = None
    assumptions: list = field(default_factory=list)


def _one(bench: dict, **match) -> dict:
    rows = [r for r in bench["rows"] if all(r.get(k) == v for k, v in match.items()) and "error" not in r]
    if len(rows) != 1:
        raise ValueError(f"comm_bench.json: expected one row for {match}, found {len(rows)}")
    return rows[0]


def _least_squares_2(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Coefficients (b, c) of y = b x1 + c x2 minimising the squared error."""
    s11 = sum(x1 * x1 for x1, _, _ in points)
    s22 = sum(x2 * x2 for _, x2, _ in points)
    s12 = sum(x1 * x2 for x1, x2, _ in points)
    s1y = sum(x1 * y for x1, _, y in points)
    s2y = sum(x2 * y for _, x2, y in points)
    det = s11 * s22 - s12 * s12
    return (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det


def _profile_file(sweep: str, run_name: str) -> str:
    """A 2xH200 training run's step-10 profile summary (experiments/profile_summary.py)."""
    return f"profile_h200x2_{sweep}_{run_name}.json"


def _profile(inputs: Path, sweep: str, run_name: str) -> dict:
    return json.loads((inputs / _profile_file(sweep, run_name)).read_text())


def _other_ms(profile: dict) -> float:
    return profile["kernel_time_share"]["other_kernels"] * profile["span_ms"]


def _slots(routing: str, tokens: int = BENCH_TOKENS) -> float:
    """Receive slots of one rank of the bench's 2-rank layout (its own tokens included)."""
    return routing_statistics(routing, 2, 2, BENCH_EXPERTS, BENCH_TOP_K, tokens=tokens).mean["recv_slots"] * tokens


def _fit_kernels(bench: dict, p2p: float) -> tuple[dict, dict, float]:
    """Our kernels' costs: (ops, layout, floor). The floor and the linear terms depend on each
    other, so the fits alternate until they settle."""
    T, K = BENCH_TOKENS, BENCH_TOP_K
    rb = row_bytes(BENCH_HIDDEN)
    dec = _one(bench, backend=OUR_KERNELS_ROWS, shape="decode_random", num_sms=CALIBRATION_SMS[0])
    floor, ops, layout = 0.0, {}, {}
    for _ in range(4):
        for kernel in ("expand", "reduce"):
            t = {shape: sum(_one(bench, backend=OUR_KERNELS_ROWS, shape=f"dsv3_{shape}", num_sms=s)["kernel_us"][f"{kernel}_kernel"]
                            for s in CALIBRATION_SMS) / len(CALIBRATION_SMS) - floor
                 for shape in ("random", "balanced")}
            per_slot = (t["random"] - t["balanced"]) / (_slots("random") - _slots("balanced"))
            layout[kernel] = ((t["balanced"] - per_slot * _slots("balanced")) / (T * K), per_slot)
        for op in ("dispatch", "combine"):
            pts = []
            for sms in CALIBRATION_SMS:
                for shape in ("dsv3_random", "dsv3_balanced"):
                    r = _one(bench, backend=OUR_KERNELS_ROWS, shape=shape, num_sms=sms)
                    pts.append((T / sms, r["link_rows_per_rank"] * rb / 1e3, r[f"transport_{op}_us"] - floor))
            per_token_sm, us_per_kb = _least_squares_2(pts)
            ops[op] = OpCost(min(1.0, 1 / (us_per_kb * p2p)), per_token_sm)
        tokens, rows = dec["tokens"], dec["link_rows_per_rank"]
        work = sum(ops[op].per_token_sm_us * tokens / CALIBRATION_SMS[0]
                   + rows * rb / (ops[op].link_efficiency * p2p * 1e3) for op in ops)
        work += sum(layout[k][0] * tokens * K + layout[k][1] * _slots("random", tokens) for k in layout)
        floor = (dec["round_trip_graph_us"] - work) / 4
    return ops, layout, floor


def _fit_nccl_forward(bench: dict) -> tuple[float, float]:
    """The nccl path's round trip = call + rows x per-row + 2 x crossing bytes at NCCL's rate."""
    rate = READ["nccl_nvlink_gbps_h200"].value
    pts = []
    for shape in ("dsv3_random", "decode_random"):
        r = _one(bench, backend=ALL_TO_ALL_ROWS, shape=shape)
        pts.append((r["tokens"] * r["top_k"], r["round_trip_us"] - 2 * r["link_bytes_per_rank"] / (rate * 1e3)))
    (x1, y1), (x2, y2) = pts
    per_row = (y1 - y2) / (x1 - x2)
    return y1 - per_row * x1, per_row


def _flavor(name: str):
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    from moe_comm.layout import flavors

    flavors.register()
    return deepseekv3_args[name]


@lru_cache(maxsize=4)
def calibrate(inputs: Path = MODEL_INPUTS) -> Calibration:
    """Fit the model's measured constants from the measured inputs."""
    A: list[Assumption] = list(READ.values())
    rel = inputs.relative_to(REPO) if inputs.is_relative_to(REPO) else inputs
    bench_src = f"{rel}/{COMM_BENCH}"
    bench = json.loads((inputs / COMM_BENCH).read_text())
    hbm = READ["hbm_tbs.H200"].value * 1e12

    p2p = bench["p2p"]["p2p_both_ways_per_direction_gbps"]
    copy_eff = p2p / READ["nvlink_gbps.H200"].value
    A.append(Assumption("H200 P2P ceiling, both directions busy", p2p, "GB/s", f"{bench_src} p2p"))
    A.append(Assumption("achievable share of NVLink's datasheet rate", copy_eff, "", "P2P ceiling / 450 GB/s"))

    ops, layout, floor = _fit_kernels(bench, p2p)
    for op in ("dispatch", "combine"):
        A.append(Assumption(f"our {op} kernel: link efficiency (at most 1)", ops[op].link_efficiency, "of P2P",
                            f"{bench_src}: nvshmem transport, dsv3 random + balanced at {CALIBRATION_SMS} SMs, "
                            "least squares with the next line"))
        A.append(Assumption(f"our {op} kernel: fixed cost per token per SM", ops[op].per_token_sm_us, "us x SM",
                            f"{bench_src}: the same fit"))
    A.append(Assumption("per-kernel floor (launch, grid syncs, flag latency)", floor, "us",
                        f"{bench_src}: decode_random graph round trip at {CALIBRATION_SMS[0]} SMs less its work, / 4"))
    for kernel in ("expand", "reduce"):
        A.append(Assumption(f"{kernel} kernel per expert row (H200, 7168 bf16)", layout[kernel][0],
                            f"us, + {layout[kernel][1]:.5f} us per slot", f"{bench_src}: nvshmem dsv3 random vs balanced"))
    rnd = _one(bench, backend=OUR_KERNELS_ROWS, shape="dsv3_random", num_sms=CALIBRATION_SMS[0])
    expand_bytes = (BENCH_TOKENS * BENCH_TOP_K + _slots("random")) * BENCH_HIDDEN * 2
    layout_eff = expand_bytes / (rnd["kernel_us"]["expand_kernel"] * 1e-6) / hbm
    A.append(Assumption("share of HBM bandwidth the layout kernels reach (the optimizer step too)", layout_eff, "",
                        f"{bench_src}: expand's expert rows written + slots read, per second, / 4.8 TB/s"))

    ref = {op: READ[f"deepep_us.{op}"].value for op in ("dispatch", "combine")}
    deepep_sms = 24
    deepep_rows = _one(bench, backend=OUR_KERNELS_ROWS, shape="dsv3_random", num_sms=deepep_sms)["link_rows_per_rank"]
    deepep_ops = {}
    for op in ("dispatch", "combine"):
        link = deepep_rows * row_bytes(BENCH_HIDDEN) / (ops[op].link_efficiency * p2p * 1e3)
        deepep_ops[op] = OpCost(ops[op].link_efficiency, (ref[op] - floor - link) * deepep_sms / BENCH_TOKENS)
        A.append(Assumption(f"DeepEP {op}: fixed cost per token per SM (our link efficiency assumed)",
                            deepep_ops[op].per_token_sm_us, "us x SM",
                            f"read figure deepep_us.{op} ({ref[op]:.0f} us at 24 SMs; {READ[f'deepep_us.{op}'].source}), "
                            f"with {bench_src}"))

    nccl_call, nccl_row = _fit_nccl_forward(bench)
    A.append(Assumption("nccl path: per forward round trip (counts exchange, host syncs, launches)", nccl_call, "us",
                        f"{bench_src}: nccl dsv3_random and decode_random round trips"))
    A.append(Assumption("nccl path: per expert row per forward round trip (permute, unpermute)", nccl_row, "us",
                        f"{bench_src}: the same fit"))
    A.append(Assumption("TorchTitan's DeepEP path: host sync per forward dispatch (CPU-side counts, "
                        "torchtitan/distributed/deepep/deepep.py)",
                        nccl_call, "us", "assumed equal to the nccl path's per-call cost (not measured)"))

    # the GPU's idle share, from the 671B-shaped layers' step-10 profile (the layer benchmark
    # times each part between CUDA events, not the launch gaps and host waits between them)
    a = _flavor("671B_layers")
    prof = _profile(inputs, *CALIBRATION_RUN)
    prof_src = f"{rel}/{_profile_file(*CALIBRATION_RUN)}"
    moe_layers = a.n_layers - a.n_dense_layers
    idle_ratio = prof["gpu_idle_share"] / prof["gpu_busy_share"]
    A.append(Assumption("GPU idle per busy second (launch gaps, host work)", idle_ratio, "", f"{prof_src}"))

    # the nccl path's backward: at 2 x 4096 (no memory pressure) the nccl run's other kernels
    # exceed the nvshmem run's (fused kernels, whose layout is inside the comm kernels) by the
    # permutes of forward and backward
    extra_ms = (_other_ms(_profile(inputs, "mfu_sweep", "deepseek_v3_671b_layers_h200x2-nccl-b2-s4096"))
                - _other_ms(_profile(inputs, "mfu_sweep", "deepseek_v3_671b_layers_h200x2-nvshmem-b2-s4096")))
    nccl_bwd_row = extra_ms * 1e3 / (moe_layers * 8192 * a.moe_args.top_k) - nccl_row
    A.append(Assumption("nccl path: per expert row per backward round trip", nccl_bwd_row, "us",
                        f"{rel}/{_profile_file('mfu_sweep', '*-{nccl,nvshmem}-b2-s4096')}: other-kernel time "
                        "difference less the forward permutes"))
    if not layer_compute.BENCH.is_file():
        raise FileNotFoundError(f"{layer_compute.BENCH}: the layer benchmark the step model prices compute from is "
                                "missing; run experiments/layer_bench.py run on one GPU (see its entry in "
                                "results/model_inputs/MANIFEST.json)")
    bench = layer_compute.load()
    A += layer_compute.assumptions(bench)
    cal = Calibration(
        layer_bench=bench, p2p_gbps=p2p, nvlink_copy_efficiency=copy_eff, kernel_floor_us=floor, ops=ops, deepep_ops=deepep_ops,
        expand=layout["expand"], reduce=layout["reduce"], layout_hbm_efficiency=layout_eff,
        nccl_call_us=nccl_call, nccl_row_us=nccl_row, nccl_backward_row_us=nccl_bwd_row, idle_ratio=idle_ratio,
        assumptions=A,
    )
    return cal
