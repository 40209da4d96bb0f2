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
  * host synchronisations (experiments/host_syncs.py, one H200): per backend and per dispatch,
    combine and their backwards, how many and what the GPU loses to each call that makes them
    (`HostSync`); a backend whose case was not measured keeps its class's stated count at the
    all-to-all path's per-call cost;
  * the busiest EP rank's routed load over the mean (experiments/routing_imbalance.py, from a
    training run's per-expert counts): its median and p90 per EP degree (`Imbalance`);
  * nothing is fitted to a public anchor (issue 24): the anchors are read only for the
    validation table. No B200 was measured here, so B200 (and H100) parts run at the H200's
    measured share of their own peak, an assumption listed with the others.

The inputs no measurement here fixes carry a range (`Calibration.inputs`, one `Inputs` per
scenario of assumptions.SCENARIOS): the network's achieved share of line rate and the B200's
share of peak (read figures, assumptions.READ), the busiest-rank factor (the measured median,
and its p90 against the drawn routing's own), the GPU's idle share (the profiles' range) and the
host synchronisations' cost (each measured call's bounds).
"""

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from moe_comm.backends import backend_class, names
from moe_comm.backends.nccl import NcclBackend
from moe_comm.backends.nvshmem import NvshmemBackend
from moe_comm.predict import layer_compute
from moe_comm.predict.assumptions import MODEL_INPUTS, READ, REPO, SCENARIOS, Assumption, Inputs
from moe_comm.predict.routing_plan import routing_statistics, row_bytes

COMM_BENCH = "comm_bench_h200x2.json"
# The comm bench's rows (experiments/bench_comm.py) carry the backend that ran them: those of our
# kernels' backend calibrate the kernels, those of TorchTitan's all-to-all path that path.
OUR_KERNELS_ROWS, ALL_TO_ALL_ROWS = NvshmemBackend.name, NcclBackend.name
# The SM counts whose comm-bench rows calibrate the kernels' costs; the others are held out.
CALIBRATION_SMS = (20, 64)
# The profiled training run that calibrates the GPU's idle share (current kernels), by sweep and run name.
CALIBRATION_RUN = ("split_kernels", "deepseek_v3_671b_layers_h200x2-nvshmem-b4-s4096")
# The profile that gives the idle share of one GPU (world 1) whose batch a dataloader worker loads:
# the one-GPU recipe's step over six profiled steps (run 50), GPU-bound since the worker (run 46).
ONE_GPU_IDLE_PROFILE = "profile_h200x1_host_profile_deepseek_v3_671b_h200x1-nvshmem-bf16-run50.json"
# The measured inputs found by their schema (experiments/host_syncs.py, experiments/routing_imbalance.py).
HOST_SYNCS_SCHEMA, IMBALANCE_SCHEMA = "host_syncs/1", "routing_imbalance/1"
# experiments/host_syncs.py's phases, by the transfer of moe_comm.predict.scale_model they are.
HOST_SYNC_PHASES = {"dispatch": "dispatch.fwd", "combine": "combine.fwd", "combine backward": "combine.bwd",
                    "dispatch backward": "dispatch.bwd"}
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
    # GPU idle / busy of one GPU with a dataloader worker (ONE_GPU_IDLE_PROFILE; None: the central
    # idle_ratio stands there too)
    one_gpu_idle_ratio: float | None = None
    # the measured layer parts (layer_compute.BENCH): every GEMM, attention and
    # memory-bound time of the step model (None only in hand-made calibrations of the tests)
    layer_bench: layer_compute.LayerBench | None = None
    assumptions: list = field(default_factory=list)
    # host synchronisations by experiments/host_syncs.py case, then transfer name
    host_syncs: dict = field(default_factory=dict)
    imbalance: "Imbalance | None" = None
    # the unmeasured inputs at each scenario (assumptions.SCENARIOS); empty: the central values
    # the fields above and assumptions.READ give
    inputs: dict = field(default_factory=dict)

    def scenario(self, name: str = "central") -> Inputs:
        """The inputs a prediction is made at: "low", "central" or "high" (assumptions.Inputs)."""
        if name in self.inputs:
            return self.inputs[name]
        if name != "central":
            raise ValueError(f"scenario {name!r}: this calibration has {sorted(self.inputs) or ['central']}")
        return Inputs(READ["network_efficiency"].value, 1.0, "median", self.idle_ratio, "central")


@dataclass(frozen=True)
class HostSync:
    """One call's host synchronisations (a dispatch, a combine or one of their backwards) as
    measured: how many, and the GPU time lost to the call's host work because of them, by end of
    its range - low: one kernel launch per synchronisation (the GPU waits at least for the next
    launch); central: the call's host time less its waits (once it has synchronised, everything
    its host does is time the GPU sits idle: the queue is empty); high: the call's whole host
    time."""

    count: float
    cost_us: dict  # "low" / "central" / "high" -> us per call


@dataclass(frozen=True)
class Imbalance:
    """The busiest EP rank's routed rows over the mean rank's, measured per EP degree
    (experiments/routing_imbalance.py): {ep: {"median": x, "p90": y, ...}}, and its file."""

    by_ep: dict
    source: str
    experts: int = 0  # the routed experts of the measured run's model
    collapsed: str = ""  # why the measured routing is not the workloads' (then it is the pessimistic end)

    def factor(self, ep: int, which: str) -> float:
        """At an EP degree: the figure of the smallest measured EP at or above it (an upper bound:
        fewer ranks each average more experts), else of the largest measured (a lower bound: max /
        mean cannot fall when every rank's experts split); 1 at EP 1."""
        if ep <= 1:
            return 1.0
        eps = sorted(self.by_ep)
        at = next((e for e in eps if e >= ep), eps[-1])
        return self.by_ep[at][which]


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
    one_gpu = json.loads((inputs / ONE_GPU_IDLE_PROFILE).read_text())
    one_gpu_idle = one_gpu["gpu_idle_share"] / one_gpu["gpu_busy_share"]
    A.append(Assumption("GPU idle per busy second, one GPU with a dataloader worker (central there)", one_gpu_idle, "",
                        f"{rel}/{ONE_GPU_IDLE_PROFILE}: the one-GPU recipe's step, GPU-bound since the batch loads "
                        "in a worker; without one the step waits for each batch on its thread, which that "
                        "profile did not measure, and the central share above stands"))
    idle_lo, idle_hi, idle_files = _idle_range(inputs)
    A.append(Assumption("GPU idle per busy second of compute, its range", idle_ratio, "",
                        f"{prof_src} (central)", low=idle_lo, high=idle_hi,
                        range_source="the lowest and highest of the step profiles in " + ", ".join(
                            f"{rel}/{f}" for f in idle_files)))
    host_syncs, host_assumptions = _host_syncs(inputs, rel, floor)
    A += host_assumptions
    for name in names():  # the host-driven backends whose case was not measured: their stated count
        costs = backend_class(name).costs
        if costs and costs.transport != "NCCL" and costs.host_syncs_per_dispatch and \
                costs.host_syncs_case not in host_syncs:
            n = costs.host_syncs_per_dispatch
            A.append(Assumption(
                f"host synchronisations of {name} ({costs.host_syncs_case} not measured): a forward dispatch's, as "
                "a host-driven call of the all-to-all path costs in all", nccl_call, "us",
                f"{n} per forward dispatch as its code makes them ({backend_class(name).__name__}'s CostTraits); "
                "the all-to-all path's per-call cost above (not measured for it: experiments/host_syncs.py's "
                f"{costs.host_syncs_case} case measures it)", low=n * floor, high=n * nccl_call,
                range_source=f"low: one kernel launch (the per-kernel floor) per synchronisation; high: each of the {n} "
                             "at the all-to-all path's per-call cost"))
    imbalance = _imbalance(inputs, rel)
    if imbalance and not imbalance.collapsed:
        A.append(Assumption("busiest EP rank's routed rows over the mean rank's (the routing the recipe's run sees)",
                            imbalance.factor(32, "median"), "x at EP 32 (median)",
                            f"{imbalance.source}: " + "; ".join(
                                f"EP {ep} median {v['median']:.3f}, p90 {v['p90']:.3f}"
                                for ep, v in sorted(imbalance.by_ep.items()))
                            + "; another EP takes the next larger measured one's, beyond the largest that one's",
                            low=1.0, high=imbalance.factor(32, "p90"),
                            range_source="high: the measured p90; low: the drawn routing's own busiest rank "
                                         "(uniform scores: sampling alone)"))
    elif imbalance:
        A.append(Assumption("busiest EP rank's routed rows over the mean rank's: the drawn routing's (DeepSeek-V3's "
                            "node-limited router on uniform scores), the measured one its pessimistic end", 1.0, "x",
                            f"central: the drawn routing's own busiest rank; the measured routing ({imbalance.source}: "
                            + "; ".join(f"EP {ep} median {v['median']:.3f}" for ep, v in sorted(imbalance.by_ep.items()))
                            + f") is not the workloads': {imbalance.collapsed}",
                            low=1.0, high=imbalance.factor(32, "median"),
                            range_source="high: the measured median at the workload's EP (EP 32 shown); low: the "
                                         "drawn routing's own"))
    else:
        A.append(Assumption("busiest EP rank's routed rows over the mean rank's", 1.0, "x",
                            f"not measured yet ({rel} holds no {IMBALANCE_SCHEMA} file: experiments/"
                            "routing_imbalance.py on a training run's [moe_comm] log_expert_counts): the drawn "
                            "routing's own busiest rank"))
    net, share = READ["network_efficiency"], READ["peak_share"]
    measured_skew = "median" if imbalance else "drawn"
    if imbalance and imbalance.collapsed:  # the measured routing bounds it from above, no more
        measured_skew, worst_skew = "drawn", "median"
    else:
        worst_skew = "p90" if imbalance else "drawn"
    scenarios = {
        "low": Inputs(net.low, share.low, worst_skew, idle_hi, "high"),
        "central": Inputs(net.value, share.value, measured_skew, idle_ratio, "central"),
        "high": Inputs(net.high, share.high, "drawn", idle_lo, "low"),
    }
    assert tuple(scenarios) == SCENARIOS
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
        one_gpu_idle_ratio=one_gpu_idle,
        assumptions=A, host_syncs=host_syncs, imbalance=imbalance, inputs=scenarios,
    )
    return cal


