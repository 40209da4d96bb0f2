"""TorchTitan's trainer, running every step once per MoE overlap variant from the same weights.

`run_rank` is one rank of it, as torchrun would start `-m torchtitan.train` (tests/ranks.py
starts them), with the variants in MOE_COMM_TEST_VARIANTS (comma-separated, the first is the
reference):
    plain      [moe_comm] overlap = "none", no sync points, the schedule's own action lists
    chunked    [moe_comm] overlap = "chunked"
    dualpipev  DualPipeV's EP overlap: TorchTitan's overlap callback and our sync points
               (needs pipeline_parallel_schedule = "DualPipeV" and EP)
    dualpipev+chunked  the same, with [moe_comm] overlap = "chunked": the forwards outside a
               pair chunked
    microbatch [moe_comm] overlap = "microbatch": Interleaved1F1B's steady state overlapped
               (moe_comm.titan.pipeline; launch with overlap "microbatch" and that schedule,
               the plain variant then runs torch's own Interleaved1F1B lists)
A variant ending in "_noac" runs the model's checkpointed blocks without their checkpoint (as
if [activation_checkpoint] mode were "none"), one ending in "_layerac" keeps the checkpoint of
the even layers only (per-layer selective AC), so one launch built with full AC compares them.
Each step runs forward + backward for every variant on the same batch and weights (gradients
cleared in between); the optimizer then steps with the last variant's gradients. Each rank
writes {dump_folder}/overlap_rank{R}.json: whether parallelize gave every MoE layer DualPipeV's
sync points, and per variant and step the loss (float.hex) and, against
the reference, the largest gradient difference over the expert weights and over every other
parameter (relative to that parameter's largest reference gradient), how many DualPipeV
sync barriers the two threads passed, how often the backends' dispatch and combine were
called and how many overlapped pipeline actions ran, so one launch compares all variants; and
the overlapped action lists the run was built with.
"""

import copy
import json
import os
from pathlib import Path

import torch
from torch.distributed.pipelining.schedules import OVERLAP_F_B, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor
from torchtitan.distributed import dual_pipe_v
from torchtitan.distributed.dual_pipe_v import overlap_callback
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torchtitan.models.deepseek_v3 import deepseekv3_args
from torchtitan.train import Trainer

from moe_comm.backends.nccl import NcclBackend
from moe_comm.titan import pipeline
from moe_comm.titan.model import TokenLevelMoE

import ranks

REPO = Path(__file__).resolve().parents[1]


def variants() -> list[str]:
    return os.environ.get("MOE_COMM_TEST_VARIANTS", "plain,chunked").split(",")


# DualPipeV sync-point crossings (barriers while TorchTitan's coordination is on), counted so
# the test knows the dualpipev variant really ran its two threads in lockstep.
_barriers = {"passed": 0}
_titan_barrier = dual_pipe_v.HookCoordinator.barrier


def _counting_barrier(self):
    if self.is_coordination_enabled():
        _barriers["passed"] += 1
    return _titan_barrier(self)


dual_pipe_v.HookCoordinator.barrier = _counting_barrier

# Calls of the backends' dispatch and combine (the nccl backend's: these trainings run on CPU;
# forward calls, the backward runs through autograd), to check that a recompute makes none.
_calls = {"dispatch": 0, "combine": 0}


def _counting(op):
    real = getattr(NcclBackend, op)

    def counted(self, *args):
        _calls[op] += 1
        return real(self, *args)

    return counted


for _op in _calls:
    setattr(NcclBackend, _op, _counting(_op))


def _no_checkpoint(fn, *args, **kwargs):
    return fn(*args, **kwargs)


_overlapped_actions = {"ran": 0}


def _counted_overlap_f_b(action, ctx):
    _overlapped_actions["ran"] += 1
    return pipeline.overlap_f_b(action, ctx)


def _action_lists(schedule) -> dict:
    """The lowered action lists of a schedule built with overlap "microbatch", and those of
    torch's own Interleaved1F1B for the plain variants (the same schedule object)."""
    built = schedule.pipeline_order_with_comms
    plain = {r: schedule._calculate_single_rank_operations(r) for r in range(schedule.pp_group_size)}
    schedule._prepare_schedule_with_comms(plain)
    lists = {"plain": schedule.pipeline_order_with_comms, "microbatch": built}
    schedule.pipeline_order_with_comms = built
    return lists


