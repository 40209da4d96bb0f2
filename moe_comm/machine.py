"""What `train` refuses on the machine it launches from, in one place.

`train` loads the recipe for this machine (moe_comm.recipe.load with here=True: this machine's
device, GPU and environment, so a GPU recipe on a machine without one is refused by the
backend or the layout checks) and refuses a CPU run whose memory estimate exceeds this
machine's memory (it would swap or be killed, minutes later, from inside a rank). `check`
asks the same questions and lists the answer as a launch blocker of this machine after its
plan, so the two never disagree.
"""

import os
from pathlib import Path

from moe_comm import recipe
from moe_comm.errors import RecipeError
from moe_comm.predict import estimate, scale_model

# cgroup v2, then v1: a container's limit, below the host's memory
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def memory_bytes() -> int:
    """This machine's memory for the run: physical memory, or the container's limit if lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_LIMITS:
        try:
            limit = path.read_text().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def memory_estimate(r: recipe.Recipe) -> estimate.MemoryEstimate:
    """The per-rank memory estimate `check` prints, as the scale model prices the recipe's backend
    (what its recompute keeps, its CUDA graph pools; ValueError where the model does not cover the
    layout)."""
    return scale_model.memory(scale_model.workload_from_recipe(r), r.config.moe_comm.backend)


def memory_problem(r: recipe.Recipe) -> str:
    """Why a CPU run does not fit in this machine's memory ("" when it does, or on GPUs)."""
    if r.device != "cpu":
        return ""
    try:
        per_rank = memory_estimate(r).total
    except ValueError:
        return ""
    ranks = r.layout.procs_per_node
    need, have = per_rank * ranks, memory_bytes()
    if need <= have:
        return ""
    G = estimate.GiB
    return (f"a CPU run of [model] flavor = {r.config.model.flavor!r} needs about {need / G:.1f} GiB ({ranks} "
            f"process(es) x {per_rank / G:.1f} GiB: parameters, AdamW state, activations; `python -m moe_comm "
            f"check` prints the terms) and this machine has {have / G:.1f} GiB: train a smaller flavor (e.g. "
            "--model.flavor debugmodel), a smaller --training.local_batch_size or --training.seq_len, or run "
            "it on a GPU machine")


def load_here(path: str, overrides: list[str], *, nnodes: int | None = None, nproc_per_node: int | None = None,
              check_paths: bool = True) -> recipe.Recipe:
    """The recipe as `train` loads it on this machine; RecipeError for what `train` refuses."""
    r = recipe.load(path, overrides, nnodes=nnodes, nproc_per_node=nproc_per_node, here=True,
                    check_paths=check_paths)
    problem = memory_problem(r)
    if problem:
        raise RecipeError(problem)
    return r


def refusal(path: str, overrides: list[str], *, nnodes: int | None = None, nproc_per_node: int | None = None) -> str:
    """What `train` would refuse on this machine, the files aside ("" when nothing), as a
    launch blocker: `check` lists it after the files' (moe_comm.files) blockers."""
    from moe_comm import gpus

    try:
        load_here(path, overrides, nnodes=nnodes, nproc_per_node=nproc_per_node, check_paths=False)
    except RecipeError as e:
        machine = gpus.this_machine()
        where = f"a {machine[0]}" if machine else "no CUDA GPU"
        return f"`train` on this machine ({where}) refuses this recipe: {e}"
    return ""
