"""Slurm side of the project: turn a validated recipe into a job script (sbatch.py) and submit
it (submit.py). The validation itself, [cluster] section included, is moe_comm.recipe's."""
