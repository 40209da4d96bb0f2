"""The train spec's dataloader: TorchTitan's own (build_text_dataloader), with a bad record named.

`train` reads a local dataset's records before launch as far as moe_comm.files.FULL_READ_BYTES
goes; a larger dataset can still hold a bad record further on. Where TorchTitan's loader then
fails on one (datasets' JSON reader while loading, or the record's text field while training),
the rank reads the local files whole (moe_comm.files.dataset_blocker) and raises a RecipeError
that names the file, the line and the field, which moe_comm.console prints as one line. Any
other failure, or one the files do not explain (a hub dataset), is raised as it was.
"""

from torchtitan.hf_datasets.text_datasets import build_text_dataloader

from moe_comm import files
from moe_comm.errors import RecipeError


def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, infinite: bool = True):
    try:
        loader = build_text_dataloader(dp_world_size=dp_world_size, dp_rank=dp_rank, tokenizer=tokenizer,
                                       job_config=job_config, infinite=infinite)
    except Exception as e:
        raise _named(job_config, e) from e
    loader.dataset._text_processor = _Text(loader.dataset._text_processor, job_config)
    return loader


class _Text:
    """TorchTitan's text processor (sample -> its text field), naming a record it cannot read."""

    def __init__(self, read, job_config):
        self.read = read
        self.job_config = job_config

    def __call__(self, sample) -> str:
        try:
            value = self.read(sample)
        except (KeyError, TypeError) as e:
            raise _named(self.job_config, e) from e
        if not isinstance(value, str):
            raise _named(self.job_config, TypeError(f"a record's text is a {type(value).__name__}"))
        return value


def _named(job_config, error: Exception) -> Exception:
    """The RecipeError naming the bad record when the local files show one, else `error`."""
    blocker = files.dataset_blocker(job_config)
    return RecipeError(f"{blocker} (found after the data loader failed: {type(error).__name__})") if blocker else error
