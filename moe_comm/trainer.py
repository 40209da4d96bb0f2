"""`python -m moe_comm.trainer`: what torchrun runs on every rank of `moe_comm train` -
TorchTitan's own trainer (torchtitan.train's `main(Trainer)`), unchanged.

One thing comes first: TorchTitan logs its version before it reads the recipe, so before the
recipe's custom_import (moe_comm.titan) routes its log. `console.hold_early_lines` keeps that
line for the rank's log file instead of printing it on every run.
"""

from torchtitan.train import main, Trainer

from moe_comm import console

if __name__ == "__main__":
    console.hold_early_lines()
    main(Trainer)
