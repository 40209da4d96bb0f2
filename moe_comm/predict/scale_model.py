"""A scale model of MoE dispatch/combine and of the training step, per backend: what a recipe
moves over NVLink and over the network, how long that takes, and what step time and MFU follow.

It is built from three kinds of numbers, each listed with its source in `Calibration.assumptions`
(experiments/scale_model.py prints them in results/scale_model.md):
  * rows and bytes, counted exactly from a drawn routing (moe_comm.predict.routing_plan) for the
    hierarchical path (per-node dedup on the network, per-rank dedup over NVLink; nvshmem and
    DeepEP V1) and for the all-to-all (one row per pick; nccl);
  * costs measured here on 2xH200 (results/model_inputs): the kernels' per-op fixed cost and how it
    shrinks with the SM budget, their link efficiency, the layout kernels' HBM cost, the nccl
    path's per-call and per-row costs and a step's idle share, fitted by
    moe_comm.predict.calibration from the JSON files at run time;
  * compute measured on one H200 (results/model_inputs/layer_bench_h200x1.json): every GEMM, attention and
    memory-bound time of a rank's microbatch, part by part (moe_comm.predict.layer_compute); the
    parameter-sized work no part times (optimizer, FSDP's and autocast's copies) by its bytes at
    the layout kernels' HBM rate (moe_comm.predict.estimate.param_copy_bytes, optimizer_bytes);
  * link and peak rates read from datasheets and public measurements (NVLink, CX7 400 Gb/s,
    DeepEP V1's RDMA bandwidth, HBM, dense peaks).

A transfer is one dispatch or one combine of one MoE layer for one microbatch, priced by what
the backend's class says of it (its `costs`: moe_comm.backends.base.CostTraits), for each
dispatch dtype it takes. Kernels on the backend's SMs pay a fixed cost that scales with the
tokens they handle per SM of their budget, then the slower of their NVLink and network phases
(the two are pipelined in chunks); NCCL's all-to-all pays the slower of its NVLink and network
bytes at NCCL's rates; then each pays its host round trips per forward dispatch and its permute
or layout kernels per expert row. Which backends the model refuses for a workload is what their
`check_run` refuses before launch. TorchTitan 0.2.2 runs dispatch and combine on the compute
stream, so MoE communication is exposed unless an overlap hides it ("chunked" behind the same
layer's experts, "microbatch" behind another microbatch's layer in Interleaved1F1B's overlapped
pairs, DualPipeV's in its own pairs, priced alike: both run TorchTitan's overlap callback with the
same sync points); FSDP's collectives overlap compute except the first all-gather
and the last reduce-scatter, and take their share of the NIC from the EP transfers beside them.

Every prediction is made at one scenario of the unmeasured inputs (assumptions.SCENARIOS:
network efficiency, the B200's share of peak, the routing's busiest-rank factor, the GPU's idle
share, the host synchronisations' cost): `predict_range` gives the pessimistic end, the central
value and the optimistic end.
"""

from dataclasses import dataclass, replace

from moe_comm import fp8_experts, gpus, titan_fields
from moe_comm.backends import backend_class, names
from moe_comm.config import MoEComm
from moe_comm.errors import RecipeError
from moe_comm.layout import dual_pipe_v_overlap, flavor_args, Layout, OUR_MODEL_NAME, RunPlan
from moe_comm.predict import documents, estimate, layer_compute, schedule
from moe_comm.predict.assumptions import READ, REPO, SCENARIOS, Inputs
from moe_comm.predict.calibration import Calibration
from moe_comm.predict.documents import DocumentLengths
from moe_comm.predict.estimate import optimizer_bytes
from moe_comm.predict.routing_plan import PlanStats, row_bytes, routing_statistics
from moe_comm.predict.schedule import Pipeline



@dataclass(frozen=True)
class Choice:
    """A backend and what its dispatch puts on the links: what the model prices, one row of its
    tables (labelled by the class's `label`: its name, and the dtype unless bf16)."""

    backend: str
    dispatch_dtype: str = "bf16"

    @property
    def label(self) -> str:
        return backend_class(self.backend).label(self.dispatch_dtype)


def choices() -> list[Choice]:
    """Every registered backend the model can price (its class has `costs`), with each dispatch
    dtype it takes: the baseline first, then by name."""
    priced = [backend_class(n) for n in names() if backend_class(n).costs is not None]
    priced.sort(key=lambda cls: (not cls.baseline, cls.name))
    return [Choice(cls.name, dtype) for cls in priced for dtype in cls.dispatch_dtypes]


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16_tflops: float
    fp8_tflops: float
    hbm_tbs: float
    sms: int
    nvlink_gbps: float


def gpu_spec(name: str) -> GPUSpec:
    """The facts of GPU model `name` (moe_comm.gpus) the model prices with."""
    try:
        gpu = gpus.model(name)
    except KeyError:
        gpu = None
    if gpu is None or None in (gpu.bf16_tflops, gpu.fp8_tflops, gpu.hbm_tbs, gpu.sms, gpu.nvlink_gbps):
        raise ValueError(f"GPU {name!r} has no scale-model spec; use one of H100, H200, B200")
    return GPUSpec(name, gpu.bf16_tflops, gpu.fp8_tflops, gpu.hbm_tbs, gpu.sms, gpu.nvlink_gbps)


