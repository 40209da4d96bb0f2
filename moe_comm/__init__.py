"""Wide expert-parallel DeepSeek-V3 training on TorchTitan with swappable MoE dispatch/combine.

The package's floors, bottom up. A module imports only modules of its own floor or below, and
no imports go round in a circle (tests/test_house.py holds every module to both, imports inside
functions included):
  1  errors config gpus console heartbeat relay layout kernels fp8_experts
  2  backends
  3  recipe titan_fields files metrics claim checkpoints lr_schedule plots
  4  titan predict cluster
  5  __main__ machine check plan report dashboard launch assets preflight trainer
Floor 1 is what every room stands on: the recipe's [moe_comm] section and its one error type,
the GPU facts, the console, liveness and log relay of a rank, the run's layout (the flavor, the parallel
degrees and their rules, the plan a backend is checked with), the Python side of the CUDA
kernels and the FP8 routed experts built on them. Floor 2 holds the backends behind one interface. Floor 3 loads and checks a recipe and
keeps what a run records (metrics, its claim on the dump folder, its checkpoints, the plots'
look). Floor 4 builds the model on TorchTitan (titan/), predicts (predict/) and submits to Slurm
(cluster/). Floor 5 holds the verbs of `python -m moe_comm`. Two rooms that need each other
share a lower room instead.
"""

__version__ = "0.1.0"
