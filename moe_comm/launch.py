"""`python -m moe_comm train RECIPE.toml [TorchTitan overrides]`: validate, then train.

One node (the default):
    python -m moe_comm train recipes/debug_cpu.toml --training.steps 5
runs `torchrun --standalone --nproc_per_node N -m torchtitan.train --job.config_file RECIPE
--training.steps 5`, where N is the recipe's [cluster] gpus_per_node (on CPU: the number of
processes) unless `--nproc-per-node` overrides it.

Multi-node contract (the Slurm template calls this once per node through srun):
    python -m moe_comm train RECIPE.toml --nnodes N --rdzv-endpoint HOST:PORT --rdzv-id ID \\
        [--nproc-per-node G] [-- TorchTitan overrides]
switches torchrun to c10d rendezvous:
    torchrun --nnodes N --nproc_per_node G --rdzv_backend c10d --rdzv_endpoint HOST:PORT
             --rdzv_id ID -m torchtitan.train --job.config_file RECIPE ...
All three of --nnodes/--rdzv-endpoint/--rdzv-id are needed together, and a recipe whose
[cluster] nodes > 1 is refused without them (submit it with `python -m moe_comm submit`).
TorchTitan overrides may follow `--` or be given directly; anything this parser does not know
is passed to TorchTitan. The torchrun command also gets `--local-ranks-filter 0` (see --log-rank).
The recipe is validated for the whole world (nnodes x nproc-per-node) before torchrun starts.
`--dry-run` prints the torchrun command instead of running it.
"""

import argparse
import os
import shlex
import subprocess
import sys

from moe_comm import recipe

# Every GPU run keeps NVLink SHARP / multicast off (NOTES: the device must not use it).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe TOML file (recipes/*.toml)")
    _add_launch_flags(parser)
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="TorchTitan overrides, e.g. --training.steps 5")


def _add_launch_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc-per-node", type=int, default=None, help="processes per node (default: [cluster] gpus_per_node)")
    parser.add_argument("--nnodes", type=int, default=None, help="nodes in the job (multi-node: with --rdzv-endpoint and --rdzv-id)")
    parser.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous (the first node)")
    parser.add_argument("--rdzv-id", default=None, help="rendezvous id shared by all nodes, e.g. $SLURM_JOB_ID")
    parser.add_argument("--log-rank", default="0", help="ranks whose output torchrun shows (torchrun --local-ranks-filter); 'all' for every rank")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the torchrun command, run nothing")


def torchrun_command(args: argparse.Namespace, r: recipe.Recipe, overrides: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    multi_node = (args.nnodes, args.rdzv_endpoint, args.rdzv_id)
    if any(v is not None for v in multi_node):
        if not all(v is not None for v in multi_node):
            raise recipe.RecipeError(
                "--nnodes, --rdzv-endpoint and --rdzv-id go together (multi-node c10d rendezvous); "
                "give all three or none"
            )
        cmd += [
            "--nnodes", str(args.nnodes),
            "--nproc_per_node", str(r.layout.procs_per_node),
            "--rdzv_backend", "c10d",
            "--rdzv_endpoint", args.rdzv_endpoint,
            "--rdzv_id", str(args.rdzv_id),
        ]
    else:
        cmd += ["--standalone", "--nproc_per_node", str(r.layout.procs_per_node)]
    if args.log_rank != "all":
        cmd += ["--local-ranks-filter", args.log_rank]
    cmd += ["-m", "torchtitan.train", "--job.config_file", args.recipe, *overrides]
    return cmd


def main(args: argparse.Namespace) -> int:
    overrides = recipe.split_cli_overrides(args, _add_launch_flags)
    try:
        r = recipe.load(args.recipe, overrides, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node)
        if args.nnodes is None and r.layout.nodes > 1:
            raise recipe.RecipeError(
                f"[cluster] nodes = {r.layout.nodes}: this recipe spans several nodes; submit it "
                "with `python -m moe_comm submit`, or run `train` on every node with --nnodes, "
                "--rdzv-endpoint and --rdzv-id"
            )
        cmd = torchrun_command(args, r, overrides)
    except recipe.RecipeError as e:
        return recipe.main_error(e)

    env = dict(os.environ)
    if r.layout.procs_per_node > 1:  # what torchrun sets anyway, without its 4-line banner
        env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1" if r.config.training.dataset == "c4_test" else "0")
    if r.device == "cuda":
        env.update(GPU_ENV)
    print("+ " + shlex.join(cmd), flush=True)
    if args.dry_run:
        return 0
    return subprocess.call(cmd, env=env)
