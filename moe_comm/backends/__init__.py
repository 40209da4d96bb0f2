"""Backends by name. Each module is imported only when its backend is chosen, so a missing
optional dependency (DeepEP, the CUDA extension) only matters to the recipes that use it."""

import importlib

import torch.distributed as dist

from moe_comm.backends.base import CommBackend, DispatchResult, MoELayerSpec
from moe_comm.config import MoEComm

_BACKEND_CLASSES = {
    "nccl": ("moe_comm.backends.nccl", "NcclBackend"),
    "nvshmem": ("moe_comm.backends.nvshmem", "NvshmemBackend"),
    "deepep": ("moe_comm.backends.deepep", "DeepEPBackend"),
}


def build_backend(config: MoEComm, layer: MoELayerSpec, ep_group: dist.ProcessGroup) -> CommBackend:
    if config.backend not in _BACKEND_CLASSES:
        raise ValueError(
            f"[moe_comm] backend = {config.backend!r} is not a backend; "
            f"choose one of {sorted(_BACKEND_CLASSES)}"
        )
    module_name, class_name = _BACKEND_CLASSES[config.backend]
    backend_cls = getattr(importlib.import_module(module_name), class_name)
    return backend_cls(layer, ep_group, config)


__all__ = ["CommBackend", "DispatchResult", "MoELayerSpec", "build_backend"]
