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

A rank that never answers costs each rank one wait (wait_timeout_s), never a hang: the probes'
waits are bounded, their results travel through the job's store with a bound (not a
collective a missing rank would stall), and NVSHMEM is torn down together only if every rank
agrees it is safe (moe_comm.kernels.runtime), so every process ends.
"""

import argparse
import json
import os
import statistics
import sys
import time
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
    parser.add_argument("--wait-timeout-s", type=float, default=None,
                        help="how long a rank waits for each peer's probe (overrides the recipe's wait_timeout_s)")
    parser.add_argument("--silent-rank", type=int, default=-1,
                        help="this rank sends no probes, to see how the report names a rank that never answers")


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
    gbps: float  # 0 unless the probe arrived
    same_node: bool
    # "ok"; "no probe" (src's probe never reached dst); "not measured" (dst sent no report)
    status: str = "ok"


def pairs_from_times(received_ns: list[list[int] | None], bytes_: int, iters: int, ranks_per_node: int) -> list[Pair]:
    """received_ns[dst][src]: the time from dst's kernel start until src's probes all arrived
    (every pair in flight at once); -1 where they never came, so no bandwidth is made up for
    it; None for a rank that sent no report (its incoming pairs are not measured).

    Pairs are independent (one warp each, every probe sent before any wait): a rank that never
    answers fails its own pairs only, and every pair that arrived keeps its rate."""
    world = len(received_ns)
    out = []
    for dst, row in enumerate(received_ns):
        for src in range(world):
            if src == dst:
                continue
            same = src // ranks_per_node == dst // ranks_per_node
            if row is None:
                out.append(Pair(src, dst, 0.0, same, "not measured"))
            elif row[src] <= 0:
                out.append(Pair(src, dst, 0.0, same, "no probe"))
            else:
                out.append(Pair(src, dst, bytes_ * iters / (row[src] * 1e-9) / 1e9, same))
    return out


def failures(pairs: list[Pair], timeout_s: float) -> list[str]:
    """One line per rank whose probes went missing, naming the rank that never answered when
    none of its probes arrived anywhere, and one per rank that sent no report."""
    lines = []
    for src in sorted({p.src for p in pairs if p.status == "no probe"}):
        lost = sorted(p.dst for p in pairs if p.src == src and p.status == "no probe")
        measured = [p for p in pairs if p.src == src and p.status != "not measured"]
        if len(lost) == len(measured):
            lines.append(f"rank {src} never answered: no probe from it reached any of its {len(lost)} peer(s) "
                         f"within {timeout_s:g} s")
        else:
            lines.append(f"rank {src}'s probe never reached rank(s) {lost} within {timeout_s:g} s")
    for dst in sorted({p.dst for p in pairs if p.status == "not measured"}):
        lines.append(f"rank {dst} sent no report (dead or hung): the pairs into it are not measured")
    return lines


def report(env: Environment, pairs: list[Pair], timeout_s: float, min_gbps: float) -> tuple[str, bool]:
    """The text rank 0 prints, and whether every pair passed."""
    lines = [
        f"preflight   {env.hosts} host(s), {env.ranks_per_node} ranks per node, "
        f"{len({p.src for p in pairs} | {p.dst for p in pairs}) or 1} ranks",
        f"transport   NVSHMEM_REMOTE_TRANSPORT={env.transport}  IBGDA={'on' if env.ibgda == '1' else 'off'}  "
        f"GDRCopy={'present' if env.gdrcopy else 'absent'}",
        f"IB devices  {', '.join(env.ib_devices) or 'none found'}"
        + (f"  (NVSHMEM_HCA_LIST={env.hca_list})" if env.hca_list else ""),
        "rates       one warp's put/signal per pair, every pair at once (the all-to-all's pattern): "
        "for comparing pairs, not a link's peak",
    ]
    measured = [p for p in pairs if p.status == "ok"]
    for kind, same in (("NVLink (same node)", True), ("network (other nodes)", False)):
        rates = [p.gbps for p in measured if p.same_node == same]
        if rates:
            lines.append(f"{kind:<22} {len(rates)} pairs: min {min(rates):.1f}  median {statistics.median(rates):.1f}  "
                         f"max {max(rates):.1f} GB/s")
    slow = sorted(pairs, key=lambda p: (p.status == "not measured", p.gbps))[:5]
    if slow:
        lines.append("slowest     " + "; ".join(
            f"{p.src}->{p.dst} " + (f"{p.gbps:.1f} GB/s" if p.status == "ok" else p.status) for p in slow))
    failed = failures(pairs, timeout_s)
    lines += [f"FAILED      {line}" for line in failed]
    below = [p for p in measured if p.gbps < min_gbps]
    if below:
        lines.append(f"FAILED      {len(below)} pairs below --min-gbps {min_gbps:g}: "
                     + ", ".join(f"{p.src}->{p.dst}" for p in below[:10]))
    ok = not failed and not below
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
    if args.wait_timeout_s is not None:
        timeout = args.wait_timeout_s
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    runtime = NvshmemRuntime.start(dist.group.WORLD, RuntimeRequest(
        tokens=16, num_experts=world, top_k=1, row_bytes=16, recv_capacity_factor=0.0,
        virtual_node_size=virtual, wait_timeout_s=timeout))
    received = torch.ops.moe_comm.preflight(args.bytes, args.iters, rank != args.silent_rank).tolist()
    done_at = time.time()
    lost = [src for src, ns in enumerate(received) if src != rank and ns <= 0]
    if lost:  # this rank's own finding, once
        print(f"preflight: rank {rank}: no probe from rank(s) {lost} within {timeout:g} s", file=sys.stderr, flush=True)
    # Gathered through the job's store with a bound, not a collective: a rank that never
    # answers must not keep the others from reporting it.
    board = runtime.board
    board.post("preflight", json.dumps({"received_ns": received, "done_at": done_at}))
    if rank == 0:
        rows = board.gather("preflight", timeout)
        got = {r: json.loads(v) for r, v in rows.items()}
        env = environment(runtime.layout.hosts, runtime.layout.ranks_per_node)
        pairs = pairs_from_times([got[r]["received_ns"] if r in got else None for r in range(world)],
                                 args.bytes, args.iters, runtime.layout.ranks_per_node)
        text, ok = report(env, pairs, timeout, args.min_gbps)
        print(text, flush=True)
        if args.json:
            args.json.write_text(json.dumps({
                "environment": asdict(env), "bytes": args.bytes, "iters": args.iters, "wait_timeout_s": timeout,
                "pairs": [asdict(p) for p in pairs], "failed": failures(pairs, timeout), "ok": ok,
                "done_at": {r: g["done_at"] for r, g in got.items()}}, indent=1))
        board.post("preflight-verdict", "ok" if ok else "failed")
    else:
        ok = board.read("preflight-verdict", 0, timeout + 10) == "ok"  # rank 0 judges
    runtime.finalize()
    dist.destroy_process_group()
    return 0 if ok else 1
