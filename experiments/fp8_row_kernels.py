"""The FP8 experts' own kernels alone, at one layer's shape: time, bytes and bandwidth of each.

    python experiments/fp8_row_kernels.py [--rows 65536] [--experts 32] [--dim 7168] [--inter 2048]
        [--align 128] [--skew 0] [--iters 20] [--only NAME ...] [--out OUT.json]

The default shape is one MoE layer of the one-GPU recipe (recipes/deepseek_v3_671b_h200x1.toml:
8,192 tokens x top 8 over 32 local experts, hidden 7168, expert inter 2048). The rows of each
expert are a seeded multinomial draw (a mildly uneven routing), each expert's segment padded to
--align rows (fp8_experts.ROW_ALIGN by default) with zero rows, as dispatch lays them out
(--pad random fills them like the real rows instead).

Each kernel runs --iters times after one warm-up call; the figure is the median of per-call CUDA
event times. Bytes are what the kernel must read and write at least (its inputs and outputs once;
scales and amax arrays included), so GB/s compares with the GPU's copy bandwidth. The widening of
the weight gradients (fp8.widen) is timed beside torch's own cast (`.float()`), which autograd ran
before it. A probe records whether torch._scaled_grouped_mm writes float32 for the weight
gradients' 2D x 2D shape (it would spare the widening).

Under Nsight Compute, --only with --iters 1 keeps the profiled launches few:
    ncu --clock-control none -k regex:'gate_backward|quantise_rows' --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats python experiments/fp8_row_kernels.py --iters 1 \\
        --only quantise_rows gate_backward
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moe_comm import fp8_experts  # noqa: E402
from moe_comm.kernels import fp8  # noqa: E402


def counts_of(rows: int, experts: int, align: int, seed: int, skew: float = 0.0) -> tuple[list[int], list[int]]:
    """(rows per expert, the same padded to `align`): a multinomial draw with uneven weights,
    expert e's weight also times (e + 1) ** -skew (skew 0: mildly uneven; 1: the first expert
    about 8x the mean of 32)."""
    g = torch.Generator().manual_seed(seed)
    weights = (torch.rand(experts, generator=g) + 0.5) * torch.arange(1, experts + 1, dtype=torch.float) ** -skew
    drawn = torch.multinomial(weights, rows, replacement=True, generator=g)
    counts = torch.bincount(drawn, minlength=experts).tolist()
    return counts, [-(-c // align) * align for c in counts]


def rows_tensor(counts: list[int], padded: list[int], channels: int, scale: float, device,
                pad: str = "zero") -> torch.Tensor:
    """bf16 [sum(padded), channels]: random real rows, and padding of zeros (as dispatch writes
    it) or, with pad "random", random like the real rows (what a kernel costs on zero rows)."""
    x = torch.zeros(sum(padded), channels, device=device, dtype=torch.bfloat16)
    if pad == "random":
        x.normal_(0.0, scale)
    start = 0
    for c, p in zip(counts, padded):
        x[start:start + c] = torch.randn(c, channels, device=device, dtype=torch.bfloat16) * scale
        start += p
    return x


def timed(fn, iters: int, warmup: int = 1) -> float:
    """Median ms of one call of fn over `iters` calls (CUDA events), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def float32_wgrad_probe(device) -> str:
    """Whether torch._scaled_grouped_mm writes float32 for a 2D x 2D (token-grouped) shape."""
    a = torch.zeros(256, 128, device=device, dtype=torch.float8_e4m3fn)
    b = torch.zeros(256, 128, device=device, dtype=torch.float8_e4m3fn)
    offs = torch.tensor([128, 128], device=device, dtype=torch.int32)
    try:
        out = torch._scaled_grouped_mm(a, b.t(), torch.ones(2 * 256, device=device), torch.ones(2 * 256, device=device),
                                       offs=offs, out_dtype=torch.float32)
        return f"supported ({out.dtype})"
    except Exception as e:  # what torch says is the record
        return f"refused: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def add_layer_args(p: argparse.ArgumentParser) -> None:
    """The layer's shape, one MoE layer of the one-GPU recipe by default (module doc)."""
    p.add_argument("--rows", type=int, default=65536, help="routed rows of the layer (tokens x top-k)")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--dim", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)