def find_input(inputs: Path, schema: str) -> Path | None:
    """The measured input of `inputs` whose JSON names `schema` (its "schema" field, written
    first), or None; two such files are an error (one measurement of each kind is the model's)."""
    pattern = re.compile(r'"schema"\s*:\s*"([^"]+)"')
    found = []
    for path in sorted(inputs.glob("*.json")):
        with open(path) as f:
            head = pattern.search(f.read(512))
        if head and head.group(1) == schema:
            found.append(path)
    if len(found) > 1:
        raise ValueError(f"{inputs}: {len(found)} {schema} files ({', '.join(p.name for p in found)}): keep one")
    return found[0] if found else None


def _idle_range(inputs: Path) -> tuple[float, float, list[str]]:
    """The lowest and highest GPU idle per busy second of the step profiles among the inputs."""
    ratios = {}
    for path in sorted(inputs.glob("profile_*.json")):
        prof = json.loads(path.read_text())
        ratios[path.name] = prof["gpu_idle_share"] / prof["gpu_busy_share"]
    return min(ratios.values()), max(ratios.values()), list(ratios)


def host_sync_costs(summary: dict, floor_us: float) -> HostSync:
    """One phase of a host_syncs case (experiments/host_syncs.py's summary) as a HostSync."""
    count = float(summary["syncs_per_call"])
    if not count:
        return HostSync(0.0, dict.fromkeys(SCENARIOS, 0.0))
    host_us = summary["host_ms"] * 1e3
    waited = (summary.get("wait_us_per_call") or 0.0) + (
        (summary.get("wait_outside_cuda_api") or {}).get("self_cpu_us_median") or 0.0)
    low = min(count * floor_us, host_us)
    central = min(host_us, max(host_us - waited, low))
    return HostSync(count, {"low": low, "central": central, "high": host_us})


