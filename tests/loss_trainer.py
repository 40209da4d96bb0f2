"""TorchTitan's trainer, recording each step's local loss exactly (float.hex) for the tests.

Run under torchrun like `-m torchtitan.train`:
    torchrun --nproc_per_node 2 tests/loss_trainer.py --job.config_file R.toml ...
Each rank writes {dump_folder}/losses_rank{R}.json: the loss each step returned, before the
all-reduce, as float.hex strings, so two runs can be compared to the bit.
"""

import json
import os

from torchtitan.train import main, Trainer


class LossRecordingTrainer(Trainer):
    def forward_backward_step(self, *args, **kwargs):
        loss = super().forward_backward_step(*args, **kwargs)
        self.__dict__.setdefault("recorded_losses", []).append(float(loss.detach()).hex())
        return loss

    def close(self) -> None:
        rank = int(os.environ.get("RANK", "0"))
        path = os.path.join(self.job_config.job.dump_folder, f"losses_rank{rank}.json")
        os.makedirs(self.job_config.job.dump_folder, exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.__dict__.get("recorded_losses", []), f)
        super().close()


if __name__ == "__main__":
    main(LossRecordingTrainer)
