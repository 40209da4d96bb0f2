"""The `[moe_comm]` recipe section, merged into TorchTitan's JobConfig.

TorchTitan imports this module through `[job] custom_config_module = "moe_comm.config"` and merges
the dataclass named `JobConfig` into its own, so a recipe stays one TorchTitan TOML file.
"""

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class MoEComm:
    backend: str = "nccl"
    """Which backend moves MoE tokens: one of moe_comm.backends' registry, which the recipe is
    checked against before launch: nccl (TorchTitan's all-to-all; gloo on CPU), nvshmem (this
    project's CUDA kernels) or deepep (DeepEP, installed from source)."""

    num_sms: int = 20
    """SMs the nvshmem/deepep kernels may use; the rest stay free for compute."""

    max_tokens_per_rank: int = 0
    """Most tokens one rank routes through an MoE layer at once; 0 means local_batch_size *
    seq_len. Sizes the symmetric buffers once at start-up (for half of it under overlap =
    "chunked", where each dispatch carries one half)."""

    recv_capacity_factor: float = 0.0
    """Rows each rank can receive, as a multiple of the balanced load
    (max_tokens_per_rank * top_k). 0 means the exact worst case, every source rank sending all
    its tokens here: max_tokens_per_rank * ep_size * min(top_k, local experts). Routed rows
    beyond capacity raise an error naming this field; they are never dropped."""

    dispatch_dtype: Literal["bf16", "fp8"] = "bf16"
    """What dispatch puts on the links (nvshmem backend): "bf16" sends the model's rows as they
    are; "fp8" sends e4m3 rows with one fp32 scale per 128 channels, quantised by the sender and
    dequantised into bf16 by the receiver's expert-major layout kernel (half the bytes on every
    link). Combine and every backward transfer stay bf16 (combine_grad_dtype is the backward's
    option). With expert_dtype = "fp8" the sender scales each row by one fp32 scale instead (the
    same wire format, every group carrying it) and the rows stay e4m3 to the experts."""

    expert_dtype: Literal["bf16", "fp8"] = "bf16"
    """The routed experts' grouped GEMMs (nvshmem backend, Hopper GPUs). "bf16": TorchTitan's.
    "fp8": forward, dgrad and wgrad GEMMs in e4m3 through torch._scaled_grouped_mm with rowwise
    fp32 scales (moe_comm.fp8_experts says which and why): each row of the experts' input one
    scale, quantised once (by the sender with dispatch_dtype = "fp8", by the receiver's layout
    kernel with "bf16") and kept to the GEMM; the weights one scale per output channel per
    expert, quantised from the bf16 weights once per optimizer step where the experts run more
    than once per step (microbatches, AC's recompute) or their weights stay whole between steps
    (no EP, FSDP or TP: made right after each optimizer step, while the host logs the step;
    fp8_experts.WeightCache, in check's memory estimate), else at each forward. Refused where it cannot run: CPU,
    GPUs other than Hopper (a B200's FP8 recipe is MXFP8 through [model] converters =
    ["quantize.grouped_mm.mx"]), backends that cannot feed e4m3 rows, with a grouped_mm
    converter, and with an overlap other than "none"."""

    combine_grad_dtype: Literal["bf16", "fp8"] = "bf16"
    """What combine's backward puts on the links (nvshmem backend): the output gradient's rows on
    their way to the experts, dispatch-shaped. "fp8": e4m3 with one fp32 scale per 128 channels
    (FP8 dispatch's wire format), quantised by the sender at every EP size, world 1 included (so
    one GPU measures its accuracy), dequantised to bf16 by the receiver's layout kernel: half the
    bytes. Off by default: DeepSeek-V3 kept this gradient in bf16 (results/fp8_dispatch_accuracy.md
    has the measured loss)."""

    virtual_node_size: int = 0
    """Ranks per node as the nvshmem kernels see it; 0 means the real node (the ranks that share
    a host). Set it below the real node size to run the inter-node protocol (network hop, then
    NVLink forwarding) between groups of ranks of one machine, e.g. to test it on one node."""

    network_sms: int = 0
    """Of num_sms, the SMs that drive the network hop when the EP group spans nodes (the rest
    forward over NVLink); 0 means half of num_sms."""

    wait_timeout_s: float = 30.0
    """Longest a communication kernel waits for a peer before it gives up and the step fails
    with an error naming the kernel, the phase and the peer (nvshmem backend). Never 0: a wait
    without a bound is a silent hang."""

    overlap: Literal["none", "chunked", "microbatch"] = "none"
    """How the MoE communication meets compute (moe_comm.titan.overlap). "none": dispatch and
    combine run on the compute stream, as TorchTitan runs them. "chunked": each MoE layer
    splits its tokens in two halves whose dispatch and combine run on a side stream (the
    nvshmem/deepep kernels on their num_sms) while the other half's experts and the shared
    experts compute; works with activation checkpointing and any pipeline schedule. The two
    halves hold the same expert activations as one whole (plus each expert's alignment padding
    twice), and the nvshmem buffers are sized for one half. "microbatch": in the steady state of
    pipeline_parallel_schedule = "Interleaved1F1B", one microbatch's forward and another's
    backward on two different stages of the rank run as one overlapped action, each one's
    dispatch and combine on the side stream while the other computes (moe_comm.titan.pipeline);
    needs expert and pipeline parallelism, and holds one more microbatch-stage in flight.
    DualPipeV's own EP overlap ([parallelism] pipeline_parallel_expert_parallel_overlap) is the
    same idea on its own schedule. Choose one of the three."""

    log_expert_counts: bool = False
    """Write each MoE layer's routed tokens per expert, every training step, to
    {dump_folder}/expert_counts/rank{R}.jsonl (moe_comm.metrics.expert_counts; one small
    device-to-host copy per step line). experiments/routing_imbalance.py reads them. Not a backend
    option: it observes the router, whatever the backend."""

    cuda_graphs: bool = True
    """Replay each MoE call (dispatch, combine and their backwards) from a CUDA graph of its own
    (nvshmem backend: moe_comm.kernels.call_graphs), which takes its launches and Python off the
    host's path. Each graph keeps its outputs, about two expert-row tensors per MoE layer and call
    kind (`check` counts them): false gives that memory back where a layout needs it."""

    peak_tflops: float = 0.0
    """Peak dense TFLOPS of one GPU for MFU; 0 means look it up from the GPU's name
    (moe_comm.metrics.peaks). Set it for a GPU the table does not know, or MFU is not logged."""


