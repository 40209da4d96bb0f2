"""FP8 dispatch accuracy: what e4m3 rows with one fp32 scale per 128 channels do to the
values the experts see, on the row distributions a DeepSeek-V3 MoE layer dispatches.

The kernels' quantiser is pinned bit for bit to moe_comm.kernels.fp8_format.round_trip by the GPU
cases (layout_fp8_*: the received rows equal it exactly), so its error can be measured here in
pure torch, on CPU. Figures per distribution: the relative error per element (|q - x| / |x|,
over elements with |x| above 1e-3 of the group's amax), the relative error of each row
(||q - x|| / ||x||), and, for the bf16 comparison, the same figures of a bf16 round trip of
fp32 rows.

    python experiments/fp8_accuracy.py results/fp8_dispatch_accuracy.json
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_comm.kernels.fp8_format import round_trip  # noqa: E402

HIDDEN, TOKENS = 7168, 4096


def rows(kind: str, g: torch.Generator) -> torch.Tensor:
    if kind == "normal":
        x = torch.randn(TOKENS, HIDDEN, generator=g)
    elif kind == "normal_with_outlier_channels":  # a few channels 30x larger, as in LLM activations
        x = torch.randn(TOKENS, HIDDEN, generator=g)
        x[:, torch.randperm(HIDDEN, generator=g)[:16]] *= 30.0
    elif kind == "rmsnormed":  # unit RMS per row, heavy-tailed entries
        # Student-t with 4 degrees of freedom, z / sqrt(chi2_4 / 4), drawn from `g` like the others
        # (torch.distributions takes no generator: the rows differed from run to run)
        chi2 = sum(torch.randn(TOKENS, HIDDEN, generator=g).pow(2) for _ in range(4))
        x = torch.randn(TOKENS, HIDDEN, generator=g) / (chi2 / 4).sqrt()
        x = x / x.pow(2).mean(dim=1, keepdim=True).sqrt()
    else:
        raise ValueError(kind)
    return x.to(torch.bfloat16)


def errors(x: torch.Tensor, q: torch.Tensor, g: torch.Generator) -> dict:
    xf, qf = x.float(), q.float()
    groups = xf.view(x.shape[0], -1, 128)
    amax = groups.abs().amax(dim=2, keepdim=True).expand_as(groups).reshape_as(xf)
    keep = xf.abs() > 1e-3 * amax
    rel = ((qf - xf).abs() / xf.abs().clamp(min=1e-30))[keep]
    row = (qf - xf).norm(dim=1) / xf.norm(dim=1)
    return {
        "element_rel_error_median": rel.median().item(),
        "element_rel_error_p99": rel.quantile(0.99).item() if rel.numel() < 16_000_000 else
        rel[torch.randperm(rel.numel(), generator=g)[:1_000_000]].quantile(0.99).item(),
        "element_rel_error_max": rel.max().item(),
        "row_rel_error_mean": row.mean().item(),
        "row_rel_error_max": row.max().item(),
    }


def main(out: Path) -> None:
    g = torch.Generator().manual_seed(0)
    result = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "hidden": HIDDEN, "tokens": TOKENS,
              "format": "e4m3 payload, one fp32 scale = amax/448 per 128 channels, dequantised to bf16",
              "command": "python experiments/fp8_accuracy.py " + str(out), "distributions": {}}
    for kind in ("normal", "normal_with_outlier_channels", "rmsnormed"):
        x = rows(kind, g)
        result["distributions"][kind] = errors(x, round_trip(x), g)
    x32 = torch.randn(TOKENS, HIDDEN, generator=g)
    result["bf16_of_fp32_reference"] = errors(x32, x32.to(torch.bfloat16).float(), g)
    out.write_text(json.dumps(result, indent=1))
    lines = [f"{k:<30} " + "  ".join(f"{n} {v:.4f}" for n, v in e.items()) for k, e in result["distributions"].items()]
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