def _host_syncs(inputs: Path, rel, floor_us: float) -> tuple[dict, list[Assumption]]:
    """Per measured GPU case of the host_syncs file, per transfer: its HostSync."""
    path = find_input(inputs, HOST_SYNCS_SCHEMA)
    if path is None:
        return {}, [Assumption("host synchronisations per dispatch, combine and their backwards", 0.0, "",
                               f"not measured yet ({rel} holds no {HOST_SYNCS_SCHEMA} file: experiments/host_syncs.py "
                               "run on one GPU): each backend's stated count (its CostTraits) at the all-to-all path's "
                               "per-call cost")]
    doc = json.loads(path.read_text())
    out, A = {}, []
    for case, c in doc["cases"].items():
        if c.get("status") != "ok" or c.get("device") != "cuda":
            continue  # the CPU cases count, they do not time
        out[case] = {t: host_sync_costs(c["summary"][phase], floor_us) for t, phase in HOST_SYNC_PHASES.items()}
        d = out[case]["dispatch"]
        whole = [n for n in names() if backend_class(n).costs and backend_class(n).costs.host_syncs_case == case
                 and backend_class(n).costs.transport == "NCCL"]
        record = (f" ({', '.join(whole)}: for the record - its per-call cost is the comm bench's measured round trip, "
                  "host syncs included)" if whole else "")
        A.append(Assumption(
            f"host synchronisations, {case} ({c.get('where', '')}): per forward dispatch, and the GPU time each call "
            f"loses{record}", d.count, f"syncs; {d.cost_us['central']:.0f} us", f"{rel}/{path.name} ({doc.get('device')}, "
            f"{doc['shape']['tokens']} tokens, hidden {doc['shape']['hidden']}); per call: "
            + "; ".join(f"{t} {h.count:g} x, {h.cost_us['central']:.0f} us" for t, h in out[case].items()),
            low=d.cost_us["low"], high=d.cost_us["high"],
            range_source="low: one kernel launch (the per-kernel floor) per synchronisation; high: the call's "
                         "whole host time, waits included"))
    return out, A


