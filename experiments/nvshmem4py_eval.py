"""Can nvshmem4py (NVIDIA's Python binding of NVSHMEM) replace the project's own NVSHMEM host code?

The nvshmem backend's host side is ours (csrc/runtime/, moe_comm/kernels/runtime.py): unique-id
bootstrap over the EP group's torch.distributed group, one symmetric heap sized from the recipe,
and a teardown agreed through the job's store so that a peer that died or gave up never holds the
others. nvshmem4py (`nvshmem4py-cu13`) offers init from a unique id, symmetric torch tensors and
finalize. This script runs, on a GPU machine, the cases that decide whether it can take over any
of that without losing what we have, each rank in its own process over a gloo group (several PEs
share one GPU under CUDA MPS, as the GPU tests run them):

  alone       nvshmem4py by itself: init by unique id (its id sent over torch.distributed), the
              PE numbering, a symmetric torch tensor written by a peer through nvshmem4py's put,
              the heap size it honours (NVSHMEM_SYMMETRIC_SIZE), init and finalize times.
  then_ours   nvshmem4py initialises NVSHMEM, then our runtime starts as the nvshmem backend does
              (its own nvshmemx_init_attr from our library, whose kernels are device-linked into
              it): does it come up, and do our kernels work (a dispatch + combine round trip
              checked against the inputs)?
  ours_then   our runtime first, then nvshmem4py's init in the same process.
  dead_peer   nvshmem4py, then one PE exits without finalize: how long the other's finalize takes
              (our teardown never waits on a peer that is gone).

Every case runs in fresh processes under a wall-clock bound, so a crash or a hang is an outcome,
recorded, not the end of the evaluation.

    python experiments/nvshmem4py_eval.py OUT.json [--pes 1 2] [--cases alone then_ours ours_then dead_peer]

Needs: a CUDA GPU, nvshmem4py-cu13 importable (carried as a wheel on machines without network),
the nvidia-nvshmem-cu13 wheel, and csrc/ built (MOE_COMM_LIBRARY, or JIT).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

CASES = ("alone", "then_ours", "ours_then", "dead_peer")
CASE_TIMEOUT_S = 150


# ---- one rank ---------------------------------------------------------------------------------

def _nvshmem4py_init(rank: int, world: int) -> dict:
    """nvshmem4py's unique-id init, its id sent over the default (gloo) group. Returns timings."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import nvshmem.core as nvshmem
    from cuda.core import Device

    device = Device(torch.cuda.current_device())
    device.set_current()
    start = time.perf_counter()
    uid = nvshmem.get_unique_id(empty=rank != 0)
    data = torch.from_numpy(uid._data.view(np.int8).copy())
    dist.broadcast(data, src=0)
    uid._data.view(np.int8)[:] = data.numpy()
    nvshmem.init(device=device, uid=uid, rank=rank, nranks=world, initializer_method="uid")
    return {"init_s": time.perf_counter() - start, "my_pe": nvshmem.my_pe(), "n_pes": nvshmem.n_pes()}


def _symmetric_put(rank: int, world: int) -> dict:
    """A symmetric torch tensor from nvshmem4py; each PE puts its rank into the next PE's copy."""
    import torch
    import nvshmem.core as nvshmem

    t = nvshmem.tensor((1024,), dtype=torch.float32)
    t.fill_(-1.0)
    src = nvshmem.tensor((1024,), dtype=torch.float32)
    src.fill_(float(rank))
    torch.cuda.synchronize()
    nvshmem.barrier(nvshmem.Teams.TEAM_WORLD, stream=torch.cuda.current_stream())
    stream = torch.cuda.current_stream()
    nvshmem.put(t, src, remote_pe=(rank + 1) % world, stream=stream)
    nvshmem.barrier(nvshmem.Teams.TEAM_WORLD, stream=stream)
    torch.cuda.synchronize()
    expected = float((rank - 1) % world)
    ok = bool((t == expected).all().item())
    nvshmem.free_tensor(src)
    nvshmem.free_tensor(t)
    return {"put_ok": ok}


def _ours_round_trip(rank: int, world: int) -> dict:
    """Our runtime as the nvshmem backend starts it, and one dispatch + combine through our
    kernels: with identity experts and weights summing to 1, combine returns the input."""
    import torch
    import torch.distributed as dist

    from moe_comm.backends import build_backend, MoELayerSpec
    from moe_comm.config import MoEComm

    start = time.perf_counter()
    layer = MoELayerSpec(num_experts=8 * world, top_k=4, hidden=1024)
    backend = build_backend(MoEComm(backend="nvshmem", num_sms=8, wait_timeout_s=10.0), layer, dist.group.WORLD)
    started = time.perf_counter() - start
    g = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
    scores = torch.rand(256, layer.num_experts, device="cuda", generator=g)
    topk_w, topk_idx = scores.topk(layer.top_k, dim=1)
    topk_w = topk_w / topk_w.sum(dim=1, keepdim=True)
    d = backend.dispatch(x, topk_idx, topk_w)
    out = backend.combine(d.recv_x_RD, d.handle)
    torch.cuda.synchronize()
    err = ((out.float() - x.float()).norm() / x.float().norm()).item()
    return {"ours_start_s": started, "round_trip_rel_err": err, "round_trip_ok": err < 1e-2}


