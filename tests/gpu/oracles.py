"""Reference maths every backend answers to (DeepEP's oracles plus pure-torch references).

Pure torch on CPU tensors, so the same checks run against the nvshmem kernels on GPUs
(tests/gpu/nvshmem_cases.py), DeepEP (tests/gpu/deepep_cases.py) and the nccl backend on CPU
(tests/backend_oracles_cpu.py):
  - received rows equal an expert-major layout built from every rank's tokens, bit for bit
    (rows are copies), padding rows zero;
  - per-expert counts equal an all-reduce of the routing histogram;
  - combine with unit weights divided by the fan-out equals the input;
  - outputs and gradients (x and routing weights) against a pure-torch reference;
  - FP8 dispatch: rows equal quantise-dequantise in pure torch, bit for bit
    (moe_comm.kernels.fp8_format.round_trip); for the FP8 experts, e4m3 rows with one scale per
    row, bit for bit (fp8_rows);
  - the hierarchical path: slots each forwarder delivers, against a count from the routing.
"""

import torch
import torch.distributed as dist

ROUTINGS = ("random", "one_expert", "zipf", "own_node", "one_node", "every_node")


def routing(num_tokens, num_experts, top_k, mode, generator, device, rank=0, world=1, ranks_per_node=1):
    """topk_idx [T, K] int64 and weights [T, K] float32 (> 0), distinct experts per token.

    random      uniform; one_expert: every token's first pick is expert 0 (a hot expert on one
    rank); zipf: expert popularity ~ 1/(e+1); own_node: every pick on the token's own node (no
    network hop); one_node: every pick on the next node (exactly one other node); every_node:
    the first picks one per node (every token crosses to every node)."""
    g = generator
    scores = torch.rand(num_tokens, num_experts, generator=g, device="cpu")
    local = num_experts // world
    per_node = local * ranks_per_node
    nodes = world // ranks_per_node
    node = rank // ranks_per_node
    if mode == "one_expert":
        scores[:, 0] = 2.0
    elif mode == "zipf":
        scores = scores * (1.0 / torch.arange(1, num_experts + 1, dtype=torch.float32))
    elif mode in ("own_node", "one_node"):
        target = node if mode == "own_node" else (node + 1) % nodes
        mask = torch.zeros(num_experts, dtype=torch.bool)
        mask[target * per_node:(target + 1) * per_node] = True
        scores[:, ~mask] -= 2.0
    elif mode == "every_node":
        for m in range(min(nodes, top_k)):
            pick = m * per_node + torch.randint(per_node, (num_tokens,), generator=g)
            scores[torch.arange(num_tokens), pick] += 4.0
    elif mode != "random":
        raise ValueError(mode)
    idx = scores.topk(top_k, dim=1).indices
    w = torch.rand(num_tokens, top_k, generator=g) + 0.1
    return idx.contiguous().to(device), w.contiguous().to(device)


def gather_cpu(t):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t.detach().cpu())
    return out


def expert_params(num_experts, hidden, dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = (torch.rand(num_experts, hidden, generator=g) + 0.5).to(device=device, dtype=dtype)
    b = (torch.rand(num_experts, hidden, generator=g) - 0.5).to(device=device, dtype=dtype)
    return a, b


def apply_experts(recv, tokens_per_expert, first_expert, a, b):
    """y = recv * a_e + b_e on each expert's segment (padding and tail rows stay zero)."""
    y = torch.zeros_like(recv)
    start = 0
    for e, n in enumerate(tokens_per_expert.tolist()):
        if n:
            y[start:start + n] = recv[start:start + n] * a[first_expert + e] + b[first_expert + e]
        start += n
    return y


def reference_layout(xs, idxs, rank, local_experts, align, sources=None):
    """Expert-major rows for `rank`'s experts from every rank's tokens, each segment zero-padded
    to `align`; and the padded counts. Within an expert, rows come source by source in the order
    `sources` (default: by rank), each source's in token order."""
    rows, counts = [], []
    hidden, dtype = xs[0].shape[1], xs[0].dtype
    sources = range(len(xs)) if sources is None else sources
    for e in range(rank * local_experts, (rank + 1) * local_experts):
        seg = [xs[s][(idxs[s] == e).any(dim=1)] for s in sources]
        seg = torch.cat(seg) if seg else torch.zeros(0, hidden, dtype=dtype)
        n = seg.shape[0]
        padded = (n + align - 1) // align * align
        rows.append(torch.cat([seg, torch.zeros(padded - n, hidden, dtype=dtype)]))
        counts.append(padded)
    return torch.cat(rows), torch.tensor(counts, dtype=torch.int32)


def reference_forward(x, idx, w, a, b):
    """out_t = sum_k w_tk * (x_t * a_e + b_e), all in fp32."""
    x32, a32, b32 = x.float(), a.float(), b.float()
    y = x32[:, None, :] * a32[idx] + b32[idx]  # [T, K, D]
    return (w[:, :, None] * y).sum(dim=1)


def fp8_rows(x):
    """bf16 rows quantised to e4m3 with one fp32 scale per row (amax / 448, amax at least 1e-4,
    applied as x * (1 / scale)):
    the rows the FP8 experts must receive, bit for bit. Returns (codes as uint8, scales)."""
    xf = x.float()
    # a tensor divisor: a CUDA tensor over a Python number is x * (1 / b) in torch, not the kernels' division
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-4) / torch.full((), 448.0, device=xf.device)
    # times its reciprocal, each correctly rounded (a tensor divisor, as above)
    return (xf * (torch.ones_like(scale) / scale)).to(torch.float8_e4m3fn).view(torch.uint8), scale.squeeze(1)


def forwarded_slots(idxs, rank, num_experts, ranks_per_node):
    """Recv slots `rank` gets from each forwarder of its node (the kernels' partition counts):
    forwarder g delivers the tokens of every rank (n, g) of the rail that hit `rank`."""
    world = len(idxs)
    local = num_experts // world
    counts = [0] * ranks_per_node
    for src, idx in enumerate(idxs):
        hits = ((idx // local) == rank).any(dim=1).sum().item()
        counts[src % ranks_per_node] += int(hits)
    return counts