def cuda_with_kernels(script: str) -> torch.device:
    """The GPU, with this project's kernels loaded; a clear exit where there is none."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA GPU")
    from moe_comm.kernels.runtime import load_library

    load_library()
    return torch.device("cuda")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_args(p)
    p.add_argument("--align", type=int, default=fp8_experts.ROW_ALIGN)
    p.add_argument("--pad", choices=("zero", "random"), default="zero",
                   help="the padding rows: zeros as dispatch writes them, or random (module doc)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skew", type=float, default=0.0, help="routing skew (counts_of): 0 mildly uneven, 1 a hot expert")
    p.add_argument("--only", nargs="*", default=None, help="kernel names to run (default: all)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    dev = cuda_with_kernels("fp8_row_kernels")
    L, D, I = args.experts, args.dim, args.inter
    counts, padded = counts_of(args.rows, L, args.align, args.seed, args.skew)
    R = sum(padded)
    offsets = torch.tensor(padded, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    dy = rows_tensor(counts, padded, D, 1e-3, dev, args.pad)
    h13 = rows_tensor(counts, padded, 2 * I, 1.0, dev, args.pad)
    dh = rows_tensor(counts, padded, I, 1e-3, dev, args.pad)
    x_q = rows_tensor(counts, padded, D, 1.0, dev).to(torch.float8_e4m3fn)
    row_scale = torch.rand(R, device=dev) * 1e-2 + 1e-3
    cs_d = torch.rand(L, D, device=dev) * 1e-3 + 1e-5
    cs_2i = torch.rand(L, 2 * I, device=dev) * 1e-3 + 1e-5
    w1, w3 = (torch.randn(L, I, D, device=dev) * 0.02 for _ in range(2))
    w2 = torch.randn(L, D, I, device=dev) * 0.02
    q13, _ = fp8.weights(w1, w3)
    q2, _ = fp8.weights(w2)
    _, _, dy_amax = fp8.quantise_grad_rows(dy, offsets, cs_d)
    _, _, dh13, h, h_dh13_amax = fp8.gate_backward(h13, dh, offsets, cs_2i, row_scale)
    dw = torch.randn(L, I, D, device=dev).to(torch.bfloat16)
    dw_out = torch.empty_like(dw, dtype=torch.float32)

    f32, b16, b8 = 4, 2, 1
    kernels = {  # name: (call, bytes read + written)
        "quantise_rows": (lambda: fp8.quantise_grad_rows(dy, offsets, cs_d), R * D * (b16 + b8) + R * f32 + 2 * L * D * f32),
        "gate": (lambda: fp8.gate(h13, offsets), R * 2 * I * b16 + R * I * b8 + R * f32),
        "gate_backward": (lambda: fp8.gate_backward(h13, dh, offsets, cs_2i, row_scale),
                          R * (2 * I * b16 + I * b16) + R * (2 * I * b8 + 2 * I * b16 + I * b16) + 2 * R * f32
                          + L * (2 * I + 3 * I) * f32),
        "weights_13": (lambda: fp8.weights(w1, w3), L * 2 * I * D * (f32 + b8) + L * 2 * I * f32),
        "weights_2": (lambda: fp8.weights(w2), L * D * I * (f32 + b8) + L * D * f32),
        "weights_transposed_13": (lambda: fp8.weights_transposed(q13), 2 * L * 2 * I * D * b8),
        "weights_transposed_2": (lambda: fp8.weights_transposed(q2), 2 * L * D * I * b8),
        "group_columns_dy": (lambda: fp8.group_columns(dy, dy_amax, offsets), R * D * (b16 + b8)),
        "group_columns_h": (lambda: fp8.group_columns(h, h_dh13_amax[:, :I], offsets), R * I * (b16 + b8)),
        "group_columns_dh13": (lambda: fp8.group_columns(dh13, h_dh13_amax[:, I:], offsets, 2), R * 2 * I * (b16 + b8)),
        "transpose_rows_x": (lambda: fp8.transpose_rows(x_q, offsets), 2 * R * D * b8),
        "widen": (lambda: fp8.widen(dw, dw_out), dw.numel() * (b16 + f32)),
        "torch_float_cast": (lambda: dw.float(), dw.numel() * (b16 + f32)),
    }
    only = set(args.only) if args.only else set(kernels)
    unknown = only - set(kernels)
    if unknown:
        raise SystemExit(f"--only {sorted(unknown)}: not among {sorted(kernels)}")
    results = {}
    for name, (call, nbytes) in kernels.items():
        if name not in only:
            continue
        ms = timed(call, args.iters)
        results[name] = {"ms": ms, "bytes": nbytes, "GB_per_s": nbytes / ms / 1e6}
        print(f"{name:24s} {ms:8.3f} ms  {nbytes / 1e9:7.3f} GB  {nbytes / ms / 1e6:8.0f} GB/s", flush=True)
    doc = {"shape": {"rows": args.rows, "padded_rows": R, "experts": L, "dim": D, "inter": I, "align": args.align, "pad": args.pad,
                     "rows_per_expert": counts, "iters": args.iters, "seed": args.seed, "skew": args.skew},
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "float32_wgrad_probe": float32_wgrad_probe(dev), "kernels": results}
    print("float32 out for the weight gradients' GEMM:", doc["float32_wgrad_probe"])
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
