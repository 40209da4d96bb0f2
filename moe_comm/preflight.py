"""`python -m moe_comm preflight [RECIPE]`: bring NVSHMEM up across a job's ranks and time one
put/signal probe between every pair, before a 256-GPU job spends its queue time.

Launch it like training, one process per GPU: on Slurm, `srun` one task per node running
`torchrun --nnodes $SLURM_JOB_NUM_NODES --nproc_per_node 8 ... -m moe_comm preflight RECIPE`;
on one machine, `torchrun --nproc_per_node N -m moe_comm preflight`. It starts the nvshmem
backend's runtime exactly as training does (the recipe's `virtual_node_size` and
`wait_timeout_s`, the platform's NVSHMEM environment), so a start-up failure here names the same
likely causes; every rank then sends a probe to every other rank with the network hop's own
put/signal calls. Rank 0 prints the transport, the InfiniBand devices, whether IBGDA is on, and
the bandwidth of every pair (slowest first); a pair that never answers is named, and the exit
status is 1 if any pair failed or fell below --min-gbps.
"""

import argparse
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", default=None, help="recipe TOML (for [moe_comm] virtual_node_size and "
                        "wait_timeout_s); default: the real node and 30 s")
    parser.add_argument("--bytes", type=int, default=8 << 20, help="bytes per probe (default 8 MiB)")
    parser.add_argument("--iters", type=int, default=10, help="probes per pair (default 10)")
    parser.add_argument("--min-gbps", type=float, default=0.0, help="fail a pair slower than this (GB/s)")
    parser.add_argument("--json", type=Path, default=None, help="also write the per-pair results here")
    parser.add_argument("--virtual-node", type=int, default=None,
                        help="ranks per node as the kernels see it (overrides the recipe's virtual_node_size)")


@dataclass
class Environment:
    """What decides the network hop, as rank 0 saw it."""

    transport: str
    ibgda: str
    hca_list: str
    ib_devices: list[str]
    gdrcopy: bool
    hosts: int
    ranks_per_node: int


def environment(hosts: int, ranks_per_node: int) -> Environment:
    ib = Path("/sys/class/infiniband")
    return Environment(
        transport=os.environ.get("NVSHMEM_REMOTE_TRANSPORT", "(NVSHMEM's default)"),
        ibgda=os.environ.get("NVSHMEM_IB_ENABLE_IBGDA", "0"),
        hca_list=os.environ.get("NVSHMEM_HCA_LIST", ""),
        ib_devices=sorted(p.name for p in ib.iterdir()) if ib.is_dir() else [],
        gdrcopy=Path("/dev/gdrdrv").exists(),
        hosts=hosts,
        ranks_per_node=ranks_per_node,
    )


@dataclass
class Pair:
    src: int
    dst: int
    gbps: float  # 0 when the probe failed
    same_node: bool


