"""The FP8 rows of dispatch (`[moe_comm] dispatch_dtype = "fp8"`), in pure torch: e4m3 values
with one fp32 scale per GROUP_CHANNELS channels, the scale amax / E4M3_MAX with amax at least
MIN_AMAX, applied as a product with its correctly rounded reciprocal (csrc/common/wire.h and
vec.cuh hold the kernels' copies of these constants). Written apart from
moe_comm.kernels.fp8_reference, which tests/test_fp8_maths.py holds to it.

The kernels quantise and dequantise exactly so: the GPU cases compare the rows they deliver with
`round_trip` bit for bit (tests/gpu/nvshmem_cases.py), and experiments/fp8_accuracy.py measures
the format's error with it, on CPU.
"""

import torch

GROUP_CHANNELS = 128  # channels that share one fp32 scale
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
MIN_AMAX = 1e-4  # a group's amax is raised to this, so an all-zero group gets a finite scale


def round_trip(x_TD: torch.Tensor, group: int = GROUP_CHANNELS, min_amax: float = MIN_AMAX) -> torch.Tensor:
    """bf16 rows quantised to e4m3 with one fp32 scale per `group` channels and back to bf16:
    what FP8 dispatch must deliver, bit for bit (combine's backward in FP8 floors a gradient
    group's amax at 1e-30 instead of MIN_AMAX)."""
    t, d = x_TD.shape
    x_TGC = x_TD.float().view(t, d // group, group)
    # a tensor divisor: torch divides a CUDA tensor by a Python number as x * (1 / b), one rounding
    # more than the kernels' division (moe_comm.kernels.fp8_reference.divided)
    scale_TG1 = x_TGC.abs().amax(dim=2, keepdim=True).clamp(min=min_amax) / torch.full((), E4M3_MAX, device=x_TD.device)
    # times the reciprocal, each correctly rounded (a tensor divisor, as above)
    q_TGC = (x_TGC * (torch.ones_like(scale_TG1) / scale_TG1)).to(torch.float8_e4m3fn)
    return (q_TGC.float() * scale_TG1).view(t, d).to(torch.bfloat16)
