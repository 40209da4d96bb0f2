"""Start test ranks as torch.multiprocessing.spawn does, without each importing torch again.

A spawned child is a fresh interpreter: it imports torch, TorchTitan and moe_comm (about 10
CPU-seconds on a 2-core machine) before its first line of test code, which often runs in a
second. Here the children are forked from multiprocessing's fork server, which has imported
them once for the session; each child then runs the function as spawn would: rank first, the
caller's environment and working directory, a failing rank fails the call with its traceback.

`torchrun_env` gives a rank what torchrun would (RANK, LOCAL_RANK, WORLD_SIZE, ..., one thread),
and `train_here` runs a TorchTitan trainer in it, for the tests that run TorchTitan's trainer itself; the `train` verb's own launch is tested
through torchrun (tests/conftest.py's runs).
"""

import importlib
import multiprocessing
import os
import time

import torch
import torch.multiprocessing as mp

# What the suite's rank functions import; the server loads them once, before its first fork.
PRELOAD = ["torch", "torch.distributed", "torchtitan.train", "moe_comm.metrics", "moe_comm.backends",
           "moe_comm.titan"]


def _run(rank: int, fn, environ: dict[str, str], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    if isinstance(fn, str):
        module, name = fn.split(":")
        fn = getattr(importlib.import_module(module), name)
    fn(rank, *args)


def spawn(fn, args: tuple = (), nprocs: int = 2, timeout_s: float = 600) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs), the children forked from the fork server.

    `fn` may be named "module:function", imported by the ranks only: for a module that patches
    what it imports (tests/overlap_trainer.py), which the test process must not import. Ranks
    still running after `timeout_s` are killed and named in the error (a hung collective fails
    the test instead of the session)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    ranks = mp.start_processes(_run, args=(fn, dict(os.environ), args), nprocs=nprocs, join=False,
                               start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    while not ranks.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            alive = [rank for rank, p in enumerate(ranks.processes) if p.is_alive()]
            for p in ranks.processes:
                p.kill()
            raise TimeoutError(f"{getattr(fn, '__name__', fn)}: rank(s) {alive} of {nprocs} still running after "
                               f"{timeout_s:g} s; killed")


def torchrun_env(rank: int, world: int, port: int) -> None:
    """This process as torchrun --standalone starts rank `rank` of `world` on one machine."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1, which the imported torch no longer reads


def train_here(trainer_class, argv: list[str]) -> None:
    """torchtitan.train.main's steps in this process, with ARGV given: main() parses sys.argv
    through a default argument fixed when TorchTitan was imported, and the fork server imported it
    before any rank's argv existed. The trainer is closed and the process group destroyed however
    training ends."""
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    trainer = trainer_class(ConfigManager().parse_args(argv))
    try:
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

