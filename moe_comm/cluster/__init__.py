"""Slurm side of the project: turn a recipe into a job script (sbatch.py), check that its node
and GPU counts fit the recipe's parallel layout (layout.py), and submit it (submit.py)."""
