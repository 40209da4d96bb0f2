"""MFU = flops_per_token * tokens/s/GPU / peak, checked against hand-computed values.

flops/token comes from TorchTitan's own `get_moe_model_nparams_and_flops` (the number the
processor is given by the trainer); the peaks from moe_comm.metrics.peaks.
"""

import copy
import math

import pytest
import torch

from moe_comm.metrics.peaks import resolve_peak


def mfu_percent(flops_per_token: float, tokens_per_s_per_gpu: float, peak_tflops: float) -> float:
    """TorchTitan's MFU (MetricsProcessor.log): 100 * flops/token * tokens/s / the peak the processor
    is given (Peak.flops); NaN when the peak is unknown."""
    return 100.0 * flops_per_token * tokens_per_s_per_gpu / (peak_tflops * 1e12)


def titan_flops_per_token(flavor: str, seq_len: int) -> int:
    from torchtitan.models.deepseek_v3 import deepseekv3_args, DeepSeekV3Model

    args = copy.deepcopy(deepseekv3_args[flavor])
    args.moe_impl = "standard"  # normally set by update_from_config from [parallelism]
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    _nparams, flops = args.get_nparams_and_flops(model, seq_len)
    return flops


def test_deepseek_v3_671b_on_b200():
    flops = titan_flops_per_token("671B", 4096)
    # by hand: attention 6 * 61 layers * 128 heads * (128 + 64 + 128) head dims * 4096
    #          = 61.40 GFLOP; 6 * 36.63B active non-embedding params = 219.75 GFLOP
    assert 6 * 61 * 128 * 320 * 4096 == 61_404_610_560
    assert flops == pytest.approx(281.16e9, rel=1e-4)
    peak = resolve_peak("NVIDIA B200", converters=[])
    assert (peak.tflops, peak.dtype) == (2250.0, "bf16")
    # the Nebius DeepEP run: 859 tok/s/GPU -> 281.16e9 * 859 / 2.25e15 = 10.73 %
    assert mfu_percent(flops, 859, peak.tflops) == pytest.approx(10.734, abs=1e-3)


def test_deepseek_v3_16b_on_h200_bf16_and_float8():
    flops = titan_flops_per_token("16B", 4096)
    assert flops == pytest.approx(18.106e9, rel=1e-4)
    peak = resolve_peak("NVIDIA H200", converters=[])
    assert peak.tflops == 989.0 and peak.warning == ""
    # measured 4.2k tok/s/GPU (NOTES §1): 18.106e9 * 4200 / 989e12 = 7.689 % (77 TFLOPS)
    assert mfu_percent(flops, 4200, peak.tflops) == pytest.approx(7.689, abs=1e-3)
    fp8 = resolve_peak("NVIDIA H200", converters=["quantize.grouped_mm.float8"])
    assert (fp8.tflops, fp8.dtype, fp8.bf16_tflops) == (1979.0, "fp8", 989.0)
    assert "lower bound" in fp8.warning and "tokens/s" in fp8.warning
    # the same tokens/s against the 8-bit peak: 18.106e9 * 4200 / 1979e12 = 3.843 %
    assert mfu_percent(flops, 4200, fp8.tflops) == pytest.approx(3.843, abs=1e-3)


@pytest.mark.parametrize(
    "device_name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA GB200", 2500.0),  # contains "B200": the longer name must win
    ],
)
def test_peak_table(device_name, tflops):
    assert resolve_peak(device_name, []).tflops == tflops


def test_unknown_gpu_warns_and_override_wins():
    unknown = resolve_peak("NVIDIA L4", [])
    assert math.isnan(unknown.tflops) and not unknown.known
    assert "peak_tflops" in unknown.warning and "NVIDIA L4" in unknown.warning
    assert math.isnan(mfu_percent(1e9, 1000, unknown.tflops))
    override = resolve_peak("NVIDIA L4", [], override_tflops=121.0)
    assert override.tflops == 121.0 and override.source == "[moe_comm] peak_tflops"
    # A100 has no 8-bit tensor cores: a float8 recipe gets no MFU rather than a bf16 one
    a100_fp8 = resolve_peak("NVIDIA A100-SXM4-80GB", ["quantize.linear.float8"])
    assert math.isnan(a100_fp8.tflops) and "fp8" in a100_fp8.warning
    mx = resolve_peak("NVIDIA B200", ["quantize.grouped_mm.mx"])
    assert (mx.tflops, mx.dtype) == (4500.0, "fp8")


@pytest.mark.parametrize(
    "recipe, device_name",
    [("deepseek_v3_671b_b200_mxfp8.toml", "NVIDIA B200"), ("deepseek_v3_671b_layers_h200x2_float8.toml", "NVIDIA H200")],
)
def test_low_precision_recipes_say_the_peak_their_mfu_uses(recipe, device_name):
    """The recipe's comment, the code's peak and the step line name the same 8-bit peak."""
    import tomllib
    from pathlib import Path

    from moe_comm.metrics.step_line import StepLine

    text = (Path(__file__).resolve().parents[1] / "recipes" / recipe).read_text()
    comment = " ".join(line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#"))
    peak = resolve_peak(device_name, tomllib.loads(text)["model"]["converters"])
    assert peak.dtype == "fp8" and f"8-bit dense peak, {peak.tflops:g} TFLOPS" in comment
    line = StepLine(step=1, total_steps=1, seconds_per_step=1.0, eta_s=None, loss=1.0, grad_norm=1.0,
                    tokens_per_s=1.0, mfu_pct=20.0, peak=peak, mem_gib=1.0, mem_pct=1.0,
                    dispatch_ms=1.0, combine_ms=1.0, comm_pct=1.0).format()
    quoted = f"of {peak.tflops:g} TFLOPS fp8"
    assert quoted in line and f'the step line says "{quoted}"' in comment
    assert "moe_comm/mfu_bf16_peak(%) is the same against the bf16 peak" in comment
