"""Our deepseek_v3 parallelize_fn: TorchTitan's, with our expert-parallel hook.

It is `torchtitan.models.deepseek_v3.infra.parallelize.parallelize_deepseekv3` step for step,
composed from TorchTitan's own functions (apply_non_moe_tp, apply_ac, apply_compile, apply_fsdp,
apply_ddp), except that expert parallelism goes through `apply_backend_ep` (the [moe_comm]
backend) instead of `apply_moe_ep_tp`, which hard-codes TorchTitan's hooks, the sync points of an
overlap across microbatches (DualPipeV's EP overlap, and [moe_comm] overlap = "microbatch") go
into our MoE layers (`use_sync_points`, run by moe_comm.titan.overlap) instead of
DualPipeExpertParallel, and an MoE block's activation checkpoint replays its dispatch and combine
in the recompute (moe_comm.titan.recompute) instead of running them again, which lets DualPipeV's
EP overlap run with activation checkpointing (TorchTitan's get_dual_pipe_v_flag refuses that).
Before building, it asks the checks `check`, `submit` and `train` ran before launch
(moe_comm.layout's rules and the backend's check_run) again, with what the ranks see, rather than
re-checking by hand.
"""

import os

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.config import JobConfig, TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.tensor_parallel import maybe_enable_async_tp
from torchtitan.models.deepseek_v3.infra import parallelize as titan_dsv3
from torchtitan.models.llama3.infra.parallelize import apply_ddp
from torchtitan.models.llama4.infra.parallelize import apply_compile, apply_fsdp, apply_moe_ep_tp
from torchtitan.tools.logging import logger

from moe_comm import fp8_experts, gpus, titan_fields
from moe_comm.backends import backend_class
from moe_comm.layout import check_layout, Layout, run_plan
from moe_comm.titan import cpu, recompute
from moe_comm.titan.expert_parallel import apply_backend_ep
from moe_comm.titan.model import TokenLevelMoE