def _imbalance(inputs: Path, rel) -> Imbalance | None:
    path = find_input(inputs, IMBALANCE_SCHEMA)
    if path is None:
        return None
    doc = json.loads(path.read_text())
    by_ep = {int(ep): {k: e["all_layers"][k] for k in ("median", "p90", "max")}
             for ep, e in doc["analysis"]["ep"].items() if e.get("derivable")}
    run, a = doc.get("run", {}), doc["analysis"]
    experts = a["experts"]
    full = _flavor("671B").moe_args.num_experts
    # a run that routes fewer experts than DeepSeek-V3 (a small model trained from scratch) need not
    # route like it: its skew bounds the workloads' from above until a run of their own routing is measured
    collapsed = ""
    if experts < full:
        collapsed = (f"measured on a model of {experts} routed experts ({run.get('flavor')}, {a['steps']['last']} steps "
                     f"from scratch), not DeepSeek-V3's {full}")
        if by_ep:  # how close to all of a step's tokens on one rank (at most ep x min(top_k, experts / ep) / top_k)
            ep = max(by_ep)
            most = ep * min(a["top_k"], experts / ep) / a["top_k"]
            collapsed += (f"; its routing concentrated on few experts: at EP {ep} the busiest rank took "
                          f"{by_ep[ep]['median']:.2f}x the mean, of at most {most:g}x")
    return Imbalance(by_ep, f"{rel}/{path.name} ({run.get('recipe')}, {a['steps']['count']} steps, "
                            f"{experts} experts; per MoE layer and step)", experts, collapsed)
