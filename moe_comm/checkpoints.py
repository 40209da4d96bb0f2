"""Which checkpoint a run resumes from, decided by `train` before the ranks start.

TorchTitan resumes from the newest `step-N` folder that has a `.metadata` file and trusts it.
Two kinds of folder then kill every restart of the job the same way:
  - a truncated shard (a node died while writing, a full disk): DCP reads past its end and
    fails with a bare EOFError that names no file;
  - a model-only checkpoint (TorchTitan's default last save, `last_save_model_only`): it has no
    optimizer, dataloader or train state, so loading it to resume fails with "Missing key in
    checkpoint state_dict: dataloader.dp_rank_0".
Reading each checkpoint's DCP metadata (which lists every tensor's file, offset and length)
finds both without loading a byte of the tensors. The run then resumes from the newest usable
checkpoint and says which one it skipped and why, or stops naming the folder to remove.
"""

from dataclasses import dataclass
from pathlib import Path

from moe_comm.errors import RecipeError

TRAIN_STATE = "train_state."  # TorchTitan's keys of the step counter; absent from model-only saves


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    problem: str = ""  # why it cannot resume training; "" when it can

    @property
    def usable(self) -> bool:
        return not self.problem


def _problem(path: Path, step: int) -> str:
    from torch.distributed.checkpoint import FileSystemReader

    if not (path / ".metadata").is_file():
        return f"{path} holds the model only, in HF safetensors ([checkpoint] last_save_in_hf), which cannot resume training"
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a truncated or foreign .metadata: unpickling fails in many ways
        return f"{path / '.metadata'} cannot be read ({type(e).__name__}: {e})"
    if step > 0 and not any(k.startswith(TRAIN_STATE) for k in metadata.state_dict_metadata):  # step 0: a seed
        return (f"{path} holds the model only (TorchTitan's last save with [checkpoint] "
                "last_save_model_only = true), which cannot resume training")
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for name, end in sorted(need.items()):
        shard = path / name
        if not shard.is_file():
            return f"{shard} is missing"
        size = shard.stat().st_size
        if size < end:
            return f"{shard} is truncated: {size} bytes, its metadata needs {end}"
    return ""


def inspect(folder: Path) -> list[Checkpoint]:
    """The checkpoints TorchTitan would consider in `folder`, newest first, each checked."""
    found = []
    if folder.is_dir():
        for child in folder.iterdir():
            name = child.name
            probes = (child / ".metadata", child / "model.safetensors.index.json")  # TorchTitan's
            if name.startswith("step-") and name[5:].isdigit() and any(p.is_file() for p in probes):
                found.append(Checkpoint(int(name[5:]), child, _problem(child, int(name[5:]))))
    return sorted(found, key=lambda c: c.step, reverse=True)


@dataclass(frozen=True)
class Resume:
    """Where a run in this folder resumes: the checkpoint's step (None: from step 0), whether
    TorchTitan must be told it (`--checkpoint.load_step`, when its own choice, the newest
    folder, cannot resume), and what to tell the user."""

    step: int | None
    load_step: int | None
    messages: list[str]


def resume_step(folder: Path, load_step: int = -1) -> Resume:
    """The checkpoint a run resumes from (see `Resume`).

    Raises RecipeError when nothing in the folder can resume the run, naming the folder."""
    checkpoints = inspect(folder)
    if load_step != -1:
        chosen = next((c for c in checkpoints if c.step == load_step), None)
        if chosen is None and not folder.is_dir():  # TorchTitan then starts from step 0 (no folder to load from)
            return Resume(None, None, [])
        if chosen is None:
            have = ", ".join(c.path.name for c in checkpoints) or "none"
            raise RecipeError(f"[checkpoint] load_step = {load_step}: {folder} has no step-{load_step} (it has: {have})")
        if not chosen.usable:
            raise RecipeError(f"[checkpoint] load_step = {load_step}: {chosen.problem}; choose another step or remove it")
        return Resume(load_step, None, [])
    if not checkpoints:
        return Resume(None, None, [])
    if checkpoints[0].usable:
        return Resume(checkpoints[0].step, None, [])
    skipped = []
    for c in checkpoints:
        if c.usable:
            skipped.append(f"resuming from {c.path.name}, the newest usable checkpoint")
            return Resume(c.step, c.step, skipped)
        skipped.append(f"skipping {c.path.name}: {c.problem}")
    raise RecipeError(
        f"no checkpoint in {folder} can resume training ({'; '.join(skipped)}): remove {folder} to "
        "start from step 0, or restore an intact checkpoint into it"
    )
