"""Peak dense FLOPS per GPU, and which peak an MFU figure is measured against.

MFU = flops_per_token * tokens/s / peak (TorchTitan's definition, PaLM appendix B). The number is
only comparable between runs when the peak is the one the matmuls actually run at: a float8 or
MXFP8 run measured against the bf16 peak would report up to twice the real utilisation. So the
peak follows the recipe's `[model] converters`, and a GPU missing from the table gives no MFU
(NaN, with a warning naming the override) rather than TorchTitan's silent A100 fallback.
"""

import math
from dataclasses import dataclass

from moe_comm import gpus

# TorchTitan 0.2.2 converter names (torchtitan/components/quantization) whose matmuls run in
# 8-bit: "quantize.linear.float8", "quantize.grouped_mm.float8", "quantize.linear.mx",
# "quantize.grouped_mm.mx".
_LOW_PRECISION_MARKERS = ("float8", ".mx")


@dataclass(frozen=True)
class Peak:
    """The peak an MFU figure is divided by, and why it was chosen."""

    tflops: float  # NaN when unknown: MFU is then NaN, never a guess
    dtype: str  # "bf16" or "fp8" (float8 and MXFP8 share the 8-bit tensor-core peak)
    source: str  # "table: NVIDIA H200", "[moe_comm] peak_tflops", or "unknown: ..."
    bf16_tflops: float  # the bf16 peak of the same GPU (NaN if unknown), for a second MFU
    warning: str = ""  # non-empty when the MFU figure needs a caveat; logged once at start

    @property
    def flops(self) -> float:
        return self.tflops * 1e12

    @property
    def known(self) -> bool:
        return not math.isnan(self.tflops)


def low_precision_converters(converters: list[str]) -> list[str]:
    """The converters in `[model] converters` that make matmuls run in 8-bit."""
    return [c for c in converters if any(m in c for m in _LOW_PRECISION_MARKERS)]


def table_peaks(device_name: str) -> dict[str, float] | None:
    """The dense peaks in TFLOPS ("bf16", and "fp8" where known) of the GPU `device_name` names
    (moe_comm.gpus: NVIDIA's datasheets); None for a GPU the table does not know."""
    gpu = gpus.lookup(device_name, "bf16_tflops")
    if gpu is None:
        return None
    return {"bf16": gpu.bf16_tflops} | ({"fp8": gpu.fp8_tflops} if gpu.fp8_tflops is not None else {})


def resolve_peak(device_name: str, converters: list[str], override_tflops: float = 0.0) -> Peak:
    """Pick the peak for MFU from the GPU name, the recipe's converters and the override.

    With an 8-bit converter the MFU is against the 8-bit peak: a lower bound of the true
    utilisation, since attention and unconverted matmuls still run in bf16 at half that rate
    (MFU against the bf16 peak, logged next to it, is the matching upper bound).
    """
    low_precision = low_precision_converters(converters)
    dtype = "fp8" if low_precision else "bf16"
    peaks = table_peaks(device_name) or {}
    bf16 = peaks.get("bf16", math.nan)
    if override_tflops > 0:
        return Peak(
            tflops=override_tflops,
            dtype=dtype,
            source="[moe_comm] peak_tflops",
            bf16_tflops=bf16 if low_precision else override_tflops,
            warning=(
                f"MFU uses [moe_comm] peak_tflops = {override_tflops:g}; with converters "
                f"{low_precision} it must be the GPU's 8-bit dense peak"
                if low_precision
                else ""
            ),
        )
    if dtype not in peaks:
        what = f"{dtype} peak of {device_name!r}" if peaks else f"GPU {device_name!r}"
        return Peak(
            tflops=math.nan,
            dtype=dtype,
            source=f"unknown: {device_name}",
            bf16_tflops=bf16,
            warning=(
                f"No dense {dtype} peak known for {what}: MFU is not logged (NaN). "
                f"Set [moe_comm] peak_tflops (e.g. --moe_comm.peak_tflops 989) to get it."
            ),
        )
    warning = ""
    if low_precision:
        warning = (
            f"converters {low_precision} run matmuls in 8-bit: mfu(%) is against the "
            f"{peaks['fp8']:g} TFLOPS 8-bit peak (a lower bound; attention stays bf16) and "
            f"moe_comm/mfu_bf16_peak(%) against the {bf16:g} TFLOPS bf16 peak (an upper bound). "
            f"Compare bf16 and 8-bit runs by tokens/s, not by MFU."
        )
    return Peak(
        tflops=peaks[dtype],
        dtype=dtype,
        source=f"table: {device_name}",
        bf16_tflops=bf16,
        warning=warning,
    )