def run_layout(parallel_dims: ParallelDims) -> Layout:
    """The layout the ranks run, in the terms moe_comm.recipe checks before launch."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", parallel_dims.world_size))
    d = parallel_dims
    return Layout(d.world_size, max(1, d.world_size // per_node), per_node, d.dp_replicate, d.dp_shard,
                  d.cp, d.tp, d.pp, d.ep, d.etp)


def forwards_per_step(job_config: JobConfig, parallel_dims: ParallelDims) -> int:
    """How often each layer's forward runs between two optimizer steps, recompute aside: the
    pipeline's microbatches times the gradient-accumulation steps (TorchTitan's arithmetic)."""
    t = job_config.training
    accumulation = titan_fields.accumulation_steps(t, parallel_dims.dp_replicate, parallel_dims.dp_shard)
    microbatches = (t.local_batch_size // job_config.parallelism.pipeline_parallel_microbatch_size
                    if parallel_dims.pp_enabled else 1)
    return accumulation * microbatches


def check_before_build(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> None:
    """The same checks `check`, `submit` and `train` ran before launch, with what the ranks see
    (the real device and its SM count, the environment NVSHMEM reads)."""
    layout = run_layout(parallel_dims)
    machine = gpus.this_machine()
    device = "cuda" if machine else "cpu"
    check_layout(job_config, layout, model.model_args, device)
    plan = run_plan(
        job_config, layout, model.model_args, device,
        gpu=machine[0] if machine else "", gpu_sms=machine[1] if machine else 0,
        launch_env=dict(os.environ), launch_env_source="this process's environment",
    )
    backend_class(job_config.moe_comm.backend).check_run(plan)


def dual_pipe_v(job_config: JobConfig, parallel_dims: ParallelDims) -> bool:
    """TorchTitan's get_dual_pipe_v_flag without its refusal of activation checkpointing, which
    our recompute makes comm-free (the recipe check refuses what does not compose)."""
    p = job_config.parallelism
    return (parallel_dims.ep_enabled and parallel_dims.pp_enabled and p.pipeline_parallel_expert_parallel_overlap
            and p.pipeline_parallel_schedule.lower() == "dualpipev")


def use_sync_points(model: nn.Module) -> None:
    """Under an overlap across microbatches (DualPipeV's EP overlap, or overlap "microbatch"):
    every MoE layer of this model part passes TorchTitan's sync points A-D around its dispatch
    and combine (what DualPipeExpertParallel does to TorchTitan's)."""
    for block in model.layers.values():
        if block.moe_enabled and isinstance(block.moe, TokenLevelMoE):
            block.moe.sync_points = True


def ep_mesh(parallel_dims: ParallelDims) -> DeviceMesh:
    """The EP mesh, also at EP 1: TorchTitan builds a one-rank "ep" dimension then but its
    `get_mesh` returns only enabled dimensions, so the one-rank mesh is read from its table."""
    if parallel_dims.ep_enabled:
        return parallel_dims.get_mesh("ep")
    parallel_dims.get_optional_mesh("ep")  # builds the meshes if they are not built yet
    return parallel_dims._meshes["ep"]


def parallelize_deepseekv3_moe_comm(
    model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig
) -> nn.Module:
    check_before_build(model, parallel_dims, job_config)
    attn_type = getattr(model.model_args, "attn_type", "sdpa")

    if parallel_dims.tp_enabled:
        if "float8" in job_config.model.converters and job_config.quantize.linear.float8.recipe_name not in (
            "rowwise",
            "rowwise_with_gw_hp",
        ):
            raise NotImplementedError("float8 tensorwise TP is not tested for deepseek_v3")
        tp_mesh = parallel_dims.get_mesh("tp")
        titan_dsv3.apply_non_moe_tp(
            model,
            tp_mesh,
            loss_parallel=not job_config.parallelism.disable_loss_parallel,
            enable_float8_tensorwise_tp=False,
            cp_enabled=parallel_dims.cp_enabled,
        )
        maybe_enable_async_tp(job_config, tp_mesh)
        # TP without EP: TorchTitan's own expert TP (the MoE keeps its standard forward).
        apply_moe_ep_tp(
            model,
            tp_mesh=tp_mesh,
            ep_mesh=None,
            etp_mesh=None,
            ep_etp_mesh=None,
        )

    apply_backend_ep(model, ep_mesh(parallel_dims), job_config.moe_comm)
    sharded = run_layout(parallel_dims).experts_sharded
    if job_config.moe_comm.expert_dtype == "fp8" and fp8_experts.caches_weights(
        forwards_per_step(job_config, parallel_dims), job_config.activation_checkpoint.mode, sharded
    ):
        for block in model.layers.values():
            if block.moe_enabled:
                experts = block.moe.experts
                # whole weights between steps: their copies are made right after each optimizer
                # step, from the parameters as the module holds them (the cache refuses DTensors)
                weights = None if sharded else (lambda e=experts: (e.w1, e.w2, e.w3))
                experts.fp8_weight_cache = fp8_experts.WeightCache(weights)
    # An overlap across microbatches: TorchTitan wraps its ExpertParallel in DualPipeExpertParallel
    # under DualPipeV; our dispatch/combine live in TokenLevelMoE.forward, so the sync points go
    # there, for DualPipeV and for overlap "microbatch" (moe_comm.titan.pipeline) alike.
    if dual_pipe_v(job_config, parallel_dims) or job_config.moe_comm.overlap == "microbatch":
        use_sync_points(model)

    if parallel_dims.cp_enabled:
        from torchtitan.distributed.context_parallel import apply_cp_to_attention_module

        apply_cp_to_attention_module(
            [block.attention.inner_attention for block in model.layers.values()],
            parallel_dims.get_mesh("cp"),
            attn_type,
        )

    model_compile_enabled = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        # TorchTitan's, except that an MoE block's recompute replays its dispatch and combine
        recompute.apply_ac(
            model,
            job_config.activation_checkpoint,
            model_compile_enabled=model_compile_enabled,
            base_folder=job_config.job.dump_folder,
        )
    if model_compile_enabled:
        # a backend serves the MoE layers at every EP degree: compile around it, as under EP
        apply_compile(model, job_config.compile, True)

    if parallel_dims.fsdp_enabled or parallel_dims.ep_enabled:
        dp_mesh_names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        edp_mesh_names = (
            ["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"]
        )
        apply_fsdp(
            model,
            parallel_dims.get_mesh(dp_mesh_names),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
            ep_degree=parallel_dims.ep,
            edp_mesh=parallel_dims.get_optional_mesh(edp_mesh_names),
            gradient_divide_factor=parallel_dims.fsdp_gradient_divide_factor,
        )
        logger.info("Applied %s to the model", "HSDP" if parallel_dims.dp_replicate_enabled else "FSDP")
    elif parallel_dims.dp_replicate_enabled:
        dp_mesh = parallel_dims.get_mesh("dp_replicate")
        if dp_mesh.ndim > 1:
            raise RuntimeError("DDP has not supported > 1D parallelism")
        apply_ddp(model, dp_mesh, enable_compile=model_compile_enabled)

    if not torch.cuda.is_available():
        cpu.force_sum_reduction(model)
    return model
