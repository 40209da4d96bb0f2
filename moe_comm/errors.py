"""The one error type for bad input: a recipe, an override or a launch that cannot work.

Raised before any process starts wherever the problem can be known then (recipe.py, the
backends' `check_run`, the launcher, submit), and at model build for what only the ranks can
see. The message names the field and says the fix; the CLI prints it as one line.
"""


class RecipeError(ValueError):
    """A recipe problem, with the field and the fix in the message."""


class LaunchBlockers(RecipeError):
    """What stops a launch on this machine (moe_comm.files: a missing tokenizer, an unreadable
    dataset, an unusable dump folder), all of them at once: one line each."""

    def __init__(self, blockers: list[str]):
        super().__init__("; ".join(blockers))
        self.blockers = list(blockers)
