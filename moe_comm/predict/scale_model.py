"""A scale model of MoE dispatch/combine and of the training step, per backend: what a recipe
moves over NVLink and over the network, how long that takes, and what step time and MFU follow.

It is built from three kinds of numbers, each listed with its source in `Calibration.assumptions`
(experiments/scale_model.py prints them in results/scale_model.md):
  * rows and bytes, counted exactly from a drawn routing (moe_comm.predict.routing_plan) for the
    hierarchical path (per-node dedup on the network, per-rank dedup over NVLink; nvshmem and
    DeepEP V1) and for the all-to-all (one row per pick; nccl);
  * costs measured here on 2xH200 (results/h200x2): the kernels' per-op fixed cost and how it
    shrinks with the SM budget, their link efficiency, the layout kernels' HBM cost, the nccl
    path's per-call and per-row costs and a step's idle share, fitted by
    moe_comm.predict.calibration from the JSON files at run time;
  * compute measured on one H200 (results/h200x1/layer_bench.json): every GEMM, attention and
    memory-bound time of a rank's microbatch, part by part (moe_comm.predict.layer_compute); the
    parameter-sized work no part times (optimizer, FSDP's and autocast's copies) by its bytes at
    the layout kernels' HBM rate (moe_comm.predict.estimate.param_copy_bytes, optimizer_bytes);
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

from moe_comm.metrics.peaks import table_peaks
from moe_comm.predict import estimate, layer_compute, schedule
from moe_comm.predict.assumptions import READ, REPO
from moe_comm.predict.calibration import Calibration
from moe_comm.predict.estimate import optimizer_bytes
from moe_comm.predict.routing_plan import PlanStats, row_bytes, routing_statistics
from moe_comm.predict.schedule import Pipeline

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
    layers_per_stage: int | None = None  # [parallelism] pipeline_parallel_layers_per_stage
    overlap: str = "none"  # "none", "chunked" ([moe_comm] overlap) or "dualpipev" (TorchTitan's, DualPipeV)

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
        layers_per_stage=c.parallelism.pipeline_parallel_layers_per_stage, overlap=overlap_for(c, r.layout),
    )


def overlap_for(config, layout) -> str:
    """The MoE overlap a recipe runs: TorchTitan's DualPipeV expert-parallel overlap where it
    applies (PP and EP, schedule DualPipeV, pipeline_parallel_expert_parallel_overlap, its
    default), else [moe_comm] overlap."""
    par = config.parallelism
    if (layout.pp > 1 and layout.ep > 1 and par.pipeline_parallel_schedule.lower() == "dualpipev"
            and par.pipeline_parallel_expert_parallel_overlap):
        return "dualpipev"
    return config.moe_comm.overlap


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
        pp_schedule=f.get("pp_schedule", "1F1B"), layers_per_stage=f.get("layers_per_stage"),
        overlap=f.get("overlap", "none"),
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
                # TorchTitan 0.2.2's DeepEP path waits on the host for the received counts
                # (torchtitan/distributed/deepep/deepep.py),
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


OVERLAPS = ("none", "chunked", "dualpipev")


@dataclass
class StepPrediction:
    backend: str
    comm: LayerComm
    terms_ms: dict  # exposed terms that add up to the step
    overlapped_ms: dict  # work hidden under compute
    step_ms: float
    tokens_per_s_per_gpu: float
    mfu: float  # % of the bf16 dense peak, TorchTitan's flops per token
    moe_calls_per_step: float  # MoE layer-microbatches on the busiest pipeline rank per step
    pipeline: Pipeline  # the schedule as the busiest rank runs it (pp 1: one stage, no bubble)
    moe_comm_ms: float  # all MoE communication of a step on that rank, exposed or hidden
    peak_tflops: float  # the GPU's dense bf16 peak, which mfu is a share of
    recompute_ms: dict  # of terms_ms' gemm, attention and memory-bound: the activation-checkpoint recompute
    # what priced the compute: "layer bench" (results/h200x1/layer_bench.json), with what it did not
    # measure and what stood in (moe_comm.predict.layer_compute's notes)
    compute_source: str = "layer bench"

    @property
    def comm_exposed_ms(self) -> float:
        return sum(v for k, v in self.terms_ms.items() if k in ("moe comm", "tp comm", "pp p2p", "fsdp exposed"))

    @property
    def comm_overlapped_ms(self) -> float:
        return sum(self.overlapped_ms.values())

    @property
    def moe_exposed_share(self) -> float:
        """Exposed MoE communication over all of it (1 without an overlap)."""
        return self.terms_ms["moe comm"] / self.moe_comm_ms if self.moe_comm_ms else 0.0

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOPS per GPU: TorchTitan's flops per token x tokens/s (the MFU numerator)."""
        return self.mfu / 100 * self.peak_tflops

    def per_step(self, attr: str) -> float:
        """A LayerComm total (rows, bytes, us) over every MoE call of a step on this rank."""
        return self.comm.total(attr) * self.moe_calls_per_step