@dataclass(frozen=True)
class Cluster:
    gpu: GPUSpec
    nodes: int
    gpus_per_node: int
    nvlink_copy_gbps: float  # what SM stores or the copy engine achieve per direction, both busy
    nic_gbps: float
    network_efficiency: float = READ["network_efficiency"].value  # achieved share of the NIC's line rate

    @property
    def network_gbps(self) -> float:
        return self.nic_gbps * self.network_efficiency


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
    layout: Layout
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
    overlap: str = "none"  # "none", "chunked", "microbatch" ([moe_comm] overlap), or DualPipeV's (DUALPIPEV)
    # the dataset's document lengths (moe_comm.predict.documents), which a block-causal flavor's
    # attention follows; None: unknown, priced as one document per sequence
    documents: DocumentLengths | None = None
    expert_dtype: str = "bf16"  # [moe_comm] expert_dtype
    combine_grad_dtype: str = "bf16"  # [moe_comm] combine_grad_dtype
    # whether full AC's recompute re-runs dispatch and combine: TorchTitan's own model does (the
    # public anchors); ours never does (moe_comm.titan.recompute replays what the forward returned)
    recompute_comm: bool = False
    recv_capacity_factor: float = 0.0  # [moe_comm] recv_capacity_factor (the memory the recompute keeps)
    cuda_graphs: bool = True  # [moe_comm] cuda_graphs (their pools, for a backend whose calls replay from them)
    # gradient-accumulation steps per optimizer step ([training] global_batch_size over the local
    # batch and the batch's data-parallel degree, as TorchTitan divides it)
    accumulation: int = 1
    loader_workers: int = 0  # [training.dataloader] num_workers (the GPU's idle share at world 1)
    loss_compiled: bool = False  # [compile] enable with "loss" in components: TorchTitan compiles the loss

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
        """Whether the backward re-runs the forward's dispatch and combine: TorchTitan's full AC
        re-runs each block's forward, comm included (its op-level selective AC keeps the comm
        ops' outputs); this project's recompute never does, in any mode."""
        return self.recompute_comm and self.ac_mode == "full"


def routing_for(config, args) -> str:
    """The routing statistic a recipe's run will see."""
    if getattr(config.debug, "moe_force_load_balance", False):
        return "balanced"
    if args.moe_args.num_expert_groups and args.moe_args.num_limited_groups:
        return "node_limited"
    return "random"


def dataset_documents(dataset: str, dataset_path: str | None) -> DocumentLengths | None:
    """The document lengths of a recipe's dataset (moe_comm.predict.documents), None where none
    is known (then attention is priced at one document per sequence, its most)."""
    try:
        return documents.for_recipe(dataset, dataset_path)
    except KeyError:
        return None


def workload_from_recipe(r) -> Workload:
    c = r.config
    args = flavor_args(c)
    mc = c.moe_comm
    return Workload(
        flavor=c.model.flavor, args=args, layout=r.layout, local_batch=c.training.local_batch_size,
        seq_len=c.training.seq_len, microbatch=c.parallelism.pipeline_parallel_microbatch_size,
        ac_mode=c.activation_checkpoint.mode, converters=tuple(c.model.converters),
        routing=routing_for(c, args), num_sms=mc.num_sms, network_sms=mc.network_sms,
        virtual_node_size=mc.virtual_node_size, pp_schedule=c.parallelism.pipeline_parallel_schedule,
        layers_per_stage=c.parallelism.pipeline_parallel_layers_per_stage, overlap=overlap_for(c, r.layout),
        documents=dataset_documents(c.training.dataset, c.training.dataset_path), expert_dtype=mc.expert_dtype,
        combine_grad_dtype=mc.combine_grad_dtype, recompute_comm=c.model.name != OUR_MODEL_NAME,
        recv_capacity_factor=mc.recv_capacity_factor, cuda_graphs=mc.cuda_graphs,
        accumulation=titan_fields.accumulation_steps(c.training, r.layout.dp_replicate, r.layout.dp_shard),
        loader_workers=c.training.dataloader.num_workers,
        loss_compiled=c.compile.enable and "loss" in c.compile.components,
    )


def overlap_for(config, layout) -> str:
    """The MoE overlap a recipe runs: TorchTitan's DualPipeV expert-parallel overlap where it
    applies (PP and EP, schedule DualPipeV, pipeline_parallel_expert_parallel_overlap, its
    default), else [moe_comm] overlap."""
    if dual_pipe_v_overlap(config.parallelism, layout):
        return "dualpipev+chunked" if config.moe_comm.overlap == "chunked" else "dualpipev"
    return config.moe_comm.overlap


