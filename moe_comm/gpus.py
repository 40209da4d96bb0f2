"""What the project needs to know about each GPU model before a run starts: memory for `check`'s
fit verdict, SMs for the communication kernels' SM budget.

Matched by substring of the device name (torch.cuda.get_device_name, or what a user passes to
`check --gpu`); the first match wins, so longer names come first ("H100 PCIe" contains "H100").
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    model: str
    memory_gib: float  # what the device reports as usable
    sms: int


_GPUS = (
    GPU("B200", 178.4, 148),
    GPU("H200", 139.8, 132),
    GPU("H100 PCIe", 79.1, 114),
    GPU("H100", 79.1, 132),
)
MODELS = tuple(g.model for g in _GPUS)
MAX_SMS = max(g.sms for g in _GPUS)
"""The SM budget a recipe may ask for when its GPU is not known before launch; start-up then
checks the real device."""


def lookup(device_name: str) -> GPU | None:
    for gpu in _GPUS:
        if gpu.model.lower() in device_name.lower():
            return gpu
    return None


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
