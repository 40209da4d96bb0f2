"""What moe_comm.metrics.instrument() costs per MoE layer and step, without any communication.

One process, a backend that only permutes rows locally (so the wrapper's own kernels, events,
autograd nodes and the per-log summary are a large share of what is timed: a pessimistic
setting). Rounds of bare and instrumented forward+backward alternate; the median difference per
iteration is the overhead, projected onto a step as layers x overhead / step time.

    python experiments/instrument_overhead.py                      # CPU, debugmodel-sized
    python experiments/instrument_overhead.py --device cuda --tokens 16384 --hidden 7168 \\
        --experts 64 --top-k 8 --layers 2 --step-ms 940            # 671B-layers recipe, 2xH200

The end-to-end check (tokens/s with MOE_COMM_INSTRUMENT=1 vs 0 in real training) is
`experiments/mfu_sweep.py ... --instrument-cost`.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_comm.backends.base import CommBackend, DispatchResult, MoELayerSpec  # noqa: E402
from moe_comm.config import MoEComm  # noqa: E402
from moe_comm.metrics.instrumented import InstrumentedBackend, summarize  # noqa: E402


class LocalBackend(CommBackend):
    """Dispatch = expand each token to its experts' rows, expert-major; combine = weighted sum."""

    name = "nccl"

    def dispatch(self, x_TD, topk_idx_TK, topk_w_TK):
        order_R = topk_idx_TK.flatten().argsort(stable=True)
        token_R = order_R // topk_idx_TK.shape[1]
        return DispatchResult(x_TD[token_R], None, (order_R, token_R, topk_w_TK, x_TD.shape[0]))

    def combine(self, y_RD, handle):
        order_R, token_R, topk_w_TK, num_tokens = handle
        w_R = topk_w_TK.flatten()[order_R].to(y_RD.dtype)
        out_TD = torch.zeros(num_tokens, y_RD.shape[1], dtype=y_RD.dtype, device=y_RD.device)
        return out_TD.index_add(0, token_R, y_RD * w_R[:, None])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_round(backends, x_TD, topk_idx_TK, topk_w_TK, iters: int, summarize_each: bool) -> float:
    """Seconds per iteration: wall time on GPU; on CPU, this process's CPU time, which a
    machine shared with other jobs disturbs less than wall time (CPU ops are synchronous)."""
    device = x_TD.device
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    _sync(device)
    start = clock()
    for _ in range(iters):
        h_TD = x_TD
        for backend in backends:
            result = backend.dispatch(h_TD, topk_idx_TK, topk_w_TK)
            h_TD = backend.combine(result.recv_x_RD * 2.0, result.handle)
        h_TD.float().sum().backward()
        if summarize_each:
            _sync(device)  # stands in for TorchTitan's .item() before every log line
            summarize(backends, steps=1)
    _sync(device)
    return (clock() - start) / iters


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=3)
    p.add_argument("--layers", type=int, default=6, help="MoE layers per step (for the projection)")
    p.add_argument("--step-ms", type=float, default=0.0, help="measured step time, to express cost in %%")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    args = p.parse_args()

    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dtype = getattr(torch, args.dtype)
    layer = MoELayerSpec(args.experts, args.top_k, args.hidden)
    bare = [LocalBackend(layer, dist.group.WORLD, MoEComm()) for _ in range(args.layers)]
    wrapped = [InstrumentedBackend(b) for b in bare]
    torch.manual_seed(0)
    x_TD = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    topk_idx_TK = torch.rand(args.tokens, args.experts, device=device).topk(args.top_k, dim=1).indices
    topk_w_TK = torch.rand(args.tokens, args.top_k, device=device, requires_grad=True)

    for backends, each in ((bare, False), (wrapped, True)):  # warm-up both paths
        time_round(backends, x_TD, topk_idx_TK, topk_w_TK, 3, each)
    bare_s, inst_s = [], []
    for _ in range(args.rounds):
        bare_s.append(time_round(bare, x_TD, topk_idx_TK, topk_w_TK, args.iters, False))
        inst_s.append(time_round(wrapped, x_TD, topk_idx_TK, topk_w_TK, args.iters, True))
    bare_ms, inst_ms = statistics.median(bare_s) * 1e3, statistics.median(inst_s) * 1e3
    per_layer_us = (inst_ms - bare_ms) * 1e3 / args.layers
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "shape": {"tokens": args.tokens, "hidden": args.hidden, "experts": args.experts,
                  "top_k": args.top_k, "layers": args.layers, "dtype": args.dtype},
        "bare_ms_per_iter": bare_ms,
        "instrumented_ms_per_iter": inst_ms,
        "overhead_us_per_layer_step": per_layer_us,
        "rounds_bare_ms": [t * 1e3 for t in bare_s],
        "rounds_instrumented_ms": [t * 1e3 for t in inst_s],
    }
    if args.step_ms:
        result["overhead_pct_of_step"] = 100 * (inst_ms - bare_ms) / args.step_ms
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
