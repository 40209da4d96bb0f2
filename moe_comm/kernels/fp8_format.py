"""The FP8 rows of dispatch (`[moe_comm] dispatch_dtype = "fp8"`), in pure torch: e4m3 values
with one fp32 scale per GROUP_CHANNELS channels, the scale amax / 448 with amax at least
MIN_AMAX, quantised as every FP8 path of csrc/ is (moe_comm.kernels.fp8_reference.quantise;
csrc/common/wire.h and vec.cuh hold the kernels' copies of these constants).

The kernels quantise and dequantise exactly so: the GPU cases compare the rows they deliver with
`round_trip` bit for bit (tests/gpu/nvshmem_cases.py), and experiments/fp8_accuracy.py measures
the format's error with it, on CPU.
"""

import torch

from moe_comm.kernels import fp8_reference

GROUP_CHANNELS = 128  # channels that share one fp32 scale
MIN_AMAX = 1e-4  # a group's amax is raised to this, so an all-zero group gets a finite scale


def round_trip(x_TD: torch.Tensor, group: int = GROUP_CHANNELS, min_amax: float = MIN_AMAX) -> torch.Tensor:
    """bf16 rows quantised to e4m3 with one fp32 scale per `group` channels and back to bf16:
    what FP8 dispatch must deliver, bit for bit (combine's backward in FP8 floors a gradient
    group's amax at 1e-30 instead of MIN_AMAX)."""
    t, d = x_TD.shape
    x_TGC = x_TD.float().view(t, d // group, group)
    q_TGC, scale_TG1 = fp8_reference.quantise(x_TGC, x_TGC.abs().amax(dim=2, keepdim=True), min_amax)
    return (q_TGC.float() * scale_TG1).view(t, d).to(torch.bfloat16)
