"""Backends by name. Each module is imported only when its backend is chosen, so a missing
optional dependency (DeepEP, the CUDA extension) only matters to the recipes that use it."""

import importlib

import torch.distributed as dist

from moe_comm.backends.base import CommBackend, DispatchResult, MoELayerSpec
from moe_comm.config import BACKENDS, MoEComm
from moe_comm.errors import RecipeError

_BACKEND_CLASSES = {
    "nccl": ("moe_comm.backends.nccl", "NcclBackend"),
    "nvshmem": ("moe_comm.backends.nvshmem", "NvshmemBackend"),
    "deepep": ("moe_comm.backends.deepep", "DeepEPBackend"),
}
assert tuple(_BACKEND_CLASSES) == BACKENDS, "moe_comm.config.BACKENDS and the classes must agree"


def backend_class(name: str) -> type[CommBackend]:
    """The class of backend `name`: what it can run is asked of it (`check_run`) before launch."""
    if name not in _BACKEND_CLASSES:
        raise RecipeError(f"[moe_comm] backend = {name!r} is not a backend; choose one of {list(_BACKEND_CLASSES)}")
    module_name, class_name = _BACKEND_CLASSES[name]
    return getattr(importlib.import_module(module_name), class_name)


def build_backend(config: MoEComm, layer: MoELayerSpec, ep_group: dist.ProcessGroup) -> CommBackend:
    return backend_class(config.backend)(layer, ep_group, config)


__all__ = ["CommBackend", "DispatchResult", "MoELayerSpec", "backend_class", "build_backend"]
