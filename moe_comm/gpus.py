"""The GPU facts the project reads, in one table: memory and SMs (`check`'s fit verdict, the
communication kernels' SM budget), dense tensor-core peaks (MFU: moe_comm.metrics.peaks), HBM
and NVLink rates (the scale model: moe_comm.predict). The peaks, HBM and NVLink rates are NVIDIA's
datasheet figures (dense, no sparsity; NVLink per direction); memory is what the device reports
as usable. A fact not known here is None.

Matched by substring of the device name, in any case (torch.cuda.get_device_name, or what a user
passes to `check --gpu`): the first GPU of the table that names it and knows the fact asked for
wins, so longer names come first ("GB200" contains "B200", "H100 PCIe" contains "H100").
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    model: str
    memory_gib: float | None  # what the device reports as usable
    sms: int | None
    bf16_tflops: float | None  # dense peak
    fp8_tflops: float | None  # dense 8-bit peak (float8 and MXFP8 share it)
    hbm_tbs: float | None
    nvlink_gbps: float | None  # per GPU, per direction


_GPUS = (
    GPU("GB200", None, None, 2500.0, 5000.0, None, None),
    GPU("B200", 178.4, 148, 2250.0, 4500.0, 8.0, 900.0),
    GPU("H200", 139.8, 132, 989.0, 1979.0, 4.8, 450.0),
    GPU("H100 NVL", None, None, 835.0, 1671.0, None, None),
    GPU("H100 PCIe", 79.1, 114, 756.0, 1513.0, None, None),
    GPU("H100", 79.1, 132, 989.0, 1979.0, 3.35, 450.0),
    GPU("A100", None, None, 312.0, None, None, None),
)
MODELS = tuple(g.model for g in _GPUS if g.memory_gib is not None)
"""The GPU models a recipe may name ([cluster] gpu, `check --gpu`): those whose memory and SMs
are known."""
MAX_SMS = max(g.sms for g in _GPUS if g.sms is not None)
"""The SM budget a recipe may ask for when its GPU is not known before launch; start-up then
checks the real device."""


def lookup(device_name: str, fact: str = "memory_gib") -> GPU | None:
    """The first GPU of the table whose model `device_name` contains (any case) and that knows
    `fact` (a field of GPU; by default its memory, which the recipe checks need)."""
    for gpu in _GPUS:
        if gpu.model.lower() in device_name.lower() and getattr(gpu, fact) is not None:
            return gpu
    return None


def model(name: str) -> GPU:
    """The GPU of the table whose model is exactly `name` (KeyError if none)."""
    for gpu in _GPUS:
        if gpu.model == name:
            return gpu
    raise KeyError(name)
def model_name(text: str) -> str:
    """The table's spelling of a GPU model typed in any case ("b200" -> "B200"); `text` itself
    when the table has no such model (argparse then names the choices)."""
    return next((g.model for g in _GPUS if g.model.lower() == text.strip().lower()), text)


def this_machine() -> tuple[str, int] | None:
    """(device name, SM count) of this process's current CUDA device, exact; None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return props.name, props.multi_processor_count
