"""The run's layout: the model flavor, the parallel degrees and the rules they must keep, and
the plan a backend is checked against. The lowest room of the house that knows about a run:
titan/, predict/, recipe loading and the verbs import it; it imports only errors, config and
TorchTitan.

  flavor_args     the recipe's [model] flavor (TorchTitan's, or ours: moe_comm.layout.flavors)
  resolve_layout  the process count and parallel degrees (`Layout`), checked the way TorchTitan's
                  ParallelDims will check them
  check_layout    what our train spec (TorchTitan's deepseek_v3 parallelize with our EP hook) runs
  run_plan        what is known about a run before its backend starts (`RunPlan`), which the
                  backend's `check_run` is asked with

`check`, `submit` and `train` ask these before launch (through moe_comm.recipe.load), the model
build asks them again with what the ranks see (moe_comm.titan.parallelize), and the scale model
prices the same `Layout`.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field

from moe_comm.config import MoEComm
from moe_comm.errors import RecipeError

# The train spec moe_comm.titan registers: DeepSeek-V3 with the [moe_comm] backend in its MoE layers.
OUR_MODEL_NAME = "deepseek_v3_moe_comm"


@dataclass
class Layout:
    """The resolved parallel layout (TorchTitan's ParallelDims degrees) and its process count."""

    world: int
    nodes: int
    procs_per_node: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    etp: int

    @property
    def efsdp(self) -> int:
        return self.dp_shard * self.cp * self.tp // (self.etp * self.ep)

    @property
    def experts_sharded(self) -> bool:
        """Whether the routed experts' weights are DTensor shards (EP, FSDP or TP over them): whole
        only while FSDP gathers them for a forward, not between steps."""
        return self.ep * self.efsdp * self.etp > 1


@dataclass(frozen=True)
class RunPlan:
    """What is known about a run before its backend starts, for `CommBackend.check_run`.

    moe_comm.recipe builds it before launch (`check`, `submit`, `train` before torchrun) from the
    recipe's content and this machine; the model build builds it again with what the ranks see,
    and every backend when it is built, from its live process group and device. Fields the
    caller cannot know are left at their "unknown" value (0, "", None), and a check that needs
    them says what it could not verify instead of guessing.
    """

    options: MoEComm  # the [moe_comm] section, overrides applied
    device: str  # "cuda" or "cpu": where the ranks run
    ep: int  # ranks in one EP group
    ranks_per_node: int  # processes per real node
    nodes: int  # nodes in the job
    num_experts: int
    top_k: int
    hidden: int
    score_before_experts: bool = False
    tokens_per_rank: int = 0  # tokens one rank routes per MoE call (0: unknown)
    param_dtype: str = ""  # [training] mixed_precision_param ("": unknown)
    converters: tuple[str, ...] = ()
    gpu: str = ""  # GPU model or device name ("": unknown before launch)
    gpu_sms: int = 0  # its SM count (0: unknown)
    launch_env: Mapping[str, str] | None = field(default=None, compare=False)
    """The environment the ranks start with (None: unknown), e.g. what [cluster] env_file sets."""
    launch_env_source: str = "the launch environment"  # where launch_env comes from, for messages
    python_env: str = ""  # "": the ranks run in this Python environment; else where they run
    activation_checkpoint: str = ""  # [activation_checkpoint] mode ("": unknown)
    dual_pipe_v: bool = False
    """TorchTitan's DualPipeV EP overlap is on: pipeline and expert parallelism, [parallelism]
    pipeline_parallel_schedule = "DualPipeV" and pipeline_parallel_expert_parallel_overlap."""
    pp: int = 0  # pipeline_parallel_degree (0: unknown)
    pp_schedule: str = ""  # [parallelism] pipeline_parallel_schedule ("": unknown)

    @property
    def ep_nodes(self) -> int:
        """Real nodes one EP group spans (EP groups are consecutive ranks)."""
        return max(1, -(-self.ep // self.ranks_per_node))


def flavor_args(config):
    """The DeepSeekV3ModelArgs of the recipe's [model] flavor: TorchTitan's, or one of ours
    (moe_comm.layout.flavors), registered with TorchTitan's on first use."""
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    from moe_comm.layout import flavors

    flavors.register()
    if config.model.flavor not in deepseekv3_args:
        raise RecipeError(
            f"[model] flavor = {config.model.flavor!r} is not a DeepSeek-V3 flavor; "
            f"choose one of {sorted(deepseekv3_args)}"
        )
    return deepseekv3_args[config.model.flavor]


def resolve_layout(config, nnodes: int | None, nproc_per_node: int | None) -> Layout:
    """The process count and parallel degrees, checked the way TorchTitan's ParallelDims will."""
    p = config.parallelism
    nodes = nnodes if nnodes is not None else config.cluster.nodes
    per_node = nproc_per_node if nproc_per_node is not None else config.cluster.gpus_per_node
    if nodes < 1:
        raise RecipeError(f"[cluster] nodes = {nodes} must be >= 1")
    if per_node < 1:
        raise RecipeError(f"[cluster] gpus_per_node = {per_node} must be >= 1 (processes per node)")
    world = nodes * per_node
    have = f"[cluster] nodes = {nodes} x gpus_per_node = {per_node} = {world} processes"
    for name in (
        "data_parallel_replicate_degree",
        "context_parallel_degree",
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "expert_parallel_degree",
        "expert_tensor_parallel_degree",
    ):
        if getattr(p, name) < 1:
            raise RecipeError(f"[parallelism] {name} = {getattr(p, name)} must be >= 1")
    dp_rep, cp, tp, pp = (
        p.data_parallel_replicate_degree,
        p.context_parallel_degree,
        p.tensor_parallel_degree,
        p.pipeline_parallel_degree,
    )
    dp_shard = p.data_parallel_shard_degree
    others = dp_rep * cp * tp * pp
    if dp_shard == -1:
        if world % others != 0:
            need = -(-world // others) * others
            raise RecipeError(
                f"{have}, but the world size {world} is not divisible by dp_replicate x cp x tp x pp "
                f"= {others} ([parallelism]; data_parallel_shard_degree = -1 takes the rest): choose "
                f"nodes so that nodes x gpus_per_node is a multiple of {others} (e.g. {need} "
                "processes), or change [parallelism]"
            )
        dp_shard = world // others
    elif dp_shard < 1:
        raise RecipeError(f"[parallelism] data_parallel_shard_degree = {dp_shard} must be -1 or >= 1")
    product = dp_rep * dp_shard * cp * tp * pp
    if product != world:
        fix = (
            f"set [cluster] nodes = {product // per_node} (submit: --nodes {product // per_node})"
            if product % per_node == 0
            else "change [cluster] gpus_per_node or the degrees"
        )
        raise RecipeError(
            f"{have}, but the layout dp_replicate {dp_rep} x dp_shard {dp_shard} x cp {cp} x tp {tp} "
            f"x pp {pp} multiplies to {product}, so the world size is {world} against {product}: "
            f"{fix}, or set data_parallel_shard_degree = -1 to fill the nodes"
        )
    ep, etp = p.expert_parallel_degree, p.expert_tensor_parallel_degree
    if ep > 1 and etp not in (1, tp):
        raise RecipeError(
            f"[parallelism] expert_tensor_parallel_degree = {etp} must be 1 or equal to "
            f"tensor_parallel_degree ({tp}) when expert_parallel_degree > 1"
        )
    borrowable = dp_shard * cp * tp
    if ep > 1 and borrowable % (ep * etp) != 0:
        raise RecipeError(
            f"[parallelism] expert_parallel_degree = {ep} (x etp {etp}) must divide "
            f"dp_shard x cp x tp = {borrowable}, the ranks EP borrows from ({have}); change "
            "expert_parallel_degree or the nodes"
        )
    return Layout(world, nodes, per_node, dp_rep, dp_shard, cp, tp, pp, ep, etp)


def check_layout(config, layout: Layout, args, device: str) -> None:
    """What our train spec (TorchTitan's deepseek_v3 parallelize with our EP hook) runs; asked
    by moe_comm.recipe.load and again by moe_comm.titan.parallelize at model build."""
    t = config.training
    if t.local_batch_size < 1 or t.seq_len < 1 or t.steps < 1:
        raise RecipeError("[training] local_batch_size, seq_len and steps must be >= 1")
    divisor = layout.tp * layout.cp * 2  # TorchTitan's ParallelDims.seq_len_divisor
    if t.seq_len % divisor != 0:
        raise RecipeError(
            f"[training] seq_len = {t.seq_len} must be divisible by tp x 2 x cp = {divisor} "
            "(TorchTitan's sequence and context parallel split)"
        )
    attn_type = getattr(args, "attn_type", "sdpa")
    if device == "cpu" and attn_type != "sdpa":
        kernel = ("FlashAttention's variable-length kernel is CUDA only" if attn_type == "varlen"
                  else "whose backward does not run on CPU")
        raise RecipeError(
            f"[model] flavor = {config.model.flavor!r} uses {attn_type} attention ({kernel}); use "
            "flavor = \"debugmodel\" on CPU"
        )
    if attn_type == "varlen":  # moe_comm.titan.attention
        if args.attn_mask_type != "block_causal":
            raise RecipeError(
                f"[model] flavor = {config.model.flavor!r}: varlen attention is block-causal, but the flavor's "
                f"attn_mask_type is {args.attn_mask_type!r}; use a flavor with block_causal masks"
            )
        if config.model.name != OUR_MODEL_NAME:
            raise RecipeError(
                f"[model] flavor = {config.model.flavor!r} (varlen attention) runs on our model only: TorchTitan's "
                f"own deepseek_v3 ({config.model.name!r}) has sdpa and flex; set [model] name = \"{OUR_MODEL_NAME}\" "
                "or drop the flavor's _varlen suffix"
            )
    if layout.cp > 1 and attn_type != "sdpa":
        raise RecipeError(
            f"[parallelism] context_parallel_degree = {layout.cp} needs SDPA attention; flavor "
            f"{config.model.flavor!r} uses {attn_type}: set context_parallel_degree = 1"
        )
    if config.parallelism.expert_parallel_comm_backend != "standard":
        raise RecipeError(
            "[parallelism] expert_parallel_comm_backend must stay \"standard\"; choose the "
            "backend with [moe_comm] backend (e.g. backend = \"deepep\")"
        )
    if layout.ep > 1 and layout.tp > 1:
        raise RecipeError(
            "[parallelism] tensor_parallel_degree > 1 with expert_parallel_degree > 1 is not "
            "supported by the moe_comm EP hook; use FSDP and PP with EP"
        )


def dual_pipe_v_overlap(parallelism, layout: Layout) -> bool:
    """Whether a recipe runs DualPipeV's EP overlap: TorchTitan's get_dual_pipe_v_flag, from the
    recipe's [parallelism] and layout instead of the built process groups."""
    return (layout.pp > 1 and layout.ep > 1 and parallelism.pipeline_parallel_expert_parallel_overlap
            and parallelism.pipeline_parallel_schedule.lower() == "dualpipev")


def run_plan(config, layout: Layout, args, device: str, *, gpu: str = "", gpu_sms: int = 0,
             launch_env=None, launch_env_source: str = "", python_env: str = ""):
    """The RunPlan of this recipe: what its backend's `check_run` is asked with."""
    t, p = config.training, config.parallelism
    return RunPlan(
        options=config.moe_comm,
        device=device,
        ep=layout.ep,
        ranks_per_node=layout.procs_per_node,
        nodes=layout.nodes,
        num_experts=args.moe_args.num_experts,
        top_k=args.moe_args.top_k,
        hidden=args.dim,
        score_before_experts=args.moe_args.score_before_experts,
        tokens_per_rank=t.local_batch_size * t.seq_len // (layout.cp * layout.tp),
        param_dtype=t.mixed_precision_param,
        converters=tuple(config.model.converters),
        gpu=gpu,
        gpu_sms=gpu_sms,
        launch_env=launch_env,
        launch_env_source=launch_env_source or "the launch environment",
        python_env=python_env,
        activation_checkpoint=config.activation_checkpoint.mode,
        dual_pipe_v=dual_pipe_v_overlap(p, layout),
        pp=layout.pp,
        pp_schedule=p.pipeline_parallel_schedule,
    )
