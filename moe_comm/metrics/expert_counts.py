"""Per-expert routed token counts per MoE layer per training step, into the dump folder.

`[moe_comm] log_expert_counts = true` turns it on. What it records is what TorchTitan's MoE already
counts: each MoE layer's `tokens_per_expert` buffer, the (token, expert) picks of the router over
the step's forward passes (all microbatches), which the aux-loss-free load balancing reads in an
optimizer step pre-hook (`build_optimizers_with_moe_load_balancing`) and then zeroes. So the
counts are read in an optimizer step pre-hook too, one that runs before TorchTitan's: a global
pre-hook (torch runs global pre-hooks before an optimizer's own), limited to the run's
OptimizersContainer. It stacks the layers' counts on the device (no host sync); the metrics
processor's log copies the steps since its last line to the host in one small transfer and writes
them. Counted as TorchTitan counts them for its bias update: under activation checkpointing the
recomputed forward counts again, so checkpointed blocks' counts are halved (TorchTitan's rule);
with load balancing off (load_balance_coeff None) TorchTitan never zeroes them, so each step's
counts are the difference from the previous step's.

Each rank writes its own tokens' counts (no collective): `expert_counts/rank{R}.jsonl` in the
dump folder, a "run" line first, then one "step" line per training step:
    {"kind": "run", "rank", "world_size", "ep", "num_experts", "top_k", "layers": [ids],
     "load_balance_coeff", "tokens_per_step", "recipe", "flavor"}
    {"kind": "step", "step", "counts": [[tokens per expert] per layer]}
The sum over ranks of one step's counts is the step's routing over all of the run's tokens.
experiments/routing_imbalance.py reads them.
"""

import json
import os

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

FOLDER = "expert_counts"


def _moe_blocks(model_parts) -> list[tuple[str, torch.nn.Module]]:
    """(layer id, block) of every MoE block of this rank's model parts, in model order."""
    return [(name, block) for part in model_parts for name, block in part.get_submodule("layers").items()
            if block is not None and getattr(block, "moe_enabled", False)]


def _recomputed(block) -> bool:
    """TorchTitan's test for a checkpointed block (components/optimizer.py): its forward, hence
    its counting, runs twice per step."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    return getattr(block, "checkpoint_impl", None) is CheckpointImpl.NO_REENTRANT


class ExpertCountLog:
    def __init__(self, dump_folder: str, rank: int, run_fields: dict):
        self.path = os.path.join(dump_folder, FOLDER, f"rank{rank}.jsonl")
        self.rank = rank
        self.run_fields = run_fields
        self._pending: list[torch.Tensor] = []  # [layers, experts] per step since the last write
        self._previous: torch.Tensor | None = None  # cumulative counts, where nothing zeroes them
        self._handle = None
        self._file = None
        self._blocks: list[tuple[str, torch.nn.Module]] = []

    def attach(self, optimizers, model_parts) -> None:
        """Read the counts at every step of `optimizers` (TorchTitan's OptimizersContainer),
        before its own pre-hooks run. `model_parts` is a callable returning this rank's model
        parts (TorchTitan assigns them to the processor just after the optimizers)."""
        self.detach()

        def before_step(optimizer, args, kwargs):
            if optimizer is optimizers:
                self._snapshot(model_parts())

        self._handle = register_optimizer_step_pre_hook(before_step)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _snapshot(self, model_parts) -> None:
        if not self._blocks:
            self._blocks = _moe_blocks(model_parts)
            if not self._blocks:
                return
        with torch.no_grad():
            counts = torch.stack([
                b.moe.tokens_per_expert // 2 if _recomputed(b) else b.moe.tokens_per_expert for _, b in self._blocks
            ])
            if self._blocks[0][1].moe.load_balance_coeff is None:  # nothing zeroes them: difference
                step_counts = counts if self._previous is None else counts - self._previous
                self._previous = counts
                counts = step_counts
        self._pending.append(counts)

    def write(self, step: int) -> None:
        """The steps read since the last write, ending at `step`: one host copy for all of them."""
        if not self._pending:
            return
        host = torch.stack(self._pending).to(torch.int64).cpu().tolist()
        self._pending = []
        if self._file is None:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._file = open(self.path, "a")  # a requeued run appends; readers keep a step's last line
            moe = self._blocks[0][1].moe
            self._file.write(json.dumps({
                "kind": "run", "rank": self.rank, **self.run_fields, "layers": [name for name, _ in self._blocks],
                "num_experts": int(moe.tokens_per_expert.numel()), "top_k": moe.router.top_k,
                "load_balance_coeff": moe.load_balance_coeff,
            }) + "\n")
        first = step - len(host) + 1
        for i, counts in enumerate(host):
            self._file.write(json.dumps({"kind": "step", "step": first + i, "counts": counts}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self.detach()
        if self._file is not None:
            self._file.close()
            self._file = None
