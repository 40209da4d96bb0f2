"""A scale model of MoE dispatch/combine and of the training step, per backend: what a recipe
moves over NVLink and over the network, how long that takes, and what step time and MFU follow.

It is built from three kinds of numbers, each listed with its source in `Calibration.assumptions`
(experiments/scale_model.py prints them in results/scale_model.md):
  * rows and bytes, counted exactly from a drawn routing (moe_comm.predict.routing_plan) for the
    hierarchical path (per-node dedup on the network, per-rank dedup over NVLink; nvshmem and
    DeepEP V1) and for the all-to-all (one row per pick; nccl);
  * costs measured here on 2xH200 (results/h200x2): the kernels' per-op fixed cost and how it
    shrinks with the SM budget, their link efficiency, the layout kernels' HBM cost, the nccl
    path's per-call and per-row costs, GEMM and attention efficiency, the memory-bound rest of
    a step and its idle share, fitted by moe_comm.predict.calibration from the JSON files at run
    time;
  * link and peak rates read from datasheets and public measurements (NVLink, CX7 400 Gb/s,
    DeepEP V1's RDMA bandwidth, HBM, dense peaks).

A transfer is one dispatch or one combine of one MoE layer for one microbatch. The SM-driven
backends (nvshmem, deepep) pay a fixed cost that scales with the tokens they handle per SM of
their budget, then the slower of their NVLink and network phases (the two are pipelined in
chunks), then their layout kernels; nccl pays a host sync per forward dispatch, a permute per
row, and the slower of its NVLink and network bytes at NCCL's rates. TorchTitan 0.2.2 runs
dispatch and combine on the compute stream, so MoE communication is exposed; FSDP's
collectives overlap compute except the first all-gather and the last reduce-scatter.
"""

from dataclasses import dataclass

from moe_comm.metrics.peaks import low_precision_converters, table_peaks
from moe_comm.predict import estimate, layer_compute
from moe_comm.predict.assumptions import READ, REPO
from moe_comm.predict.calibration import Calibration
from moe_comm.predict.estimate import (
    attention_flops_per_token,
    expert_flops_per_token,
    matmul_flops_per_token,
    memory_bound_bytes_per_token,
    optimizer_bytes,
)
from moe_comm.predict.routing_plan import PlanStats, row_bytes, routing_statistics

BACKENDS = ("nccl", "deepep", "nvshmem", "nvshmem-fp8")


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16_tflops: float
    fp8_tflops: float
    hbm_tbs: float
    sms: int
    nvlink_gbps: float


def gpu_spec(name: str) -> GPUSpec:
    peaks = table_peaks(f"NVIDIA {name}")
    if peaks is None or f"hbm_tbs.{name}" not in READ:
        raise ValueError(f"GPU {name!r} has no scale-model spec; use one of H100, H200, B200")
    nvlink = READ["nvlink_gbps.B200" if name == "B200" else "nvlink_gbps.H200"].value
    return GPUSpec(name, peaks["bf16"], peaks["fp8"], READ[f"hbm_tbs.{name}"].value,
                   148 if name == "B200" else 132, nvlink)


@dataclass(frozen=True)
class Cluster:
    gpu: GPUSpec
    nodes: int
    gpus_per_node: int
    nvlink_copy_gbps: float  # what SM stores or the copy engine achieve per direction, both busy
    nic_gbps: float

    @property
    def network_gbps(self) -> float:
        return self.nic_gbps * READ["network_efficiency"].value


def cluster_for(gpu: str, nodes: int, gpus_per_node: int, cal: Calibration) -> Cluster:
    """NVLink's achievable rate scales the measured H200 P2P ceiling by the datasheet rates."""
    spec = gpu_spec(gpu)
    copy = cal.nvlink_copy_efficiency * spec.nvlink_gbps
    return Cluster(spec, nodes, gpus_per_node, copy, READ["nic_gbps"].value)


