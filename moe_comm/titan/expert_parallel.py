"""Expert parallelism through a moe_comm backend.

`BackendExpertParallel` is, like TorchTitan's `ExpertParallel`, a `distribute_module`
ParallelStyle on each MoE's experts module that shards the expert weights Shard(0) on the ep
mesh. It registers no input/output hooks: `apply_backend_ep` attaches the backend named in
[moe_comm] (wrapped by moe_comm.metrics.instrument) to the `TokenLevelMoE`, whose forward calls
backend.dispatch before the grouped experts and backend.combine after them (see
moe_comm.titan.model for why the calls live there).

The backend is attached at EP 1 too, over the rank's own one-rank "ep" mesh, so a recipe's
backend is what runs whatever the EP degree; only EP > 1 shards the expert weights.
"""

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_module, distribute_tensor, Shard
from torch.distributed.tensor.parallel import parallelize_module, ParallelStyle
from torchtitan.tools.logging import logger

from moe_comm import console, metrics
from moe_comm.backends import build_backend, MoELayerSpec
from moe_comm.config import MoEComm
from moe_comm.titan.model import TokenLevelMoE


class BackendExpertParallel(ParallelStyle):
    """Shard(0) expert weights on the ep mesh; the MoE forward moves the tokens."""

    def _partition_fn(self, name: str, mod: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in mod.named_parameters(recurse=False):
            mod.register_parameter(
                param_name, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(0)]))
            )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, partition_fn=self._partition_fn)


def apply_backend_ep(model: nn.Module, ep_mesh: DeviceMesh, config: MoEComm) -> None:
    """Attach a backend (wrapped by moe_comm.metrics.instrument) to every MoE layer's experts;
    with more than one rank in `ep_mesh`, shard the experts over it."""
    ep_group = ep_mesh.get_group()
    console.watch.phase(
        f"building the {config.backend!r} backend for each MoE layer (the first nvshmem run on a "
        "machine compiles its CUDA kernels, about a minute)"
    )
    for block in model.layers.values():
        if not block.moe_enabled:
            continue
        moe = block.moe
        if not isinstance(moe, TokenLevelMoE):
            raise TypeError(
                f"MoE layer is {type(moe).__name__}, not TokenLevelMoE: set [model] name = "
                '"deepseek_v3_moe_comm" so the model is built by moe_comm.titan'
            )
        layer = MoELayerSpec(
            num_experts=moe.experts.num_experts,
            top_k=moe.router.top_k,
            hidden=moe.experts.w1.shape[-1],
            score_before_experts=moe.score_before_experts,
        )
        if ep_mesh.size() > 1:
            parallelize_module(moe.experts, ep_mesh, BackendExpertParallel())
        moe.experts.rows_from_backend = True
        moe.comm_backend = metrics.instrument(build_backend(config, layer, ep_group))
    logger.info(f"MoE dispatch/combine through the {config.backend!r} backend (moe_comm)")
    console.watch.phase("setting up the model (sharding, weight init, checkpoint load)")