@dataclass
class Cluster:
    """Where `python -m moe_comm submit` sends the recipe (Slurm; Soperator on Nebius).

    `submit` renders slurm/train.sbatch from these fields; `--cluster.FIELD VALUE` on its
    command line overrides any of them (`--nodes N` is short for `--cluster.nodes N`)."""

    nodes: int = 1
    """Slurm nodes; nodes * gpus_per_node must match the recipe's parallel layout."""
    gpus_per_node: int = 8
    """Training processes per node: one per GPU (on CPU recipes, simply the process count)."""
    gpu: str = ""
    """GPU model of the nodes ("B200", "H200", "H100"; moe_comm.gpus): `check` gives its memory
    verdict and bounds the SM budget with it before launch. Empty means not known until the
    job starts, where the real device is checked."""
    request_gpus: bool = True
    """Ask Slurm for gpus_per_node GPUs per node (#SBATCH --gpus-per-node). False for CPU
    recipes, where gpus_per_node only counts processes."""
    partition: str = ""
    """Slurm partition; empty means the cluster's default partition."""
    time: str = "04:00:00"
    """Wall-clock limit (#SBATCH --time), [D-]HH:MM:SS."""
    account: str = ""
    """Slurm account to charge; empty means the user's default."""
    job_name: str = ""
    """Slurm job name; empty means the run's name, derived from its identity (recipe, backend and
    its options, nodes, batch...: moe_comm.metrics.naming). The job dumps into
    {job.dump_folder}/{job_name}: its own checkpoints and metrics, found again by a requeue or a
    resubmit of the same run, never by a run with another identity."""
    venv: str = ""
    """Python environment on the shared jail filesystem, e.g. /opt/venvs/moe-comm. Empty means
    the venv `submit` runs from (login and worker nodes share the jail, so the path is valid)."""
    container_image: str = ""
    """A pyxis/enroot image instead of a venv, passed to `srun --container-image` (not to
    #SBATCH: pyxis would run the batch script itself in the container, where srun is missing)."""
    container_mounts: str = ""
    """pyxis --container-mounts; empty mounts the repository at the same path."""
    env_file: str = "slurm/env/nebius-b200.sh"
    """NCCL/NVSHMEM environment for the platform, sourced by the job (relative to the repo)."""
    requeue: bool = True
    """#SBATCH --requeue, and checkpointing forced on so a requeued job resumes from the last
    checkpoint in the same dump folder (`moe_comm train` skips one that cannot resume)."""
    sbatch_args: list[str] = field(default_factory=list)
    """Extra #SBATCH options, e.g. ["--qos=high", "--reservation=r1"]."""


@dataclass
class Assets:
    """Where `python -m moe_comm assets RECIPE` fetches the files the recipe reads from disk:
    the Hugging Face hub, once, into the recipe's own folders (on a cluster: its shared
    storage), so no rank downloads anything at start-up."""

    tokenizer_repo: str = ""
    """Hub model repo whose tokenizer goes into [model] hf_assets_path, e.g.
    "deepseek-ai/DeepSeek-V3". Empty: the files are put there by hand (assets/tiny ships them)."""
    tokenizer_files: list[str] = field(default_factory=lambda: ["tokenizer.json", "tokenizer_config.json"])
    """The files of tokenizer_repo that TorchTitan's tokenizer reads."""
    dataset_repo: str = ""
    """Hub dataset repo staged into [training] dataset_path (a local folder), e.g. "allenai/c4".
    Empty: dataset_path is a folder already there, or a hub id streamed at start-up."""
    dataset_files: list[str] = field(default_factory=list)
    """Which files of dataset_repo to stage: huggingface_hub allow-patterns, e.g.
    ["en/c4-train.0000?-of-01024.json.gz"]."""
    dataset_config: str = "default"
    """The configuration name the staged files are declared as (in the folder's dataset card):
    the `name` TorchTitan's loader passes to load_dataset ("en" for its c4 loader)."""


@dataclass
class JobConfig:
    moe_comm: MoEComm = field(default_factory=MoEComm)
    cluster: Cluster = field(default_factory=Cluster)
    assets: Assets = field(default_factory=Assets)
