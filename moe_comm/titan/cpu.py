"""CPU adaptations for TorchTitan 0.2.2: the smallest changes that let a CPU-only machine (gloo)
run the same training path as the GPUs.

Applied by `moe_comm.titan` only when CUDA is absent, so GPU runs never see them. Each fix below
answers one CUDA assumption of TorchTitan 0.2.2, named with its module; nothing else is changed.

1. `tools/utils.py` falls back to device_type "cuda" when no accelerator exists, and several
   modules copy `device_type`/`device_module` at import. We point all copies at "cpu" and a small
   device module (`CpuDeviceModule`) with the few functions TorchTitan calls on it.
2. `generate_permute_indices` (the EP permute) launches a Triton kernel unless `use_cpu=True`.
3. `torch.histc` is not implemented for int64 on CPU; the router and reorderer call it on expert
   ids. Integer inputs are counted in float32 (exact below 2**24) and returned in
   the input's integer dtype, as CUDA returns them.
4. FSDP with gradient divide factor 1.0 reduces with `ReduceOp.PREMUL_SUM`, which gloo lacks;
   `force_sum_reduction` gives the same numbers with SUM (called from our parallelize_fn).
5. DualPipeV's overlap callback (`distributed/dual_pipe_v.py`) asks
   `torch.accelerator.current_stream(device_type)` for the stream of its backward thread and
   sets it with `device_module.set_stream`; a CPU build raises "Accelerator expected". CPU has
   no streams: the CPU's stream object is returned for "cpu", and setting it does nothing.
"""

import functools
import types

import torch

_APPLIED = False


def _cpu_memory_stats(device=None) -> dict[str, int]:
    # TorchTitan's DeviceMemoryMonitor reads these keys; CPU has no caching allocator to report.
    return {
        "active_bytes.all.peak": 0,
        "reserved_bytes.all.peak": 0,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }


def _cpu_total_memory() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# The device module TorchTitan uses on CPU: torch.cpu plus what TorchTitan calls on torch.cuda.
# current_device() returns an int because gloo's barrier(device_ids=[...]) rejects "cpu".
CpuDeviceModule = types.SimpleNamespace(
    set_device=lambda device: None,
    current_device=lambda: 0,
    device_count=lambda: 1,
    synchronize=lambda device=None: None,
    set_stream=lambda stream: None,
    is_available=lambda: True,
    get_device_name=lambda device=None: "CPU",
    get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=_cpu_total_memory()),
    reset_peak_memory_stats=lambda device=None: None,
    empty_cache=lambda: None,
    memory_stats=_cpu_memory_stats,
)


def _histc_counting_ints(original):
    @functools.wraps(original)
    def histc(input, *args, **kwargs):
        if not input.is_floating_point() and input.device.type == "cpu":
            return original(input.to(torch.float32), *args, **kwargs).to(input.dtype)
        return original(input, *args, **kwargs)

    return histc


def _cpu_stream_for_cpu(original):
    @functools.wraps(original)
    def current_stream(device=None):
        if device == "cpu" or getattr(device, "type", None) == "cpu":
            return torch.cpu.current_stream()
        return original(device)

    return current_stream


def apply() -> None:
    """Point TorchTitan at the CPU (idempotent). Call before the trainer reads the device."""
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True

    import torchtitan.components.metrics
    import torchtitan.distributed.dual_pipe_v
    import torchtitan.distributed.parallel_dims
    import torchtitan.distributed.utils
    import torchtitan.models.moe.utils
    import torchtitan.tools.profiling
    import torchtitan.tools.utils
    from torchtitan.models.moe.kernels import generate_permute_indices

    # 1. device_type / device_module, in every module that copied them at import.
    for module in (
        torchtitan.tools.utils,
        torchtitan.components.metrics,
        torchtitan.distributed.parallel_dims,
        torchtitan.distributed.utils,
        torchtitan.tools.profiling,
        torchtitan.distributed.dual_pipe_v,  # imported here, whatever the caller imported first
    ):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = CpuDeviceModule

    # 2. The EP permute's CPU implementation instead of its Triton kernel.
    torchtitan.models.moe.utils.generate_permute_indices = functools.partial(
        generate_permute_indices, use_cpu=True
    )

    # 3. histc on integer expert ids.
    torch.histc = _histc_counting_ints(torch.histc)

    # 5. the stream DualPipeV's backward thread runs on.
    torch.accelerator.current_stream = _cpu_stream_for_cpu(torch.accelerator.current_stream)


def force_sum_reduction(model: torch.nn.Module) -> None:
    """4. gloo has no PREMUL_SUM: make every FSDP module reduce gradients with SUM.

    TorchTitan sets the divide factor to 1.0 (it scales the loss by the global token count
    itself), so SUM gives the same numbers as PREMUL_SUM(1.0)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
