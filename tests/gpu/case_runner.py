"""What the GPU case scripts share: the process group (NCCL with a GPU per rank, gloo when
ranks share GPUs under CUDA MPS, since NCCL refuses two ranks on one GPU), and running cases
into one PASS/FAIL report that every rank contributes to."""

import gc
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist


def start_group() -> int:
    """Binds this rank to its GPU and starts the default group; returns the GPU count."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count()
    torch.cuda.set_device(local_rank % gpus)
    if int(os.environ["WORLD_SIZE"]) <= gpus:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    return gpus


class CaseLog:
    """PASS, or FAIL with the traceback, per case and rank. Each case ends on a barrier, so a
    failing rank never leaves the others waiting inside the next case's collectives."""

    def __init__(self):
        self.rank = dist.get_rank()
        self.results = {}

    def run(self, name, fn, *args):
        start = time.time()
        try:
            fn(*args)
            dist.barrier()
            self.results[name] = "PASS"
        except Exception:  # noqa: BLE001 - every failure goes to the report
            self.results[name] = "FAIL\n" + traceback.format_exc()
            print(f"[rank {self.rank}] {name} FAILED\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        # What the case held goes back (its backends' CUDA graph pools among it), so a launch needs
        # its largest case's memory, not all of its cases' (run 52: 8 PEs on one H200 reached 17.5
        # GiB each, 10.5 of it the graph pools of finished cases, and ran out of memory)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self.rank == 0:
            print(f"{name}: {self.results[name].splitlines()[0]} ({time.time() - start:.1f} s)", flush=True)

    def merged(self) -> dict:
        """Every rank's results in one: a case passes when it passed on every rank."""
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, self.results)
        merged = {}
        for name in self.results:
            failures = [f"rank {r}: {res[name]}" for r, res in enumerate(per_rank) if res[name] != "PASS"]
            merged[name] = "PASS" if not failures else "FAIL\n" + "\n".join(failures)
        return merged