def overlap_exposure(comm_us: tuple[float, float, float, float], compute_us: tuple[float, float, float],
                     sm_share: float) -> tuple[float, float]:
    """(exposed communication, compute slowdown), in us, of one MoE layer's pass under the
    "chunked" overlap: the layer's tokens in two chunks, communication on a side stream, the
    experts on the compute stream. comm_us = (a0, a1, b0, b1): the first op of chunk 0, of chunk 1,
    then the second op of chunk 0, of chunk 1 (forward: dispatch, dispatch, combine, combine);
    compute_us = (s, e0, e1): the shared experts, then the routed experts of chunk 0 and 1. Stream
    order: a0 under s, a1 under e0, b0 under e1, and b1 alone. The backward mirrors it (each op's
    backward on its forward's stream: combine's backward first, under the routed experts'
    backward), so the same function prices it with its ops and compute.

    While a communication kernel runs, its SMs (sm_share of the GPU) are lost to the GEMMs
    beside it: compute that takes e alone takes e / (1 - sm_share) under it. So a pair costs
    max(a - e, a x sm_share) beyond e: the comm's excess when it outlasts the stretched
    compute, else the compute's stretch while the comm runs."""
    a0, a1, b0, b1 = comm_us
    s, e0, e1 = compute_us
    exposed, slowdown = b1, 0.0
    for a, e in ((a0, s), (a1, e0), (b0, e1)):
        exposed += max(0.0, a - e)
        slowdown += max(a - e, a * sm_share) - max(0.0, a - e)
    return exposed, slowdown


def _chunk_us(t: Transfer) -> float:
    """One transfer for half the tokens: the per-call costs whole, half the rows to move."""
    return t.host_us + t.fixed_us + (max(t.nvlink_us, t.network_us) + t.layout_us) / 2


def _fsdp_ms(w: Workload, cluster: Cluster, cal: Calibration, v: int) -> tuple[float, float]:
    """(total, exposed at best) FSDP collective time per step: bf16 all-gathers (twice without
    PP: TorchTitan reshards after forward) and fp32 reduce-scatters, over NVLink or the network.
    Without PP one unit's all-gather and reduce-scatter are not hidden (the first and last);
    with PP each stage chunk unshards once before its first forward and reduces once after its
    last backward, so one chunk's are (1/v of the rank's)."""
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
    if lay.pp > 1:
        return total, total / v
    units = a.n_layers + 1
    return total, total / units * READ["fsdp_prefetch_units"].value * 2


def _pp_rate_gbps(w: Workload, cluster: Cluster, cal: Calibration) -> float:
    """Neighbouring pipeline ranks are world / pp ranks apart (PP is TorchTitan's outermost mesh
    dimension): on other nodes unless a node holds more than that."""
    apart = w.layout.world // w.layout.pp
    return cluster.network_gbps if apart >= cluster.gpus_per_node else _nccl_nvlink_gbps(cluster, cal)