def workload_from_spec(spec: dict, cal: Calibration | None = None) -> tuple[Workload, Cluster | None]:
    """A validation figure's workload and cluster (None without a calibration): a recipe (with
    overrides) on a GPU, or the fields of a run that has no recipe here (a public anchor: it ran
    TorchTitan's own model, whose full AC re-runs the comm; its dataset, "c4" unless it says).
    `recompute_comm` marks a run of ours made before the comm-free recompute."""
    if "recipe" in spec:
        from moe_comm import recipe as recipe_mod

        r = recipe_mod.load(str(REPO / spec["recipe"]), list(spec.get("overrides", [])), device="cuda",
                            check_paths=False)
        w = workload_from_recipe(r)
        if "recompute_comm" in spec:
            w = replace(w, recompute_comm=bool(spec["recompute_comm"]))
        return w, cal and cluster_for(spec["gpu"], r.layout.nodes, r.layout.procs_per_node, cal)
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    from moe_comm.layout import flavors

    flavors.register()
    f = spec["workload"]
    nodes, per_node = spec["nodes"], spec["gpus_per_node"]
    world = nodes * per_node
    tp, pp, ep = f.get("tp", 1), f.get("pp", 1), f["ep"]
    layout = Layout(world, nodes, per_node, 1, world // (tp * pp), 1, tp, pp, ep, 1)
    w = Workload(
        flavor=f["flavor"], args=deepseekv3_args[f["flavor"]], layout=layout, local_batch=f["local_batch"],
        seq_len=f["seq_len"], microbatch=f.get("microbatch", 1), ac_mode=f["ac_mode"],
        converters=tuple(f.get("converters", ())), routing=f["routing"], num_sms=f.get("num_sms", 20),
        pp_schedule=f.get("pp_schedule", "1F1B"), layers_per_stage=f.get("layers_per_stage"),
        overlap=f.get("overlap", "none"), documents=dataset_documents(f.get("dataset", "c4"), None),
        recompute_comm=f.get("recompute_comm", True),
    )
    return w, cal and cluster_for(spec["gpu"], nodes, per_node, cal)


def _stats(w: Workload) -> PlanStats:
    m = w.args.moe_args
    return routing_statistics(w.routing, w.layout.ep, w.ranks_per_node, m.num_experts, m.top_k,
                              m.num_expert_groups or 8, m.num_limited_groups or 4)


def busiest_factor(w: Workload, cal: Calibration, inputs: Inputs, backend: str) -> float | None:
    """The busiest EP rank's routed rows over the mean rank's that the workload's routing sees
    (None: the drawn routing's own busiest rank). Forced-balanced routing is exact as drawn (every
    rank the same rows); otherwise the measured factor at the workload's EP, at the scenario's
    statistic (calibration.Imbalance), where it was measured. A backend with fixed receive
    buffers (a symmetric heap: recv_capacity_factor x the balanced load) runs no skew beyond
    them - the run stops with an error naming the field - so its factor stops there."""
    if w.routing == "balanced" or w.layout.ep == 1:
        return 1.0
    if inputs.imbalance == "drawn" or cal.imbalance is None:
        return None
    factor = cal.imbalance.factor(w.layout.ep, inputs.imbalance)
    if backend_class(backend).symmetric_heap and w.recv_capacity_factor > 0:
        factor = min(factor, w.recv_capacity_factor)
    return factor


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
    recomputed: bool  # the forward transfers run again in the backward pass (TorchTitan's full AC)
    stats: PlanStats
    busiest_factor: float | None = None  # the receive side's busiest rank over the mean (None: as drawn)

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


def host_us(costs, name: str, cal: Calibration, inputs: Inputs) -> float:
    """The GPU time one transfer loses to its host synchronisations: measured per call where the
    backend's case was (calibration.HostSync, at the scenario's end of its range); for the NCCL
    transport its per-call cost is measured whole (the comm bench's round trips, counts exchange
    and host syncs included) on the forward dispatch. Where neither, a forward dispatch that makes
    any (its class's stated count) costs what a host-driven call of the all-to-all path costs in
    all, within one kernel launch per round trip (low) and that cost per round trip (high)."""
    measured = cal.host_syncs.get(costs.host_syncs_case)
    if measured and costs.transport != "NCCL":
        return measured[name].cost_us[inputs.host_sync]
    n = costs.host_syncs_per_dispatch
    if name != "dispatch" or not n:
        return 0.0
    if costs.transport == "NCCL":
        return n * cal.nccl_call_us
    return {"low": n * cal.kernel_floor_us, "central": cal.nccl_call_us, "high": n * cal.nccl_call_us}[inputs.host_sync]


def layer_comm(backend: str, w: Workload, cluster: Cluster, cal: Calibration,
               dispatch_dtype: str = "bf16", *, inputs: Inputs | None = None, nic_share: float = 1.0) -> LayerComm:
    """The four transfers of one MoE layer for one microbatch on the slowest rank, priced by the
    backend class's cost traits (moe_comm.backends.base.CostTraits). The receive side (rows in,
    slots, expert rows) is the mean rank's times the busiest-rank factor (`busiest_factor`); the
    send side the drawn routing's busiest rank. `nic_share`: the share of the NIC the EP
    transfers get (FSDP's collectives take the rest while they run)."""
    if backend not in names():
        raise ValueError(f"backend {backend!r}: choose one of {list(names())}")
    cls = backend_class(backend)
    if cls.costs is None:
        raise ValueError(f"backend {backend!r} has no cost traits to price it with")
    if dispatch_dtype not in cls.dispatch_dtypes:
        raise ValueError(f"backend {backend!r} dispatches {' or '.join(cls.dispatch_dtypes)}, not {dispatch_dtype!r}")
    inputs = inputs or cal.scenario()
    costs = cls.costs
    st = _stats(w)
    factor = busiest_factor(w, cal, inputs, backend)
    T = w.tokens_per_call
    hidden = w.args.dim
    hier = costs.hierarchical

    def into(key: str) -> float:  # rows the busiest rank receives
        return T * (st.max[key] if factor is None else st.mean[key] * factor)

    net_rows = max(T * st.max["network_out" if hier else "a2a_network_out"], into("network_in" if hier else "a2a_network_in"))
    nvl_rows = max(T * st.max["nvlink_out" if hier else "a2a_nvlink_out"], into("nvlink_in" if hier else "a2a_nvlink_in"))
    net_in = into("network_in")
    expert_rows = into("expert_rows")
    slots = into("recv_slots")
    spec = [("dispatch", "dispatch", True), ("combine", "combine", True),
            ("combine backward", "dispatch", False), ("dispatch backward", "combine", False)]
    fp8_on = {"dispatch": dispatch_dtype == "fp8", "combine backward": w.combine_grad_dtype == "fp8"}
    transfers = []
    hbm = _hbm_scale(cluster, hidden)
    network_gbps = cluster.network_gbps * nic_share
    for name, kind, forward in spec:
        fp8 = fp8_on.get(name, False)
        rb = row_bytes(hidden, "fp8" if fp8 else "bf16", metadata=hier)
        t = Transfer(name, kind, forward, net_rows, nvl_rows, rb)
        t.host_us = host_us(costs, name, cal, inputs)
        if costs.transport == "NCCL":
            t.nvlink_us = t.nvlink_bytes / (_nccl_nvlink_gbps(cluster, cal) * 1e3)
        else:  # kernels on the backend's SMs, at their measured per-op costs
            op = _kernel_ops(costs.transport, cal)[kind]
            sms = max(w.num_sms, 1)
            nvl_sms = sms if w.ep_nodes == 1 else sms - (w.network_sms or sms // 2)
            t.fixed_us = cal.kernel_floor_us + op.per_token_sm_us * (T + net_in) / sms
            t.nvlink_us = t.nvlink_bytes / (_sm_link_gbps(cluster, nvl_sms, op.link_efficiency) * 1e3)
        t.network_us = t.network_bytes / (network_gbps * 1e3)
        if costs.layout == "TorchTitan":
            t.layout_us = (cal.nccl_row_us if forward else cal.nccl_backward_row_us) / 2 * expert_rows * hbm
        elif costs.layout == "TorchTitan DeepEP":
            per_row = READ["deepep_permute_us_per_row" if kind == "dispatch" else "deepep_unpermute_us_per_row"]
            t.layout_us = per_row.value * expert_rows * hbm
        elif costs.layout == "our kernels":
            per_row, per_slot = cal.expand if kind == "dispatch" else cal.reduce
            t.layout_us = (cal.kernel_floor_us + per_row * expert_rows + per_slot * slots) * hbm
        else:
            raise ValueError(f"backend {backend!r}: no measured cost for layout {costs.layout!r}")
        if fp8:  # the sender quantises its rows: read bf16, write e4m3 + scales
            t.layout_us += T * hidden * 3 / (cal.layout_hbm_efficiency * cluster.gpu.hbm_tbs * 1e6)
        transfers.append(t)
    return LayerComm(cls.label(dispatch_dtype), w.ep_nodes, w.ranks_per_node, transfers, w.comm_recomputed, st, factor)


def _kernel_ops(transport: str, cal: Calibration) -> dict:
    """The measured per-op costs ("dispatch", "combine") of SM-driven kernels."""
    if transport == "our kernels":
        return cal.ops
    if transport == "DeepEP kernels":
        return cal.deepep_ops
    raise ValueError(f"no measured cost for transport {transport!r}")


# ------------------------------------------------------------------------------- the step


OVERLAPS = ("none", "chunked", "microbatch", "dualpipev", "dualpipev+chunked")
# DualPipeV's EP overlap: its pairs alone, or with the chunked overlap in the microbatch-stages
# outside a pair ([moe_comm] overlap = "chunked" beside it: moe_comm.titan.overlap)
DUALPIPEV = ("dualpipev", "dualpipev+chunked")


def moe_comm_overlap(overlap: str) -> str:
    """The [moe_comm] overlap a workload's overlap runs with (`overlap_for` backwards)."""
    return {"dualpipev": "none", "dualpipev+chunked": "chunked"}.get(overlap, overlap)


# the step's terms no GPU idle share applies to: waits on links and on other ranks, not launches
WAITING_TERMS = ("moe comm", "tp comm", "pp p2p", "pp bubble", "fsdp exposed")


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
    # what priced the compute: "layer bench" (moe_comm.predict.layer_compute.BENCH), with what it did not
    # measure and what stood in (moe_comm.predict.layer_compute's notes)
    compute_source: str = "layer bench"
    scenario: str = "central"  # of assumptions.SCENARIOS: the unmeasured inputs it was made at
    host_sync_ms: float = 0.0  # of terms_ms' moe comm: the host synchronisations' exposed share
    tokens_per_step: float = 0.0  # tokens one GPU's step trains (local batch x seq / (cp x tp x pp))

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


def pair_cost(a: float, e: float, sm_share: float) -> tuple[float, float]:
    """(exposed, compute slowdown) of communication `a` issued beside compute `e` on another
    stream: its comm kernels hold sm_share of the GPU while they run, so the compute beside them
    takes e / (1 - sm_share); the pair costs max(a - e, a x sm_share) beyond e - the comm's excess
    where it outlasts the compute, else the compute's stretch while the comm runs."""
    exposed = max(0.0, a - e)
    return exposed, max(a - e, a * sm_share) - exposed


def overlap_exposure(comm_us: tuple[float, float, float, float], compute_us: tuple[float, float, float],
                     sm_share: float) -> tuple[float, float]:
    """(exposed communication, compute slowdown), in us, of one MoE layer's pass under the
    "chunked" overlap: the layer's tokens in two chunks, communication on a side stream, the
    experts on the compute stream. comm_us = (a0, a1, b0, b1): the first op of chunk 0, of chunk 1,
    then the second op of chunk 0, of chunk 1 (forward: dispatch, dispatch, combine, combine);
    compute_us = (s, e0, e1): the shared experts, then the routed experts of chunk 0 and 1. Stream
    order: a0 under s, a1 under e0, b0 under e1, and b1 alone. The backward mirrors it: each op's
    backward runs on its forward's stream in reverse order, so the first ops are the combines'
    backwards (the gradient rows on their way to the experts), the second the dispatches'
    backwards, each chunk's under the other chunk's routed experts' backward, and the same
    function prices it with those ops and that compute (`pair_cost` each)."""
    a0, a1, b0, b1 = comm_us
    s, e0, e1 = compute_us
    exposed, slowdown = b1, 0.0
    for a, e in ((a0, s), (a1, e0), (b0, e1)):
        x, slow = pair_cost(a, e, sm_share)
        exposed += x
        slowdown += slow
    return exposed, slowdown


def microbatch_pair_exposure(comm_us: dict, layer_ms: dict, sm_share: float) -> dict:
    """(exposed, slowdown) of one MoE layer's communication in an overlapped pair of [moe_comm]
    overlap = "microbatch" (moe_comm.titan.pipeline's docstring: what hides behind what), per
    thread: "f" the forward's transfers, "b" the backward's. comm_us: per transfer name its time;
    layer_ms: per layer part (moe_layer of layer_compute.RankCompute) its (fwd, bwd, recompute).
    forward dispatch       behind the other microbatch's routed experts' backward;
    backward dispatch      behind the routed experts' forward;
    forward combine        behind the rest of the other block's backward (attention, router,
                           norms), the shared experts' backward and, under AC, the block's
                           recompute, which runs inline there;
    combine's backward     behind the shared experts' forward and the next block's attention,
                           router and norms forward."""
    def part(name, i):
        return layer_ms.get(name, (0.0, 0.0, 0.0))[i]

    rest = ("attention.core", "attention.projections", "router", "rmsnorm", "residual_add")
    norms = 2  # each block runs two norms and two residual adds
    fwd_rest = sum(part(p, 0) * (norms if p in ("rmsnorm", "residual_add") else 1) for p in rest)
    bwd_rest = sum(part(p, 1) * (norms if p in ("rmsnorm", "residual_add") else 1) for p in rest)
    recompute = sum(v[2] * (norms if p in ("rmsnorm", "residual_add") else 1) for p, v in layer_ms.items())
    pairs = {"f": ((comm_us["dispatch"], part("experts", 1)),
                   (comm_us["combine"], bwd_rest + part("shared_expert", 1) + recompute)),
             "b": ((comm_us["dispatch backward"], part("experts", 0)),
                   (comm_us["combine backward"], part("shared_expert", 0) + fwd_rest))}
    out = {}
    for thread, both in pairs.items():
        costs = [pair_cost(a, e, sm_share) for a, e in both]
        out[thread] = (sum(c[0] for c in costs), sum(c[1] for c in costs))
    return out


def _chunk_us(t: Transfer) -> float:
    """One transfer for half the tokens: the per-call costs whole, half the rows to move."""
    return t.host_us + t.fixed_us + (max(t.nvlink_us, t.network_us) + t.layout_us) / 2


def _fsdp_ms(w: Workload, cluster: Cluster, cal: Calibration, v: int) -> tuple[float, float, float]:
    """(total, exposed at best, over the network) FSDP collective time per step: bf16 all-gathers
    (twice without PP: TorchTitan reshards after forward) and fp32 reduce-scatters, over NVLink or
    the network. Without PP one unit's all-gather and reduce-scatter are not hidden (the first and
    last); with PP each stage chunk unshards once before its first forward and reduces once after
    its last backward, so one chunk's are (1/v of the rank's)."""
    a, lay = w.args, w.layout
    p = estimate.count_params(a)
    routed = estimate.expert_params(a, a.moe_args.num_experts) * (a.n_layers - a.n_dense_layers)
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
    network = total if spans_nodes else 0.0
    if lay.pp > 1:
        return total, total / v, network
    units = a.n_layers + 1
    return total, total / units * READ["fsdp_prefetch_units"].value * 2, network


def _pp_rate_gbps(w: Workload, cluster: Cluster, cal: Calibration) -> float:
    """Neighbouring pipeline ranks are world / pp ranks apart (PP is TorchTitan's outermost mesh
    dimension): on other nodes unless a node holds more than that."""
    apart = w.layout.world // w.layout.pp
    return cluster.network_gbps if apart >= cluster.gpus_per_node else _nccl_nvlink_gbps(cluster, cal)


# the most of the NIC the FSDP collectives beside the EP transfers are taken to hold
MAX_FSDP_NIC_SHARE = 0.5


def idle_ratio(w: Workload, cal: Calibration, inputs: Inputs, scenario: str) -> float:
    """The GPU's idle per busy second of the workload's step: the central share is one GPU's own
    where a single GPU's batch loads in a dataloader worker (its step is GPU-bound: measured
    there), the multi-GPU profile's elsewhere; the range's ends stand for every workload."""
    if (scenario == "central" and w.layout.world == 1 and w.loader_workers > 0
            and cal.one_gpu_idle_ratio is not None):
        return cal.one_gpu_idle_ratio
    return inputs.idle_ratio


def predict(backend: str, w: Workload, cluster: Cluster, cal: Calibration, dispatch_dtype: str = "bf16",
            scenario: str = "central") -> StepPrediction:
    """A step on the busiest pipeline rank, per microbatch split into forward f, input gradient
    bi (with any recompute) and weight gradient bw, which the schedule turns into a bubble
    (moe_comm.predict.schedule); the microbatches' work, the bubble, the optimizer, FSDP's
    exposed collectives and the GPU's idle share of its compute add up to the step. `scenario`:
    the unmeasured inputs' values it is made at (assumptions.SCENARIOS; `predict_range` all)."""
    a, lay, gpu = w.args, w.layout, cluster.gpu
    if w.overlap not in OVERLAPS:
        raise ValueError(f"overlap {w.overlap!r}: choose one of {OVERLAPS}")
    inputs = cal.scenario(scenario)
    cluster = replace(cluster, network_efficiency=inputs.network_efficiency)
    ranks = estimate.pipeline_ranks(a, lay, w.local_batch, w.microbatch, w.pp_schedule, w.layers_per_stage)
    pipe = ranks[0].pipe
    if w.overlap in DUALPIPEV and pipe.name != "DualPipeV":
        raise ValueError("the DualPipeV expert-parallel overlap needs pipeline_parallel_schedule DualPipeV")
    if w.overlap == "microbatch" and (pipe.name != "Interleaved1F1B" or lay.pp == 1):
        raise ValueError("the microbatch overlap runs pipeline_parallel_schedule Interleaved1F1B with PP "
                         "(moe_comm.titan.pipeline)")
    T = w.tokens_per_call
    if cal.layer_bench is None:
        raise ValueError("the step model prices compute from the layer benchmark (layer_compute.BENCH, "
                         "moe_comm.predict.layer_compute); this calibration has none")
    factor = busiest_factor(w, cal, inputs, backend)
    # the GPU share an overlapped comm kernel takes from the GEMMs beside it (NCCL's channels are
    # assumed to take the same num_sms)
    sm_share = w.num_sms / gpu.sms
    zero_bubble = pipe.name in schedule.ZERO_BUBBLE
    pp_rate = _pp_rate_gbps(w, cluster, cal) if lay.pp > 1 else 0.0
    m = pipe.microbatches if lay.pp > 1 else 1

    notes: list[str] = []  # what the layer benchmark did not measure, and what stood in
    hbm_rate = cal.layout_hbm_efficiency * gpu.hbm_tbs * 1e12  # what the optimizer and copies reach
    chunk_f, chunk_b = (b / hbm_rate for b in estimate.chunked_expert_bytes(a, lay)) \
        if w.overlap in ("chunked", "dualpipev+chunked") else (0.0, 0.0)
    computed = {r.rank: layer_compute.rank_ms(cal.layer_bench, w, gpu.name, r.layers, r.embedding, r.output,
                                              peak_share=inputs.peak_share, imbalance=factor) for r in ranks}
    for c in computed.values():
        notes.extend(n for n in c.notes if n not in notes)
    # FSDP's collectives run beside the compute, on the NIC the EP transfers use where both cross
    # nodes: they take their share of it while they run (spread over the busiest rank's compute)
    fsdp_total_ms, fsdp_least_ms, fsdp_network_ms = _fsdp_ms(w, cluster, cal, pipe.v)
    compute_ms = max(sum(sum(v) for v in c.terms.values()) for c in computed.values()) * m
    nic_share = 1.0
    if w.ep_nodes > 1 and fsdp_network_ms:
        nic_share = 1.0 - min(MAX_FSDP_NIC_SHARE, fsdp_network_ms / compute_ms)
    comm = layer_comm(backend, w, cluster, cal, dispatch_dtype, inputs=inputs, nic_share=nic_share)
    t_d, t_c, t_cb, t_db = (t.time_us * 1e-6 for t in comm.transfers)
    h_d, h_c, h_cb, h_db = (t.host_us * 1e-6 for t in comm.transfers)

    def per_microbatch(rank) -> dict:
        """Seconds per microbatch on one rank, each as (f, bi, bw)."""
        measured = computed[rank.rank]
        terms = measured.seconds()
        rec = {t: v / 1e3 for t, v in measured.recompute.items()}
        layer = {p: tuple(x / 1e3 for x in v) for p, v in measured.moe_layer.items()}
        shared, experts = layer["shared_expert"][0], layer["experts"][0]
        n_layers = len(rank.layers)
        # one MoE layer: its comm, exposed and hidden, and the compute it can hide behind, in
        # each way a microbatch-stage can run it, weighted by the stages that run it so
        bwd = 1.0 if zero_bubble else 2.0  # the experts' backward beside the comm: dgrad (+ wgrad)
        plain = {"fwd": t_d + t_c, "bwd": t_cb + t_db, "hidden": {"f": 0.0, "b": 0.0}, "slow": {"f": 0.0, "b": 0.0},
                 "host": {"f": h_d + h_c, "b": h_cb + h_db}, "chunk_work": 0.0}

        def chunked() -> dict:
            cd, cc, ccb, cdb = (_chunk_us(t) * 1e-6 for t in comm.transfers)
            fwd_all, bwd_all = 2 * (cd + cc), 2 * (ccb + cdb)  # what runs: every op twice, per chunk
            ef, sf = overlap_exposure((cd, cd, cc, cc), (shared, experts / 2, experts / 2), sm_share)
            eb, sb = overlap_exposure((ccb, ccb, cdb, cdb), (bwd * shared, bwd * experts / 2, bwd * experts / 2),
                                      sm_share)
            return {"fwd": fwd_all, "bwd": bwd_all, "hidden": {"f": fwd_all - ef, "b": bwd_all - eb},
                    "slow": {"f": sf, "b": sb}, "host": {k: 2 * v for k, v in plain["host"].items()},
                    "chunk_work": 1.0}

        def paired() -> dict:
            x = microbatch_pair_exposure({t.name: t.time_us * 1e-6 for t in comm.transfers}, layer, sm_share)
            return {"fwd": plain["fwd"], "bwd": plain["bwd"],
                    "hidden": {"f": plain["fwd"] - x["f"][0], "b": plain["bwd"] - x["b"][0]},
                    "slow": {"f": x["f"][1], "b": x["b"][1]},
                    "host": {k: min(v, x[k][0]) for k, v in plain["host"].items()}, "chunk_work": 0.0}

        if w.overlap == "chunked":
            ways = [(1.0, chunked())]
        elif w.overlap in ("microbatch",) + DUALPIPEV:
            # the rank's share of forward and backward microbatch-stages in an overlapped pair; both
            # run TorchTitan's overlap callback with the same sync points (moe_comm.titan.overlap);
            # the others run unpaired: plainly, or chunked ("dualpipev+chunked")
            pairs = pipe.microbatch_pairs(rank.rank) if w.overlap == "microbatch" else pipe.overlapped_pairs
            share = pairs / (pipe.microbatches * pipe.v)
            ways = [(share, paired()), (1 - share, chunked() if w.overlap == "dualpipev+chunked" else plain)]
        else:
            ways = [(1.0, plain)]

        def blend(key, sub=None):
            return sum(wt * (way[key] if sub is None else way[key][sub]) for wt, way in ways)

        fwd_all, bwd_all = blend("fwd"), blend("bwd")
        hidden = {k: blend("hidden", k) for k in ("f", "b")}
        slow = {k: blend("slow", k) for k in ("f", "b")}
        host = {k: blend("host", k) for k in ("f", "b")}
        chunk_work = blend("chunk_work")
        L = sum(1 for i in rank.layers if i >= a.n_dense_layers)
        again = 1.0 if w.comm_recomputed else 0.0  # TorchTitan's full AC runs the forward's transfers again
        moe_f = L * (fwd_all - hidden["f"])
        moe_b = L * (bwd_all - hidden["b"] + again * (fwd_all - hidden["f"]))
        slow_f = L * slow["f"]
        slow_b = L * (slow["b"] + again * slow["f"])
        terms["moe comm"] = (moe_f, moe_b, 0.0)
        terms["comm SM contention"] = (slow_f, slow_b, 0.0)
        # the experts once per chunk: the weight gradients added, weights re-cast under autocast
        terms["chunked weight work"] = (L * chunk_work * chunk_f, 0.0, L * chunk_work * chunk_b)
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
        hid = L * (hidden["f"] + hidden["b"] + again * hidden["f"])
        return {"terms": terms, "hidden": hid, "moe_layers": L, "rank": rank, "recompute": rec,
                "host": L * (host["f"] + host["b"] + again * host["f"]),
                "moe_all": L * (fwd_all + bwd_all + again * fwd_all)}

    work = max((per_microbatch(r) for r in ranks), key=lambda x: sum(sum(v) for v in x["terms"].values()))
    terms3 = work["terms"]
    f = sum(v[0] for v in terms3.values())
    bi = sum(v[1] for v in terms3.values())
    bw = sum(v[2] for v in terms3.values())
    p = estimate.count_params(a)
    opt_s = optimizer_bytes(p.total / (lay.dp_shard * lay.cp * lay.tp * lay.pp)) / hbm_rate
    copies_s = estimate.param_copy_bytes(a, lay, work["rank"] if lay.pp > 1 else None, m) / hbm_rate
    rank_compute_ms = sum(sum(terms3[k]) for k in ("gemm", "attention", "memory-bound")) * m * 1e3
    fsdp_exposed_ms = min(fsdp_total_ms, fsdp_least_ms + max(0.0, fsdp_total_ms - rank_compute_ms))
    terms = {k: sum(v) * m * 1e3 for k, v in terms3.items()}
    terms["pp bubble"] = pipe.bubble(f, bi, bw) * 1e3 if lay.pp > 1 else 0.0
    terms["optimizer"] = opt_s * 1e3
    terms["param copies"] = copies_s * 1e3
    terms["fsdp exposed"] = fsdp_exposed_ms
    # launch gaps and host work scale with the kernels the GPU runs, not with its waits on links,
    # other ranks or the bubble (the host synchronisations are priced in the transfers)
    terms["idle"] = sum(v for k, v in terms.items() if k not in WAITING_TERMS) * idle_ratio(w, cal, inputs, scenario)
    step_ms = sum(terms.values())
    tokens = w.local_batch * w.seq_len / (lay.cp * lay.tp * lay.pp)
    tps = tokens / (step_ms * 1e-3)
    flops = p.flops_per_token(a, w.seq_len)
    mfu = 100 * flops * tps / (gpu.bf16_tflops * 1e12)
    return StepPrediction(
        backend=comm.backend, comm=comm, terms_ms=terms,
        overlapped_ms={"fsdp": fsdp_total_ms - fsdp_exposed_ms, "moe comm": work["hidden"] * m * 1e3},
        step_ms=step_ms, tokens_per_s_per_gpu=tps, mfu=mfu, moe_calls_per_step=work["moe_layers"] * m,
        pipeline=pipe, moe_comm_ms=work["moe_all"] * m * 1e3, peak_tflops=gpu.bf16_tflops,
        recompute_ms={k: v * m * 1e3 for k, v in work["recompute"].items()},
        compute_source="layer bench" + (f" (not measured there: {'; '.join(notes)})" if notes else ""),
        scenario=scenario, host_sync_ms=work["host"] * m * 1e3, tokens_per_step=tokens,
    )


@dataclass(frozen=True)
class PredictionRange:
    """A prediction at each scenario of the unmeasured inputs (assumptions.SCENARIOS)."""

    low: StepPrediction
    central: StepPrediction
    high: StepPrediction

    def span(self, attr: str = "tokens_per_s_per_gpu") -> tuple[float, float, float]:
        """(low, central, high) of a StepPrediction figure, in the scenarios' order."""
        return tuple(getattr(getattr(self, s), attr) for s in SCENARIOS)

    def overlaps(self, other: "PredictionRange") -> bool:
        """Whether the two tokens/s ranges overlap: the model cannot tell which is faster."""
        lo, _, hi = self.span()
        lo2, _, hi2 = other.span()
        return lo <= hi2 and lo2 <= hi


def predict_range(backend: str, w: Workload, cluster: Cluster, cal: Calibration,
                  dispatch_dtype: str = "bf16") -> PredictionRange:
    """The prediction at the pessimistic end of every unmeasured input, at their central values,
    and at the optimistic end."""
    return PredictionRange(*(predict(backend, w, cluster, cal, dispatch_dtype, s) for s in SCENARIOS))


# Whose kept tensors (estimate.comm_kept_bytes) a backend's recompute holds, by its transport.
KEPT_BY_TRANSPORT = {"our kernels": "nvshmem", "DeepEP kernels": "deepep", "NCCL": "nccl"}


def comm_kept_per_layer(w: Workload, backend: str) -> float:
    """Bytes activation checkpointing keeps per MoE layer and microbatch so that the recompute
    runs no dispatch or combine (moe_comm.titan.recompute; estimate.comm_kept_bytes, for the
    backend's transport); 0 where the recompute re-runs them (TorchTitan's own model)."""
    if w.recompute_comm or w.ac_mode == "none" or w.layout.ep < 1:
        return 0.0
    kind = KEPT_BY_TRANSPORT[backend_class(backend).costs.transport]
    # what a chunked call keeps is the larger: the stages outside DualPipeV's pairs may run chunked
    overlap = moe_comm_overlap(w.overlap)
    return estimate.comm_kept_bytes(w.args, w.tokens_per_call, w.layout.ep, kind, overlap=overlap,
                                    recv_capacity_factor=w.recv_capacity_factor, ranks_per_node=w.ranks_per_node)


def memory(w: Workload, backend: str) -> estimate.MemoryEstimate:
    """The memory estimate of a workload run by `backend`: what its recompute keeps of each MoE
    layer's communication, the microbatch overlap's one more microbatch-stage in flight, and the
    CUDA graph pools of a backend whose MoE calls replay from graphs (our kernels'), and the FP8
    experts' e4m3 weights where the run keeps them over the step."""
    graphs = (estimate.call_graph_bytes(w.args, w.tokens_per_call, w.layout.ep, w.recv_capacity_factor)
              if w.cuda_graphs and backend_class(backend).call_graphs else 0.0)
    kept = forward = 0.0
    if w.expert_dtype == "fp8":
        shape = (w.args.moe_args.num_experts // max(w.layout.ep, 1), w.args.dim, w.args.moe_inter_dim)
        forward = fp8_experts.forward_weight_bytes(*shape)
        if fp8_experts.caches_weights(w.microbatches * w.accumulation, w.ac_mode, w.layout.experts_sharded):
            kept = fp8_experts.cached_weight_bytes(*shape)
    return estimate.memory_per_gpu(
        w.args, w.layout, w.local_batch, w.seq_len, w.ac_mode, w.microbatch, w.pp_schedule, w.layers_per_stage,
        comm_kept_per_layer=comm_kept_per_layer(w, backend), extra_chunks=1 if w.overlap == "microbatch" else 0,
        call_graphs_per_layer=graphs, fp8_weights_per_layer=kept, fp8_forward_weights_per_layer=forward,
        loss_compiled=w.loss_compiled)


def bench_round_trip(backend: str, tokens: int, hidden: int, top_k: int, experts: int, routing: str, world: int,
                     num_sms: int, cluster: Cluster, cal: Calibration) -> dict:
    """experiments/bench_comm.py's forward dispatch and combine (no backward, one node)."""
    from torchtitan.models.moe import MoEArgs

    args = MoEShape(hidden, MoEArgs(num_experts=experts, top_k=top_k))
    lay = Layout(world, 1, world, 1, world, 1, 1, 1, world, 1)
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


def run_plan_for(backend: str, w: Workload, dispatch_dtype: str = "bf16") -> RunPlan:
    """What the backend's `check_run` is asked about a workload: its layout, flavor, converters,
    AC and [moe_comm] settings as the model has them, on GPUs. Its ranks run on the cluster the
    model prices, not in this Python environment, so nothing is imported here to check them."""
    a, lay = w.args, w.layout
    options = MoEComm(backend=backend, num_sms=w.num_sms, network_sms=w.network_sms,
                      virtual_node_size=w.virtual_node_size, dispatch_dtype=dispatch_dtype,
                      overlap=moe_comm_overlap(w.overlap), expert_dtype=w.expert_dtype,
                      combine_grad_dtype=w.combine_grad_dtype)
    return RunPlan(options=options, device="cuda", ep=lay.ep, ranks_per_node=lay.procs_per_node, nodes=lay.nodes,
                   num_experts=a.moe_args.num_experts, top_k=a.moe_args.top_k, hidden=a.dim,
                   score_before_experts=a.moe_args.score_before_experts, converters=tuple(w.converters),
                   python_env="the cluster the model prices", activation_checkpoint=w.ac_mode,
                   dual_pipe_v=w.overlap in DUALPIPEV, pp=lay.pp, pp_schedule=w.pp_schedule)


def refusal(backend: str, w: Workload, dispatch_dtype: str = "bf16") -> str:
    """Why `check` would refuse the backend for the workload ("" where it runs): its class's
    `check_run`, the rules `check`, `submit` and `train` ask before launch."""
    try:
        backend_class(backend).check_run(run_plan_for(backend, w, dispatch_dtype))
    except RecipeError as e:
        return f"refused: {e}"
    return ""


def runnable(backend: str, w: Workload, dispatch_dtype: str = "bf16") -> bool:
    return not refusal(backend, w, dispatch_dtype)