def pairs_from_times(elapsed_ns: list[list[int]], bytes_: int, iters: int, ranks_per_node: int) -> list[Pair]:
    """elapsed_ns[src][dst]: the time src's step to dst took (both directions of a step busy);
    -1 where a wait gave up, so no bandwidth is made up for a step that did not finish."""
    out = []
    for src, row in enumerate(elapsed_ns):
        for dst, ns in enumerate(row):
            if src == dst:
                continue
            gbps = bytes_ * iters / (ns * 1e-9) / 1e9 if ns > 0 else 0.0
            out.append(Pair(src, dst, gbps, src // ranks_per_node == dst // ranks_per_node))
    return out


def report(env: Environment, pairs: list[Pair], failed: dict[int, str], min_gbps: float) -> tuple[str, bool]:
    """The text rank 0 prints, and whether every pair passed."""
    lines = [
        f"preflight   {env.hosts} host(s), {env.ranks_per_node} ranks per node, "
        f"{len({p.src for p in pairs} | {p.dst for p in pairs}) or 1} ranks",
        f"transport   NVSHMEM_REMOTE_TRANSPORT={env.transport}  IBGDA={'on' if env.ibgda == '1' else 'off'}  "
        f"GDRCopy={'present' if env.gdrcopy else 'absent'}",
        f"IB devices  {', '.join(env.ib_devices) or 'none found'}"
        + (f"  (NVSHMEM_HCA_LIST={env.hca_list})" if env.hca_list else ""),
    ]
    ok = not failed
    lines.append("rates       one warp's put/signal per pair, every rank sending and receiving at once: for "
                 "comparing pairs, not a link's peak")
    for kind, same in (("NVLink (same node)", True), ("network (other nodes)", False)):
        rates = [p.gbps for p in pairs if p.same_node == same]
        if rates:
            lines.append(f"{kind:<22} {len(rates)} pairs: min {min(rates):.1f}  median {statistics.median(rates):.1f}  "
                         f"max {max(rates):.1f} GB/s")
    slow = sorted(pairs, key=lambda p: p.gbps)[:5]
    if slow:
        lines.append("slowest     " + "; ".join(f"{p.src}->{p.dst} {p.gbps:.1f} GB/s" for p in slow))
    for rank, message in sorted(failed.items()):
        lines.append(f"FAILED      rank {rank}: {message}")
    below = [p for p in pairs if p.gbps < min_gbps]
    if below:
        ok = False
        lines.append(f"FAILED      {len(below)} pairs below --min-gbps {min_gbps:g}: "
                     + ", ".join(f"{p.src}->{p.dst}" for p in below[:10]))
    lines.append("verdict     " + ("every pair answered" if ok else "NOT ready: fix the pairs above before launching"))
    return "\n".join(lines), ok


def main(args: argparse.Namespace) -> int:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("preflight runs one process per GPU: launch it with torchrun (under srun on a cluster), e.g. "
              "`torchrun --nproc_per_node 8 -m moe_comm preflight RECIPE`", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    from moe_comm.kernels.runtime import NvshmemRuntime, RuntimeRequest

    virtual, timeout = 0, 30.0
    if args.recipe:
        from moe_comm import recipe

        try:
            r = recipe.load(args.recipe, [], device="cuda", check_paths=False)
        except recipe.RecipeError as e:
            return recipe.main_error(e)
        virtual, timeout = r.config.moe_comm.virtual_node_size, r.config.moe_comm.wait_timeout_s
    if args.virtual_node is not None:
        virtual = args.virtual_node
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    runtime = NvshmemRuntime.start(dist.group.WORLD, RuntimeRequest(
        tokens=16, num_experts=world, top_k=1, row_bytes=16, recv_capacity_factor=0.0,
        virtual_node_size=virtual, wait_timeout_s=timeout))
    elapsed = torch.ops.moe_comm.preflight(args.bytes, args.iters).tolist()
    errors = NvshmemRuntime.errors()
    failure = (f"gave up after {timeout:g} s waiting for EP rank {errors.timeout_peer}'s probe"
               if errors.timeout_kernel else "")
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (elapsed, failure))
    if rank == 0:
        env = environment(runtime.layout.hosts, runtime.layout.ranks_per_node)
        pairs = pairs_from_times([g[0] for g in gathered], args.bytes, args.iters, runtime.layout.ranks_per_node)
        failed = {r: g[1] for r, g in enumerate(gathered) if g[1]}
        text, ok = report(env, pairs, failed, args.min_gbps)
        print(text, flush=True)
        if args.json:
            args.json.write_text(json.dumps({"environment": asdict(env), "bytes": args.bytes, "iters": args.iters,
                                             "pairs": [asdict(p) for p in pairs], "failed": failed}, indent=1))
    else:
        ok = True  # rank 0 judges
    if any(g[1] for g in gathered):
        os._exit(1)  # NVSHMEM gave up on a peer: no collective teardown
    runtime.finalize()
    dist.destroy_process_group()
    return 0 if ok else 1