def _set_variant(trainer: Trainer, variant: str) -> None:
    variant, _, ac = variant.partition("_")
    for part in trainer.model_parts:
        for name, block in getattr(part, "layers", {}).items():
            if isinstance(block, CheckpointWrapper):
                built = block.__dict__.setdefault("built_checkpoint_fn", block.checkpoint_fn)
                on = ac == "" or (ac == "layerac" and int(name) % 2 == 0)
                block.checkpoint_fn = built if on else _no_checkpoint
        for module in part.modules():
            if isinstance(module, TokenLevelMoE):
                module.sync_points = variant in ("dualpipev", "dualpipev+chunked", "microbatch")
                module.comm_backend.config.overlap = {"chunked": "chunked", "dualpipev+chunked": "chunked",
                                                      "microbatch": "microbatch"}.get(variant, "none")
    schedule = getattr(trainer, "pp_schedule", None)
    functions = getattr(schedule, "_comp_type_to_function_map", None)
    if functions is not None:
        if variant in ("dualpipev", "dualpipev+chunked"):
            functions[OVERLAP_F_B] = overlap_callback
        elif variant == "microbatch":
            functions[OVERLAP_F_B] = _counted_overlap_f_b
        else:
            functions.pop(OVERLAP_F_B, None)  # the schedule runs F then B, one thread
    lists = getattr(trainer, "action_lists", None)
    if lists is not None:
        schedule.pipeline_order_with_comms = lists["microbatch" if variant == "microbatch" else "plain"]


def _grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    grads = {}
    for i, part in enumerate(trainer.model_parts):
        for name, p in part.named_parameters():
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                grads[f"{i}.{name}"] = g.detach().clone()
    return grads


def _max_rel_diff(ref: dict, got: dict, experts: bool) -> float:
    assert ref.keys() == got.keys(), "the variants produced gradients for different parameters"
    worst = 0.0
    for name in ref:
        if (".experts." in name) != experts:
            continue
        scale = ref[name].abs().max().item()
        diff = (got[name] - ref[name]).abs().max().item()
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


class OverlapTrainer(Trainer):
    def forward_backward_step(self, *args, **kwargs):
        if "overlap_record" not in self.__dict__:
            # what parallelize set up, before any variant changes it
            self.overlap_record = {v: [] for v in variants()}
            self.overlap_record["built_with_sync_points"] = all(
                m.sync_points for part in self.model_parts for m in part.modules() if isinstance(m, TokenLevelMoE)
            )
            schedule = getattr(self, "pp_schedule", None)
            if isinstance(schedule, ScheduleInterleaved1F1B) and self.job_config.moe_comm.overlap == "microbatch":
                self.overlap_record["built_actions"] = [str(a) for a in schedule.pipeline_order[schedule.rank]]
                self.overlap_record["built_callback"] = (
                    schedule._comp_type_to_function_map.get(OVERLAP_F_B) is pipeline.overlap_f_b)
                self.action_lists = _action_lists(schedule)
        record = self.overlap_record
        reference = None
        for variant in variants():
            _set_variant(self, variant)
            self.optimizers.zero_grad()
            _barriers["passed"] = 0
            _calls.update(dispatch=0, combine=0)
            _overlapped_actions["ran"] = 0
            loss = super().forward_backward_step(*args, **kwargs)
            grads = _grads(self)
            reference = reference or grads
            record[variant].append({
                "loss": float(loss.detach()).hex(),
                "experts_grad_rel": _max_rel_diff(reference, grads, experts=True),
                "other_grad_rel": _max_rel_diff(reference, grads, experts=False),
                "sync_barriers": _barriers["passed"],
                "calls": dict(_calls),
                "overlapped_actions": _overlapped_actions["ran"],
            })
        return loss

    def close(self) -> None:
        rank = int(os.environ.get("RANK", "0"))
        path = os.path.join(self.job_config.job.dump_folder, f"overlap_rank{rank}.json")
        os.makedirs(self.job_config.job.dump_folder, exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.__dict__.get("overlap_record", {}), f)
        super().close()


# TorchTitan's debug model with 4 attention heads instead of 16: the same layers, stages, MoE
# layers and overlaps, in well under half the CPU time (its 16 heads' projections, 192 and 256
# wide each, cost more than its experts). The trainings select it with --model.flavor.
FLAVOR = "debugmodel_4heads"


def run_rank(rank: int, world: int, port: int, variants: str, argv: list[str]) -> None:
    """One rank of a training, started by tests/ranks.py as torchrun would start
    `-m torchtitan.train ARGV` with this trainer (from the repository root: recipes name their
    assets from there). torchtitan.train.main's steps, with ARGV given (ranks.train_here)."""
    ranks.torchrun_env(rank, world, port)
    os.environ["MOE_COMM_TEST_VARIANTS"] = variants
    os.chdir(REPO)
    args = copy.deepcopy(deepseekv3_args["debugmodel"])
    args.n_heads = 4
    deepseekv3_args.setdefault(FLAVOR, args)
    ranks.train_here(OverlapTrainer, argv)
