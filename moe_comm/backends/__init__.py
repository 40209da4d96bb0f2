"""The backends, by name: the registry every other room asks for a backend's class.

The three of this project are named here with their modules, each imported only when its class
is first asked for, so a missing optional dependency (DeepEP, the CUDA extension) only matters
to the recipes that use it. `register` adds a class at run time (a new backend, or a test's):
from then on `[moe_comm] backend` accepts its name, and `check`, `plan`, the run names, the
metrics and `report` ask it what they ask the others.
"""

import importlib

import torch.distributed as dist

from moe_comm.backends.base import CommBackend, CostTraits, DispatchResult, MoELayerSpec
from moe_comm.config import MoEComm
from moe_comm.errors import RecipeError

# name -> its class, or (module, class name) until it is first asked for
_REGISTRY: dict[str, type[CommBackend] | tuple[str, str]] = {
    "nccl": ("moe_comm.backends.nccl", "NcclBackend"),
    "nvshmem": ("moe_comm.backends.nvshmem", "NvshmemBackend"),
    "deepep": ("moe_comm.backends.deepep", "DeepEPBackend"),
}


def register(cls: type[CommBackend]) -> type[CommBackend]:
    """Add backend `cls` under its `name` (a ValueError if another class has it); returns it."""
    if cls.name in _REGISTRY and backend_class(cls.name) is not cls:
        raise ValueError(f"backend {cls.name!r} is registered already ({backend_class(cls.name).__qualname__})")
    _REGISTRY[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove the backend `register` added under `name`."""
    if not isinstance(_REGISTRY.get(name), type):
        raise ValueError(f"backend {name!r} was not added by register()")
    del _REGISTRY[name]


def names() -> tuple[str, ...]:
    """Every backend's name, in the order they were registered: the choices of [moe_comm] backend."""
    return tuple(_REGISTRY)


def backend_class(name: str) -> type[CommBackend]:
    """The class of backend `name`: what it can run is asked of it (`check_run`) before launch."""
    if name not in _REGISTRY:
        raise RecipeError(f"[moe_comm] backend = {name!r} is not a backend; choose one of {list(_REGISTRY)}")
    entry = _REGISTRY[name]
    if isinstance(entry, tuple):
        module_name, class_name = entry
        entry = _REGISTRY[name] = getattr(importlib.import_module(module_name), class_name)
    return entry


def baseline() -> type[CommBackend]:
    """The backend the others are compared with (the one whose class says `baseline`)."""
    (cls,) = [c for c in map(backend_class, names()) if c.baseline]
    return cls


def build_backend(config: MoEComm, layer: MoELayerSpec, ep_group: dist.ProcessGroup) -> CommBackend:
    return backend_class(config.backend)(layer, ep_group, config)


__all__ = ["CommBackend", "CostTraits", "DispatchResult", "MoELayerSpec", "backend_class", "baseline",
           "build_backend", "names", "register", "unregister"]
