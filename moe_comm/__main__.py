"""`python -m moe_comm VERB ...`: one entry point, thin verbs.

Each verb lives in its own module, which exposes `add_arguments(parser)` and `main(args) -> int`.
Modules are imported only when their verb runs, so `check` never pays for CUDA or W&B imports.
"""

import argparse
import importlib
import sys

VERBS = {
    "train": ("moe_comm.launch", "validate a recipe, then train it (torchrun on one node, srun per node under Slurm)"),
    "check": ("moe_comm.check", "validate a recipe; print its layout, memory estimate and per-backend comm and MFU predictions"),
    "plan": ("moe_comm.plan", "rank the layouts a recipe could run on a cluster, per backend, by predicted tok/s/GPU"),
    "assets": ("moe_comm.assets", "fetch a recipe's tokenizer and dataset from the Hugging Face hub, or say what is missing"),
    "submit": ("moe_comm.cluster.submit", "render the Slurm job for a recipe and sbatch it"),
    "report": ("moe_comm.report", "plots and a markdown table comparing runs' metrics"),
    "dashboard": ("moe_comm.dashboard", "create a W&B workspace comparing backends"),
    "build": ("moe_comm.kernels.build", "compile the CUDA dispatch/combine extension ahead of time"),
    "preflight": ("moe_comm.preflight", "bring NVSHMEM up across a job's ranks and time every pair (run under torchrun/srun)"),
    "build-deepep": ("moe_comm.backends.deepep_build", "build and install DeepEP v1.2.1 (the deepep backend)"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_comm", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    argv = sys.argv[1:] if argv is None else argv
    verb = argv[0] if argv and argv[0] in VERBS else None
    for name, (module_name, help_text) in VERBS.items():
        verb_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == verb:
            importlib.import_module(module_name).add_arguments(verb_parser)
    args = parser.parse_args(argv)
    return importlib.import_module(VERBS[args.verb][0]).main(args)


if __name__ == "__main__":
    sys.exit(main())