# ----------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    """What the model needs from a recipe."""

    flavor: str
    args: object
    layout: estimate.Layout
    local_batch: int
    seq_len: int
    microbatch: int
    ac_mode: str
    converters: tuple
    routing: str
    num_sms: int
    network_sms: int = 0
    virtual_node_size: int = 0
    pp_schedule: str = "1F1B"

    @property
    def tokens_per_call(self) -> int:
        """Tokens one rank routes per MoE call: one microbatch with PP, the local batch without."""
        batch = self.microbatch if self.layout.pp > 1 else self.local_batch
        return batch * self.seq_len // (self.layout.cp * self.layout.tp)

    @property
    def microbatches(self) -> int:
        return self.local_batch // self.microbatch if self.layout.pp > 1 else 1

    @property
    def ranks_per_node(self) -> int:
        """Ranks of one EP group per (possibly virtual) node; TorchTitan lays EP on the innermost
        mesh dimensions, so an EP group is consecutive ranks."""
        node = self.virtual_node_size or self.layout.procs_per_node
        return max(1, min(self.layout.ep, node))

    @property
    def ep_nodes(self) -> int:
        return max(1, self.layout.ep // self.ranks_per_node)

    @property
    def moe_layers_per_stage(self) -> float:
        return (self.args.n_layers - self.args.n_dense_layers) / self.layout.pp

    @property
    def comm_recomputed(self) -> bool:
        """Full AC re-runs each block's forward, dispatch and combine included; TorchTitan's
        op-level selective AC keeps the comm ops' outputs (they are on its save list)."""
        return self.ac_mode == "full"


def routing_for(config, args) -> str:
    """The routing statistic a recipe's run will see."""
    if getattr(config.debug, "moe_force_load_balance", False):
        return "balanced"
    if args.moe_args.num_expert_groups and args.moe_args.num_limited_groups:
        return "node_limited"
    return "random"


def workload_from_recipe(r) -> Workload:
    from moe_comm import recipe as recipe_mod

    c = r.config
    args = recipe_mod.flavor_args(c)
    return Workload(
        flavor=c.model.flavor, args=args, layout=r.layout, local_batch=c.training.local_batch_size,
        seq_len=c.training.seq_len, microbatch=c.parallelism.pipeline_parallel_microbatch_size,
        ac_mode=c.activation_checkpoint.mode, converters=tuple(c.model.converters),
        routing=routing_for(c, args), num_sms=c.moe_comm.num_sms, network_sms=c.moe_comm.network_sms,
        virtual_node_size=c.moe_comm.virtual_node_size, pp_schedule=c.parallelism.pipeline_parallel_schedule,
    )


def workload_from_spec(spec: dict, cal: Calibration | None = None) -> tuple[Workload, Cluster | None]:
    """A validation figure's workload and cluster (None without a calibration): a recipe (with
    overrides) on a GPU, or the fields of a run that has no recipe here (a public anchor)."""
    if "recipe" in spec:
        from moe_comm import recipe as recipe_mod

        r = recipe_mod.load(str(REPO / spec["recipe"]), list(spec.get("overrides", [])), device="cuda",
                            check_paths=False)
        w = workload_from_recipe(r)
        return w, cal and cluster_for(spec["gpu"], r.layout.nodes, r.layout.procs_per_node, cal)
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    from moe_comm.titan import flavors

    flavors.register()
    f = spec["workload"]
    nodes, per_node = spec["nodes"], spec["gpus_per_node"]
    world = nodes * per_node
    tp, pp, ep = f.get("tp", 1), f.get("pp", 1), f["ep"]
    layout = estimate.Layout(world, nodes, per_node, 1, world // (tp * pp), 1, tp, pp, ep, 1)
    w = Workload(
        flavor=f["flavor"], args=deepseekv3_args[f["flavor"]], layout=layout, local_batch=f["local_batch"],
        seq_len=f["seq_len"], microbatch=f.get("microbatch", 1), ac_mode=f["ac_mode"],
        converters=tuple(f.get("converters", ())), routing=f["routing"], num_sms=f.get("num_sms", 20),
        pp_schedule=f.get("pp_schedule", "1F1B"),
    )
    return w, cal and cluster_for(spec["gpu"], nodes, per_node, cal)


def _stats(w: Workload) -> PlanStats:
    m = w.args.moe_args
    return routing_statistics(w.routing, w.layout.ep, w.ranks_per_node, m.num_experts, m.top_k,
                              m.num_expert_groups or 8, m.num_limited_groups or 4)


# ----------------------------------------------------------------------------- transfers


@dataclass
class Transfer:
    """One dispatch-like or combine-like call of one MoE layer for one microbatch, slowest rank."""

    name: str
    kind: str  # "dispatch" or "combine": which measured kernel it is priced as
    forward: bool
    network_rows: float
    nvlink_rows: float
    row_bytes: float
    fixed_us: float = 0.0
    nvlink_us: float = 0.0
    network_us: float = 0.0
    layout_us: float = 0.0
    host_us: float = 0.0

    @property
    def network_bytes(self) -> float:
        return self.network_rows * self.row_bytes

    @property
    def nvlink_bytes(self) -> float:
        return self.nvlink_rows * self.row_bytes

    @property
    def time_us(self) -> float:
        return self.host_us + self.fixed_us + max(self.nvlink_us, self.network_us) + self.layout_us


@dataclass
class LayerComm:
    """Every transfer of one MoE layer for one microbatch (forward and backward, once each)."""

    backend: str
    nodes: int
    ranks_per_node: int
    transfers: list
    recomputed: bool  # the forward transfers run again in the backward pass (full AC)
    stats: PlanStats

    def _each(self):
        for t in self.transfers:
            yield t, (2 if (t.forward and self.recomputed) else 1)

    def total(self, attr: str) -> float:
        return sum(getattr(t, attr) * n for t, n in self._each())

    @property
    def time_us(self) -> float:
        return self.total("time_us")


def _sm_link_gbps(cluster: Cluster, sms: int, efficiency: float) -> float:
    return efficiency * min(cluster.nvlink_copy_gbps, READ["sm_push_gbps"].value * max(sms, 1))


def _nccl_nvlink_gbps(cluster: Cluster, cal: Calibration) -> float:
    """NCCL's measured NVLink rate on H200, scaled to the cluster's NVLink."""
    return READ["nccl_nvlink_gbps_h200"].value * cluster.nvlink_copy_gbps / cal.p2p_gbps


def _hbm_scale(cluster: Cluster, hidden: int) -> float:
    """Layout kernels and permutes are HBM-bound: scale H200 times by bandwidth and row size."""
    return READ["hbm_tbs.H200"].value / cluster.gpu.hbm_tbs * hidden / 7168


def layer_comm(backend: str, w: Workload, cluster: Cluster, cal: Calibration) -> LayerComm:
    """The four transfers of one MoE layer for one microbatch on the slowest rank."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose one of {BACKENDS}")
    st = _stats(w)
    T = w.tokens_per_call
    hidden = w.args.dim
    hier = backend != "nccl"
    net_rows = T * max(st.max["network_out" if hier else "a2a_network_out"], st.max["network_in" if hier else "a2a_network_in"])
    nvl_rows = T * max(st.max["nvlink_out" if hier else "a2a_nvlink_out"], st.max["nvlink_in" if hier else "a2a_nvlink_in"])
    net_in = T * st.max["network_in"]
    expert_rows = T * st.max["expert_rows"]
    slots = T * st.max["recv_slots"]
    spec = [("dispatch", "dispatch", True), ("combine", "combine", True),
            ("combine backward", "dispatch", False), ("dispatch backward", "combine", False)]
    transfers = []
    hbm = _hbm_scale(cluster, hidden)
    for name, kind, forward in spec:
        fp8 = backend == "nvshmem-fp8" and name == "dispatch"
        rb = row_bytes(hidden, "fp8" if fp8 else "bf16", metadata=hier)
        t = Transfer(name, kind, forward, net_rows, nvl_rows, rb)
        if backend == "nccl":
            t.host_us = cal.nccl_call_us if name == "dispatch" else 0.0
            t.layout_us = (cal.nccl_row_us if forward else cal.nccl_backward_row_us) / 2 * expert_rows * hbm
            t.nvlink_us = t.nvlink_bytes / (_nccl_nvlink_gbps(cluster, cal) * 1e3)
            t.network_us = t.network_bytes / (cluster.network_gbps * 1e3)
        else:
            ops = cal.deepep_ops if backend == "deepep" else cal.ops
            op = ops[kind]
            sms = max(w.num_sms, 1)
            nvl_sms = sms if w.ep_nodes == 1 else sms - (w.network_sms or sms // 2)
            t.fixed_us = cal.kernel_floor_us + op.per_token_sm_us * (T + net_in) / sms
            t.nvlink_us = t.nvlink_bytes / (_sm_link_gbps(cluster, nvl_sms, op.link_efficiency) * 1e3)
            t.network_us = t.network_bytes / (cluster.network_gbps * 1e3)
            if backend == "deepep":
                per_row = READ["deepep_permute_us_per_row" if kind == "dispatch" else "deepep_unpermute_us_per_row"]
                t.layout_us = per_row.value * expert_rows * hbm
                # TorchTitan's DeepEP path waits on the host for the received counts (NOTES §7),
                # assumed to cost what the standard path's host round trip costs per call
                t.host_us = cal.nccl_call_us if name == "dispatch" else 0.0
            else:
                per_row, per_slot = cal.expand if kind == "dispatch" else cal.reduce
                t.layout_us = (cal.kernel_floor_us + per_row * expert_rows + per_slot * slots) * hbm
                if fp8:  # the sender quantises its rows: read bf16, write e4m3 + scales
                    t.layout_us += T * hidden * 3 / (cal.layout_hbm_efficiency * cluster.gpu.hbm_tbs * 1e6)
        transfers.append(t)
    return LayerComm(backend, w.ep_nodes, w.ranks_per_node, transfers, w.comm_recomputed, st)


# ------------------------------------------------------------------------------- the step


@dataclass
class StepPrediction:
    backend: str
    comm: LayerComm
    terms_ms: dict  # exposed terms that add up to the step
    overlapped_ms: dict  # work hidden under compute
    step_ms: float
    tokens_per_s_per_gpu: float
    mfu: float  # % of the bf16 dense peak, TorchTitan's flops per token
    moe_calls_per_step: float  # MoE layer-microbatches on this rank per step
    compute_source: str = "fitted"  # "layer bench" where results/h200x1/layer_bench.json priced compute

    @property
    def comm_exposed_ms(self) -> float:
        return sum(v for k, v in self.terms_ms.items() if k in ("moe comm", "tp comm", "pp p2p", "fsdp exposed"))

    @property
    def comm_overlapped_ms(self) -> float:
        return sum(self.overlapped_ms.values())

    def per_step(self, attr: str) -> float:
        """A LayerComm total (rows, bytes, us) over every MoE call of a step on this rank."""
        return self.comm.total(attr) * self.moe_calls_per_step


def _fsdp_ms(w: Workload, cluster: Cluster, cal: Calibration) -> tuple[float, float]:
    """(total, one unit) FSDP collective time per step: bf16 all-gathers (twice without PP:
    TorchTitan reshards after forward) and fp32 reduce-scatters, over NVLink or the network."""
    a, lay = w.args, w.layout
    p = estimate.count_params(a)
    routed = 3 * a.moe_args.num_experts * a.dim * a.moe_inter_dim * (a.n_layers - a.n_dense_layers)
    dense = p.total - routed
    d = lay.dp_shard * lay.cp
    ag_passes = 1 if lay.pp > 1 else 2
    bytes_dense = (dense / lay.pp / lay.tp) * (d - 1) / d
    e = lay.efsdp
    bytes_routed = (routed / lay.pp / lay.ep) * (e - 1) / e if e > 1 else 0.0
    total_bytes = (2 * ag_passes + 4) * (bytes_dense + bytes_routed)
    spans_nodes = lay.dp_shard * lay.cp * lay.tp > cluster.gpus_per_node
    rate = cluster.network_gbps if spans_nodes else _nccl_nvlink_gbps(cluster, cal)
    total = total_bytes / (rate * 1e9) * 1e3
    units = a.n_layers / lay.pp + 1
    return total, total / units * READ["fsdp_prefetch_units"].value * 2


def predict(backend: str, w: Workload, cluster: Cluster, cal: Calibration) -> StepPrediction:
    a, lay = w.args, w.layout
    gpu = cluster.gpu
    T = w.tokens_per_call
    passes = 4 / 3 if w.ac_mode == "full" else (3.5 / 3 if w.ac_mode == "selective" else 1.0)
    stage = 1 / lay.pp
    low = low_precision_converters(list(w.converters))
    expert_fp8 = any("grouped_mm" in c for c in low)
    linear_fp8 = any("linear" in c for c in low)
    f_expert = expert_flops_per_token(a)
    f_rest = matmul_flops_per_token(a) - f_expert
    fp8_rate = gpu.fp8_tflops * 1e12 * cal.gemm_efficiency
    bf16_rate = gpu.bf16_tflops * 1e12 * cal.gemm_efficiency
    measured = layer_compute.priced(cal.layer_bench, w, gpu.name)  # the one-GPU layer parts, where they cover w
    if measured is not None:
        gemm_s, attn_s, mem_s = (measured.terms[k] / 1e3 for k in ("gemm", "attention", "memory-bound"))
        compute_source = "layer bench"
    else:  # efficiencies fitted to the 2xH200 training profiles (moe_comm.predict.calibration)
        compute_source = "fitted"
        gemm_s = T * stage * passes * (f_expert / (fp8_rate if expert_fp8 else bf16_rate)
                                       + f_rest / (fp8_rate if linear_fp8 else bf16_rate))
        attn_s = T * stage * passes * attention_flops_per_token(a, w.seq_len) / (
            gpu.bf16_tflops * 1e12 * cal.attention_efficiency)
        mem_s = T * stage * passes * cal.memory_bytes_factor * memory_bound_bytes_per_token(a) / (gpu.hbm_tbs * 1e12)
    comm = layer_comm(backend, w, cluster, cal)
    moe_s = comm.time_us * 1e-6 * w.moe_layers_per_stage
    # TP (sequence parallel): all-gather + reduce-scatter around attention and the FFN, forward
    # and backward (and recompute), each moving the microbatch's activations once
    tp_s = 0.0
    if lay.tp > 1:
        coll_bytes = T * lay.tp * a.dim * 2 * (lay.tp - 1) / lay.tp
        tp_s = 4 * (2 + (1 if w.ac_mode == "full" else 0)) * coll_bytes / (_nccl_nvlink_gbps(cluster, cal) * 1e9)
        tp_s *= a.n_layers * stage
    pp_s = 0.0
    if lay.pp > 1:  # activations forward and gradients back between stages, on the network
        pp_s = 2 * T * a.dim * 2 / (cluster.network_gbps * 1e9)
    micro_s = gemm_s + attn_s + mem_s + moe_s + tp_s + pp_s
    mb = w.microbatches
    virtual = 2 if "Interleaved" in w.pp_schedule else 1
    bubble = (lay.pp - 1) / virtual if lay.pp > 1 else 0.0
    p = estimate.count_params(a)
    opt_s = optimizer_bytes(p.total / (lay.dp_shard * lay.cp * lay.tp * lay.pp)) / (
        cal.layout_hbm_efficiency * gpu.hbm_tbs * 1e12)
    fsdp_total_ms, fsdp_unit_ms = _fsdp_ms(w, cluster, cal)
    compute_ms = (gemm_s + attn_s + mem_s) * mb * 1e3
    fsdp_exposed_ms = min(fsdp_total_ms, fsdp_unit_ms + max(0.0, fsdp_total_ms - compute_ms))
    terms = {
        "gemm": gemm_s * mb * 1e3,
        "attention": attn_s * mb * 1e3,
        "memory-bound": mem_s * mb * 1e3,
        "moe comm": moe_s * mb * 1e3,
        "tp comm": tp_s * mb * 1e3,
        "pp p2p": pp_s * mb * 1e3,
        "pp bubble": micro_s * bubble * 1e3,
        "optimizer": opt_s * 1e3,
        "fsdp exposed": fsdp_exposed_ms,
    }
    busy = sum(terms.values())
    terms["idle"] = busy * cal.idle_ratio
    step_ms = sum(terms.values())
    tps = w.local_batch * w.seq_len / (step_ms * 1e-3) / (lay.cp * lay.tp * lay.pp)
    flops = estimate.count_params(a).flops_per_token(a, w.seq_len)
    mfu = 100 * flops * tps / (gpu.bf16_tflops * 1e12)
    return StepPrediction(
        backend=backend, comm=comm, terms_ms=terms, overlapped_ms={"fsdp": fsdp_total_ms - fsdp_exposed_ms},
        step_ms=step_ms, tokens_per_s_per_gpu=tps, mfu=mfu, moe_calls_per_step=w.moe_layers_per_stage * mb,
        compute_source=compute_source,
    )


def predict_all(w: Workload, cluster: Cluster, cal: Calibration) -> dict[str, StepPrediction]:
    return {b: predict(b, w, cluster, cal) for b in BACKENDS}


def bench_round_trip(backend: str, tokens: int, hidden: int, top_k: int, experts: int, routing: str, world: int,
                     num_sms: int, cluster: Cluster, cal: Calibration) -> dict:
    """experiments/bench_comm.py's forward dispatch and combine (no backward, one node)."""
    from torchtitan.models.moe import MoEArgs

    args = MoEShape(hidden, MoEArgs(num_experts=experts, top_k=top_k))
    lay = estimate.Layout(world, 1, world, 1, world, 1, 1, 1, world, 1)
    w = Workload("bench", args, lay, 1, tokens, 1, "none", (), routing, num_sms)
    comm = layer_comm(backend, w, cluster, cal)
    d, c = comm.transfers[0], comm.transfers[1]
    return {"dispatch_us": d.time_us, "combine_us": c.time_us, "round_trip_us": d.time_us + c.time_us,
            "transport_us": d.time_us + c.time_us - d.layout_us - c.layout_us, "transfers": [d, c]}


@dataclass
class MoEShape:
    """The flavor fields the communication model reads, for a bare MoE layer (the bench)."""

    dim: int
    moe_args: object
    n_layers: int = 1
    n_dense_layers: int = 0


def runnable(backend: str, w: Workload) -> bool:
    """Whether `check` lets the backend run the workload: our deepep backend does not pad expert
    segments, which the grouped-GEMM converters need (moe_comm.recipe refuses the pair)."""
    return not (backend == "deepep" and any(c.startswith("quantize.grouped_mm") for c in w.converters))
