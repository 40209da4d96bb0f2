"""What torch's FP8 grouped GEMM does on this GPU, at the flagship rank's expert rows: every
shape the routed experts' forward and backward need (forward 7168->2048 and 2048->7168, dgrad
the same two transposed, wgrad with the token dimension grouped), bf16 `torch._grouped_mm`
against rowwise-scaled e4m3 `torch._scaled_grouped_mm`, in one run, with each call's support
(an exception is recorded, not fatal) and its time (CUDA events, median of 20 after 5 warm-ups).

    python experiments/fp8_grouped_gemm_probe.py OUT.json [--experts 8] [--rows-per-expert 4136]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.fp8_row_kernels import timed  # noqa: E402  one timer for the FP8 benchmarks


def _rowwise(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.abs().amax(dim=dim, keepdim=True).float().clamp_min(1e-4)
    scale = amax / 448.0
    return (x.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(dim)


def main() -> int:
    p = argparse.ArgumentParser(prog="python experiments/fp8_grouped_gemm_probe.py")
    p.add_argument("out")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--rows-per-expert", type=int, default=4144,
                   help="rows per expert; e4m3 groups of the wgrad (token dimension grouped) need a multiple of 16")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    args = p.parse_args()
    E, M, D, H = args.experts, args.rows_per_expert, args.hidden, args.inter
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * M
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "experts": E, "rows_per_expert": M, "hidden": D, "inter": H, "cases": {}}

    def case(name, flops, fn):
        try:
            ms = timed(fn, 20, warmup=5)
            results["cases"][name] = {"ms": ms, "tflops": flops / ms / 1e9}
        except Exception as e:  # noqa: BLE001 - support is what is probed
            results["cases"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(name, results["cases"][name], flush=True)

    x = torch.randn(E * M, D, device=dev, dtype=torch.bfloat16, generator=g)
    h = torch.randn(E * M, H, device=dev, dtype=torch.bfloat16, generator=g)
    w1 = torch.randn(E, H, D, device=dev, dtype=torch.bfloat16, generator=g) * 0.02  # out x in
    w2 = torch.randn(E, D, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
    dy = torch.randn(E * M, D, device=dev, dtype=torch.bfloat16, generator=g)
    f_up, f_down = 2 * E * M * D * H, 2 * E * M * D * H

    # bf16: forward up (x @ w1^T), forward down (h @ w2^T), dgrad of up (dh @ w1), wgrad of down (dy^T @ h per group)
    case("bf16.fwd_up", f_up, lambda: torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs))
    case("bf16.fwd_down", f_down, lambda: torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs))
    case("bf16.dgrad_up", f_up, lambda: torch._grouped_mm(h, w1, offs=offs))
    case("bf16.wgrad_down", f_down, lambda: torch._grouped_mm(dy.t(), h, offs=offs))
    w13 = torch.randn(E, 2 * H, D, device=dev, dtype=torch.bfloat16, generator=g) * 0.02  # w1 and w3 as one
    case("bf16.fwd_up_fused_w13", 2 * f_up, lambda: torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs))
    case("bf16.wgrad_up", f_up, lambda: torch._grouped_mm(h.t(), x, offs=offs))

    xq, xs = _rowwise(x, 1)
    hq, hs = _rowwise(h, 1)
    w1q, w1s = _rowwise(w1, 2)  # per output channel (rows of w1: out)
    w2q, w2s = _rowwise(w2, 2)
    w1tq, w1ts = _rowwise(w1.transpose(-2, -1).contiguous(), 2)  # for dgrad: per input channel
    dyq, dys = _rowwise(dy, 1)
    sg = torch._scaled_grouped_mm
    case("fp8.fwd_up", f_up, lambda: sg(xq, w1q.transpose(-2, -1), xs, w1s, offs=offs, out_dtype=torch.bfloat16))
    case("fp8.fwd_down", f_down, lambda: sg(hq, w2q.transpose(-2, -1), hs, w2s, offs=offs, out_dtype=torch.bfloat16))
    case("fp8.dgrad_up", f_up, lambda: sg(hq, w1tq.transpose(-2, -1), hs, w1ts, offs=offs, out_dtype=torch.bfloat16))
    w13q, w13s = _rowwise(w13, 2)
    case("fp8.fwd_up_fused_w13", 2 * f_up,
         lambda: sg(xq, w13q.transpose(-2, -1), xs, w13s, offs=offs, out_dtype=torch.bfloat16))
    # quantisation cost in eager torch, for scale
    case("eager.quant_rowwise_7168", 0, lambda: _rowwise(x, 1))
    # accuracy of the rowwise fp8 forward against bf16 on random data
    try:
        ref = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs).float()
        got = sg(xq, w1q.transpose(-2, -1), xs, w1s, offs=offs, out_dtype=torch.bfloat16).float()
        results["fwd_up_rel_l2"] = ((got - ref).norm() / ref.norm()).item()
    except Exception as e:  # noqa: BLE001
        results["fwd_up_rel_l2"] = f"{type(e).__name__}: {e}"[:300]
    # last: a device assert in these would poison the context for every later case
    # wgrad: both operands quantised along the token dimension per group (what 2d x 2d needs)
    def per_group_columns(t):  # (E*M, C) -> e4m3 (C, E*M) row-major and scales (E*C,), per group and column
        tg = t.view(E, M, -1).float()
        scale = tg.abs().amax(dim=1, keepdim=True).clamp_min(1e-4) / 448.0
        q = (tg / scale).to(torch.float8_e4m3fn).reshape(E * M, -1)
        return q.t().contiguous(), scale.reshape(-1)

    dytq, dyts = per_group_columns(dy)
    htq, hts = per_group_columns(h)
    case("fp8.wgrad_down", f_down,
         lambda: sg(dytq, htq.t(), dyts, hts, offs=offs, out_dtype=torch.bfloat16))
    xtq, xts = per_group_columns(x)
    case("fp8.wgrad_up", f_up, lambda: sg(htq, xtq.t(), hts, xts, offs=offs, out_dtype=torch.bfloat16))

    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