def rank_main(case: str, rank: int, world: int, port: int, result_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0 if torch.cuda.device_count() < world else rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    record: dict = {"rank": rank, "case": case}

    def save():
        Path(f"{result_path}.{rank}").write_text(json.dumps(record))

    def step(name, fn):
        start = time.perf_counter()
        try:
            record.update(fn(rank, world))
            record[f"{name}"] = "ok"
        except BaseException as e:  # noqa: BLE001 - an outcome to record
            record[f"{name}"] = f"{type(e).__name__}: {e}"[:2000]
        record[f"{name}_s"] = time.perf_counter() - start
        save()
        return record[name] == "ok"

    save()
    if case == "alone":
        if step("nvshmem4py_init", _nvshmem4py_init):
            step("symmetric_put", _symmetric_put)
            import nvshmem.core as nvshmem

            start = time.perf_counter()
            nvshmem.finalize()
            record["finalize_s"] = time.perf_counter() - start
    elif case == "then_ours":
        if step("nvshmem4py_init", _nvshmem4py_init):
            step("ours", _ours_round_trip)
    elif case == "ours_then":
        if step("ours", _ours_round_trip):
            step("nvshmem4py_init", _nvshmem4py_init)
    elif case == "dead_peer":
        if step("nvshmem4py_init", _nvshmem4py_init):
            dist.barrier()
            if rank == world - 1:
                record["exit"] = "without finalize"
                save()
                os._exit(0)
            time.sleep(2.0)
            import nvshmem.core as nvshmem

            start = time.perf_counter()
            record["finalize"] = "started"
            save()
            nvshmem.finalize()
            record["finalize"] = "returned"
            record["finalize_s"] = time.perf_counter() - start
    save()
    os._exit(0)  # leave without the interpreter's teardown (what it would do is not this case)


# ---- the driver -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(case: str, world: int, workdir: Path) -> dict:
    result = workdir / f"{case}_{world}"
    port = _free_port()
    env = dict(os.environ, NVSHMEM_REMOTE_TRANSPORT="none", NVSHMEM_SYMMETRIC_SIZE=str(1 << 30))
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-main", case, str(r), str(world), str(port), str(result)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    start = time.time()
    outcome = "exited"
    for p in procs:
        try:
            p.wait(timeout=max(1.0, CASE_TIMEOUT_S - (time.time() - start)))
        except subprocess.TimeoutExpired:
            outcome = f"timed out after {CASE_TIMEOUT_S} s"
            break
    for p in procs:
        if p.poll() is None:
            p.kill()
    logs = [p.communicate()[0][-3000:] for p in procs]
    ranks = []
    for r in range(world):
        path = Path(f"{result}.{r}")
        ranks.append(json.loads(path.read_text()) if path.exists() else {"rank": r, "record": "none written"})
    return {"case": case, "pes": world, "outcome": outcome, "wall_s": round(time.time() - start, 2),
            "exit_codes": [p.returncode for p in procs], "ranks": ranks, "log_tails": logs}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
        case, rank, world, port, result = sys.argv[2:7]
        rank_main(case, int(rank), int(world), int(port), result)
        return 0
    p = argparse.ArgumentParser(prog="python experiments/nvshmem4py_eval.py", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--pes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    args = p.parse_args()
    import importlib.metadata as md

    versions = {}
    for name in ("nvshmem4py-cu13", "nvidia-nvshmem-cu13", "torch", "cuda-core", "cuda-bindings"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    results = {"versions": versions, "date": time.strftime("%Y-%m-%d"), "cases": []}
    workdir = args.out.parent / (args.out.stem + "_work")
    workdir.mkdir(parents=True, exist_ok=True)
    for world in args.pes:
        for case in args.cases:
            if case == "dead_peer" and world < 2:
                continue
            r = run_case(case, world, workdir)
            results["cases"].append(r)
            print(f"{case} x{world}: {r['outcome']} in {r['wall_s']} s; "
                  + "; ".join(json.dumps({k: v for k, v in x.items() if k not in ('rank', 'case')})[:300] for x in r["ranks"]),
                  flush=True)
            args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
