"""Metrics under pipeline parallelism: each stage knows a different part of the step.

Only the rank that holds the last stage computes the loss; TorchTitan hands every other rank a
placeholder (-1 per microbatch, summed over data-parallel ranks: "loss: -2.00000"). And each
stage runs its own MoE layers, so dispatch/combine time, bytes and imbalance differ by stage,
while only one rank per job writes the JSONL and the W&B run.

`PipelineStages.gather` is one all-gather over the rank's pipeline group per logged step. Every
rank gets the real loss (its console line never shows a placeholder) and every stage's comm;
the metrics rank writes them all:
- `moe_comm/pp{r}/<metric>`: the comm of pipeline rank r (its stages' MoE layers);
- the usual `moe_comm/<metric>` keys for the whole model: times and bytes summed over stages
  (they are summed over MoE layers without PP too), imbalance averaged over all MoE layers
  (worst: the worst layer), `comm_exposed(%)` of the stage that spends the largest share of
  the step in comm (the stages run concurrently, so the busiest one is what bounds the step),
  and under an overlap `comm_hidden(%)` of all stages' comm together.
"""

import math

import torch
import torch.distributed as dist

from moe_comm.metrics import keys, settle

# What a stage contributes, in this order on the wire.
SUMMED = (
    keys.DISPATCH_MS, keys.COMBINE_MS, keys.DISPATCH_FWD_MS, keys.DISPATCH_BWD_MS,
    keys.COMBINE_FWD_MS, keys.COMBINE_BWD_MS, keys.COMM_MS, keys.DISPATCH_EXPOSED_MS,
    keys.COMBINE_EXPOSED_MS, keys.COMM_EXPOSED_MS, keys.DISPATCH_GB, keys.COMBINE_GB, keys.SENT_GB,
)
LAYER_MEAN = (keys.IMBALANCE_RANK, keys.IMBALANCE_EXPERT)
LAYER_WORST = (keys.IMBALANCE_RANK_WORST, keys.IMBALANCE_EXPERT_WORST)
PER_STAGE = (keys.DISPATCH_MS, keys.COMBINE_MS, keys.COMM_EXPOSED_PCT, keys.SENT_GB, keys.IMBALANCE_RANK)
_FIELDS = SUMMED + LAYER_MEAN + LAYER_WORST + (keys.COMM_HIDDEN_PCT,)


def stage_key(pp_rank: int, key: str) -> str:
    """moe_comm/dispatch_ms of pipeline rank 2 -> moe_comm/pp2/dispatch_ms."""
    return f"{keys.PREFIX}pp{pp_rank}/{key[len(keys.PREFIX):]}"


def loss_pp_rank(schedule: str, pp_size: int) -> int:
    """The pipeline rank that holds the last stage: the last one, or the first one for the
    V-shaped schedules, which fold the last stage back onto rank 0."""
    from torch.distributed.pipelining.schedules import (
        get_schedule_class,
        ScheduleDualPipeV,
        ScheduleZBVZeroBubble,
    )

    try:
        schedule_class = get_schedule_class(schedule)
    except ValueError:  # a schedule CSV or a name this torch does not know: TorchTitan's rule
        return pp_size - 1
    v_shaped = isinstance(schedule_class, type) and issubclass(
        schedule_class, (ScheduleZBVZeroBubble, ScheduleDualPipeV)
    )
    return 0 if v_shaped else pp_size - 1


class PipelineStages:
    def __init__(self, parallel_dims, job_config):
        mesh = parallel_dims.get_mesh("pp")
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.loss_rank = loss_pp_rank(job_config.parallelism.pipeline_parallel_schedule, self.size)
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def _all_gather(self, values: list[float]) -> list[list[float]]:
        """`values` of every pipeline rank of this rank's pipeline group, by pipeline rank."""
        mine_X = torch.tensor(values, dtype=torch.float64, device=self.device)
        all_X = [torch.empty_like(mine_X) for _ in range(self.size)]
        dist.all_gather(all_X, mine_X, group=self.group)
        settle.released(mine_X, *all_X)  # the last collective of a step (moe_comm.metrics.settle)
        return [t.tolist() for t in all_X]

    def gather(
        self, loss: float, max_loss: float, ours: dict[str, float], moe_layers: int, step_ms: float
    ) -> tuple[float, float, dict[str, float]]:
        """(the last stage's loss, its max loss, the whole model's comm metrics + per stage)."""
        mine = [float(loss), float(max_loss), float(moe_layers)] + [ours.get(k, math.nan) for k in _FIELDS]
        rows = [dict(zip(("loss", "max_loss", "layers") + _FIELDS, values)) for values in self._all_gather(mine)]
        merged: dict[str, float] = {}
        measured = [(r, row) for r, row in enumerate(rows) if not math.isnan(row[keys.COMM_MS])]
        for r, row in measured:
            row[keys.COMM_EXPOSED_PCT] = 100 * row[keys.COMM_EXPOSED_MS] / step_ms if step_ms > 0 else math.nan
            for key in PER_STAGE:
                merged[stage_key(r, key)] = row[key]
        if measured:
            stage_rows = [row for _, row in measured]
            for key in SUMMED:
                merged[key] = sum(row[key] for row in stage_rows)
            layers = sum(row["layers"] for row in stage_rows)
            for key in LAYER_MEAN:
                merged[key] = sum(row[key] * row["layers"] for row in stage_rows) / layers
            for key in LAYER_WORST:
                merged[key] = max(row[key] for row in stage_rows)
            merged[keys.COMM_EXPOSED_PCT] = max(row[keys.COMM_EXPOSED_PCT] for row in stage_rows)
            if any(not math.isnan(row[keys.COMM_HIDDEN_PCT]) for row in stage_rows):  # an overlap ran
                comm_ms = merged[keys.COMM_MS]
                merged[keys.COMM_HIDDEN_PCT] = (
                    100 * (1 - merged[keys.COMM_EXPOSED_MS] / comm_ms) if comm_ms > 0 else math.nan
                )
        owner = rows[self.loss_rank]
        return owner["loss"], owner["max_loss"], merged
