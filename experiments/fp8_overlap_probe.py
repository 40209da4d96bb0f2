"""Whether the FP8 experts' memory-bound kernels can run beside their grouped GEMMs.

    python experiments/fp8_overlap_probe.py [--iters 20] [--out OUT.json]

torch._scaled_grouped_mm launches one persistent CUTLASS grid of 2-SM clusters; in the one-GPU
recipe's profile (results/h200x1/raw/run60) every one of them had a grid of 58 x 2 = 116 blocks
on the H200's 132 SMs, so 16 SMs sit idle for the 32 ms a step the FP8 GEMMs take. The widening of
the weight gradients and the transposes of the wgrad operands (about 8 ms a step) wait for no
GEMM but their own producer. This probe times, at one layer of the one-GPU recipe (the shape of
fp8_row_kernels.py), each GEMM alone, each memory-bound kernel alone, and the two launched
together on two streams (the GEMM first, as the experts' backward would queue them): if the pair
takes about the GEMM's time, the kernel hides there. It also records the GEMM's grid from a
profiler trace, and times the FP8 experts' forward + backward at that layer (fp32 weights, as at
world 1) with the work beside the GEMMs on its stream (fp8_experts._beside_gemms) and with all of
it on one stream, alternating call by call.

Medians of --iters pairs of CUDA events (after one warm-up), one GPU, nothing else running.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "experiments"))

from fp8_row_kernels import add_layer_args, counts_of, cuda_with_kernels, rows_tensor, timed  # noqa: E402

from moe_comm import fp8_experts  # noqa: E402
from moe_comm.fp8_experts import Fp8Rows  # noqa: E402
from moe_comm.kernels import fp8  # noqa: E402


def together(main_fn, side_fn, side: torch.cuda.Stream, side_first: bool = False):
    """A call of both: side_fn on `side`, which waits for all the current stream queued first."""
    main = torch.cuda.current_stream()

    def call():
        side.wait_stream(main)
        if side_first:
            with torch.cuda.stream(side):
                side_fn()
            main_fn()
        else:
            main_fn()
            with torch.cuda.stream(side):
                side_fn()
        main.wait_stream(side)

    return call


def gemm_grid(fn) -> list:
    """The grids of the CUTLASS kernels one call of fn launches (from a profiler trace)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return [e["args"].get("grid") for e in events if e.get("cat") == "kernel" and "cutlass" in e["name"]]


def experts_step(rows: Fp8Rows, counts_L: torch.Tensor, dy: torch.Tensor, weights: list[torch.Tensor],
                 beside_gemms: bool) -> float:
    """ms of one forward + backward of the FP8 experts (CUDA events), the backward's transposes
    and widening beside the GEMMs or on the current stream."""
    for w in weights:
        w.grad = None
    carrier = torch.zeros((), dtype=torch.bfloat16, device=dy.device, requires_grad=True).expand(dy.shape)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fp8_experts.grouped_experts(*weights, carrier, rows, counts_L, beside_gemms=beside_gemms).backward(dy)
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_args(p)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    dev = cuda_with_kernels("fp8_overlap_probe")
    L, D, I = args.experts, args.dim, args.inter
    counts, padded = counts_of(args.rows, L, fp8_experts.ROW_ALIGN, 0)
    offsets = torch.tensor(padded, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    dy = rows_tensor(counts, padded, D, 1e-3, dev)
    dh13 = rows_tensor(counts, padded, 2 * I, 1e-3, dev)
    x_q = rows_tensor(counts, padded, D, 1.0, dev).to(torch.float8_e4m3fn)
    dh13_q = dh13.to(torch.float8_e4m3fn)
    R = dy.shape[0]
    _, _, dy_amax = fp8.quantise_grad_rows(dy, offsets)
    w13, _ = fp8.weights(torch.randn(L, 2 * I, D, device=dev) * 0.02)
    w13t = fp8.weights_transposed(w13)  # [L, D, 2I]
    dy_t, dy_t_scale = fp8.group_columns(dy, dy_amax, offsets)  # [D, R]
    h_t = dh13_q[:, :I].t().contiguous()  # [I, R]: any e4m3 operand of the shape
    ones = torch.ones
    dw = torch.randn(L, D, I, device=dev).to(torch.bfloat16)
    dw_out = torch.empty_like(dw, dtype=torch.float32)

    gemms = {
        "dgrad_x": lambda: fp8.scaled_grouped_mm(dh13_q, w13t.transpose(-2, -1), ones(R, device=dev),
                                                 ones(L, D, device=dev), offsets),
        "wgrad_w2": lambda: fp8.scaled_grouped_mm(dy_t, h_t.t(), dy_t_scale[0], ones(L * I, device=dev), offsets),
    }
    kernels = {
        "widen": lambda: fp8.widen(dw, dw_out),
        "group_columns_dy": lambda: fp8.group_columns(dy, dy_amax, offsets),
        "transpose_rows_x": lambda: fp8.transpose_rows(x_q, offsets),
    }
    side = torch.cuda.Stream()
    alone = {name: timed(fn, args.iters) for name, fn in {**gemms, **kernels}.items()}
    pairs = {}
    for g, gfn in gemms.items():
        for k, kfn in kernels.items():
            for side_first in (False, True):
                ms = timed(together(gfn, kfn, side, side_first), args.iters)
                name = f"{g} + {k}" + (" (kernel first)" if side_first else "")
                pairs[name] = {"ms": ms, "sum_alone": alone[g] + alone[k], "gemm_alone": alone[g],
                               "hidden_fraction": (alone[g] + alone[k] - ms) / alone[k]}
    for name, ms in alone.items():
        print(f"{name:40s} {ms:7.3f} ms alone", flush=True)
    for name, r in pairs.items():
        print(f"{name:40s} {r['ms']:7.3f} ms together (sum alone {r['sum_alone']:.3f}, GEMM {r['gemm_alone']:.3f}): "
              f"{100 * r['hidden_fraction']:.0f}% of the kernel hidden", flush=True)
    grids = {g: gemm_grid(fn) for g, fn in gemms.items()}
    del dh13, dh13_q, w13, w13t, dy_t, h_t, dw, dw_out
    x = rows_tensor(counts, padded, D, 1.0, dev)
    x_q8, x_scale = fp8.quantise_grad_rows(x, offsets)[:2]
    weights = [(torch.randn(*shape, device=dev) * 0.02).requires_grad_(True) for shape in ((L, I, D), (L, D, I), (L, I, D))]
    counts_L = torch.tensor(padded, device=dev, dtype=torch.int32)
    step = {"beside": [], "one_stream": []}
    for i in range(args.iters + 2):
        for mode in step:
            ms = experts_step(Fp8Rows(x_q8, x_scale), counts_L, dy, weights, mode == "beside")
            if i >= 2:  # two warm-up calls of each
                step[mode].append(ms)
    experts_ms = {mode: statistics.median(v) for mode, v in step.items()}
    print(f"FP8 experts forward + backward: beside {experts_ms['beside']:.3f} ms, one stream "
          f"{experts_ms['one_stream']:.3f} ms (medians of {args.iters}, alternating)")
    print("GEMM grids:", grids, "SMs:", torch.cuda.get_device_properties(dev).multi_processor_count)
    doc = {"shape": {"rows": args.rows, "padded_rows": R, "experts": L, "dim": D, "inter": I, "iters": args.iters},
           "device": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(dev).multi_processor_count,
           "torch": torch.__version__, "alone_ms": alone, "together": pairs, "gemm_grids": grids,
           "experts_forward_backward_ms": experts_ms, "experts_forward_backward_samples": step}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