def predict(backend: str, w: Workload, cluster: Cluster, cal: Calibration) -> StepPrediction:
    """A step on the busiest pipeline rank, per microbatch split into forward f, input gradient
    bi (with any recompute) and weight gradient bw, which the schedule turns into a bubble
    (moe_comm.predict.schedule); the microbatches' work, the bubble, the optimizer, FSDP's
    exposed collectives and the idle share add up to the step."""
    a, lay, gpu = w.args, w.layout, cluster.gpu
    if w.overlap not in OVERLAPS:
        raise ValueError(f"overlap {w.overlap!r}: choose one of {OVERLAPS}")
    ranks = estimate.pipeline_ranks(a, lay, w.local_batch, w.microbatch, w.pp_schedule, w.layers_per_stage)
    pipe = ranks[0].pipe
    if w.overlap == "dualpipev" and (pipe.name != "DualPipeV" or w.ac_mode != "none"):
        raise ValueError("the DualPipeV expert-parallel overlap needs pipeline_parallel_schedule DualPipeV and "
                         "activation_checkpoint mode none (TorchTitan refuses it with AC)")
    T = w.tokens_per_call
    if cal.layer_bench is None:
        raise ValueError("the step model prices compute from the layer benchmark (results/h200x1/layer_bench.json, "
                         "moe_comm.predict.layer_compute); this calibration has none")
    comm = layer_comm(backend, w, cluster, cal)
    t_d, t_c, t_cb, t_db = (t.time_us * 1e-6 for t in comm.transfers)
    # the GPU share an overlapped comm kernel takes from the GEMMs beside it (NCCL's channels are
    # assumed to take the same num_sms)
    sm_share = w.num_sms / gpu.sms
    zero_bubble = pipe.name in schedule.ZERO_BUBBLE
    pp_rate = _pp_rate_gbps(w, cluster, cal) if lay.pp > 1 else 0.0

    notes: list[str] = []  # what the layer benchmark did not measure, and what stood in
    hbm_rate = cal.layout_hbm_efficiency * gpu.hbm_tbs * 1e12  # what the optimizer and copies reach
    chunk_f, chunk_b = (b / hbm_rate for b in estimate.chunked_expert_bytes(a, lay)) if w.overlap == "chunked" \
        else (0.0, 0.0)

    def per_microbatch(rank) -> dict:
        """Seconds per microbatch on one rank, each as (f, bi, bw)."""
        measured = layer_compute.rank_ms(cal.layer_bench, w, gpu.name, rank.layers, rank.embedding, rank.output)
        terms = measured.seconds()
        gemm, attn, mem = (terms[t][0] for t in ("gemm", "attention", "memory-bound"))
        rec = {t: v / 1e3 for t, v in measured.recompute.items()}
        shared, experts = (measured.moe_layer_fwd[p] / 1e3 for p in ("shared_expert", "experts"))
        notes.extend(n for n in measured.notes if n not in notes)
        n_layers = len(rank.layers)
        # one MoE layer: its comm, exposed and hidden, and the compute it can hide behind
        bwd = 1.0 if zero_bubble else 2.0  # the experts' backward beside the comm: dgrad (+ wgrad)
        fwd_all, bwd_all = t_d + t_c, t_cb + t_db
        hidden = {"f": 0.0, "b": 0.0}
        slow = {"f": 0.0, "b": 0.0}
        if w.overlap == "chunked":
            cd, cc, ccb, cdb = (_chunk_us(t) * 1e-6 for t in comm.transfers)
            fwd_all, bwd_all = 2 * (cd + cc), 2 * (ccb + cdb)  # what runs: every op twice, per chunk
            ef, sf = overlap_exposure((cd, cd, cc, cc), (shared, experts / 2, experts / 2), sm_share)
            eb, sb = overlap_exposure((cdb, cdb, ccb, ccb), (bwd * shared, bwd * experts / 2, bwd * experts / 2),
                                      sm_share)
            hidden = {"f": fwd_all - ef, "b": bwd_all - eb}
            slow = {"f": sf, "b": sb}
        elif w.overlap == "dualpipev":
            # in an OVERLAP_F_B pair each of the forward chunk's comm ops runs beside half of the
            # backward chunk's layer compute, and the other way round (TorchTitan alternates one
            # compute and one comm op of the two threads)
            layer_f = (gemm + attn + mem) / max(n_layers, 1)
            layer_b = 2 * layer_f
            share = pipe.overlapped_pairs / (2 * pipe.microbatches)
            ef = sum(max(0.0, t - layer_b / 2) for t in (t_d, t_c))
            eb = sum(max(0.0, t - layer_f / 2) for t in (t_cb, t_db))
            sf = sum(max(t - layer_b / 2, t * sm_share) - max(0.0, t - layer_b / 2) for t in (t_d, t_c))
            sb = sum(max(t - layer_f / 2, t * sm_share) - max(0.0, t - layer_f / 2) for t in (t_cb, t_db))
            hidden = {"f": share * (fwd_all - ef), "b": share * (bwd_all - eb)}
            slow = {"f": share * sf, "b": share * sb}
        L = sum(1 for i in rank.layers if i >= a.n_dense_layers)
        moe_f = L * (fwd_all - hidden["f"])
        moe_b = L * (bwd_all - hidden["b"]) + (L * (fwd_all - hidden["f"]) if w.comm_recomputed else 0.0)
        slow_f = L * slow["f"]
        slow_b = L * (slow["b"] + (slow["f"] if w.comm_recomputed else 0.0))
        terms["moe comm"] = (moe_f, moe_b, 0.0)
        terms["comm SM contention"] = (slow_f, slow_b, 0.0)
        # the experts once per chunk: the weight gradients added, weights re-cast under autocast
        terms["chunked weight work"] = (L * chunk_f, 0.0, L * chunk_b)
        # TP (sequence parallel): all-gather + reduce-scatter around attention and the FFN,
        # forward and backward (and recompute), each moving the microbatch's activations once
        tp = 0.0
        if lay.tp > 1:
            coll_bytes = T * lay.tp * a.dim * 2 * (lay.tp - 1) / lay.tp
            tp = 4 * coll_bytes / (_nccl_nvlink_gbps(cluster, cal) * 1e9) * n_layers
        terms["tp comm"] = (tp, tp * (1 + (1 if w.ac_mode == "full" else 0)), 0.0)
        # activations forward and their gradients back, at every stage boundary the rank crosses
        pp = pipe.sends_per_microbatch * T * a.dim * 2 / (pp_rate * 1e9) if lay.pp > 1 else 0.0
        terms["pp p2p"] = (pp, pp, 0.0)
        hid = L * (hidden["f"] + hidden["b"] + (hidden["f"] if w.comm_recomputed else 0.0))
        return {"terms": terms, "hidden": hid, "moe_layers": L, "rank": rank,
                "recompute": rec,
                "moe_all": L * (fwd_all + bwd_all + (fwd_all if w.comm_recomputed else 0.0))}

    work = max((per_microbatch(r) for r in ranks), key=lambda x: sum(sum(v) for v in x["terms"].values()))
    terms3 = work["terms"]
    f = sum(v[0] for v in terms3.values())
    bi = sum(v[1] for v in terms3.values())
    bw = sum(v[2] for v in terms3.values())
    m = pipe.microbatches if lay.pp > 1 else 1
    p = estimate.count_params(a)
    opt_s = optimizer_bytes(p.total / (lay.dp_shard * lay.cp * lay.tp * lay.pp)) / hbm_rate
    copies_s = estimate.param_copy_bytes(a, lay, work["rank"] if lay.pp > 1 else None, m) / hbm_rate
    fsdp_total_ms, fsdp_least_ms = _fsdp_ms(w, cluster, cal, pipe.v)
    compute_ms = sum(sum(terms3[k]) for k in ("gemm", "attention", "memory-bound")) * m * 1e3
    fsdp_exposed_ms = min(fsdp_total_ms, fsdp_least_ms + max(0.0, fsdp_total_ms - compute_ms))
    terms = {k: sum(v) * m * 1e3 for k, v in terms3.items()}
    terms["pp bubble"] = pipe.bubble(f, bi, bw) * 1e3 if lay.pp > 1 else 0.0
    terms["optimizer"] = opt_s * 1e3
    terms["param copies"] = copies_s * 1e3
    terms["fsdp exposed"] = fsdp_exposed_ms
    # launch gaps and host work scale with the work, not with the bubble's waiting
    terms["idle"] = (sum(terms.values()) - terms["pp bubble"]) * cal.idle_ratio
    step_ms = sum(terms.values())
    tps = w.local_batch * w.seq_len / (step_ms * 1e-3) / (lay.cp * lay.tp * lay.pp)
    flops = p.flops_per_token(a, w.seq_len)
    mfu = 100 * flops * tps / (gpu.bf16_tflops * 1e12)
    return StepPrediction(
        backend=backend, comm=comm, terms_ms=terms,
        overlapped_ms={"fsdp": fsdp_total_ms - fsdp_exposed_ms, "moe comm": work["hidden"] * m * 1e3},
        step_ms=step_ms, tokens_per_s_per_gpu=tps, mfu=mfu, moe_calls_per_step=work["moe_layers"] * m,
        pipeline=pipe, moe_comm_ms=work["moe_all"] * m * 1e3, peak_tflops=gpu.bf16_tflops,
        recompute_ms={k: v * m * 1e3 for k, v in work["recompute"].items()},
        compute_source="layer bench" + (f" (not measured there: {'; '.join(notes)})" if notes else ""),
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


def refusal(backend: str, w: Workload) -> str:
    """Why `check` would refuse the backend for the workload ("" where it runs), as moe_comm.recipe
    and the backend's class say: our deepep backend does not pad expert segments, which the
    grouped-GEMM converters need, and DeepEP has no EP 1 (one rank holds every expert)."""
    if backend != "deepep":
        return ""
    if any(c.startswith("quantize.grouped_mm") for c in w.converters):
        return "refused with these converters: no expert-segment padding"
    if w.layout.ep == 1:
        return "refused at EP 1: DeepEP needs peers"
    return ""


def runnable(backend: str, w: Workload) -> bool:
    return not refusal(backend, w)
