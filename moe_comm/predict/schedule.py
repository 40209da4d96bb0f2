"""TorchTitan 0.2.2's pipeline schedules in closed form: the stages each rank holds, the bubble,
the microbatch-stages in flight and the point-to-point sends, per schedule.

TorchTitan builds one of torch.distributed.pipelining's schedules (torchtitan/distributed/
pipeline_parallel.py): the schedule names a class; the class decides whether a rank holds one
stage (1F1B) or several ("looped": Interleaved1F1B, InterleavedZeroBubble, stage s on rank
s % pp; "V": ZBVZeroBubble, DualPipeV, rank r holds stages r and 2 pp - 1 - r). The stages per
rank v come from `pipeline_parallel_layers_per_stage` L: stages = ceil((layers + first-stage
weight + last-stage weight) / L), which pp must divide; without L, 1 for single-stage schedules
and 2 otherwise. `stages_per_rank` repeats that rule with TorchTitan's errors.

Timing. On one rank a microbatch costs f in the forward pass and b = bi + bw in the backward
pass over all the rank's layers (bi: the input gradient, with any activation-checkpoint
recompute; bw: the weight gradient, which only the zero-bubble schedules run apart). Each of
the v stage chunks costs 1/v of that. With m microbatches a step takes m (f + b) of work plus
the bubble, the time some rank waits on another:

    1F1B                    (pp - 1)(f + b)                       m >= pp (torch requires it)
    Interleaved1F1B         (f + b)((pp - 1) + max(0, pp - m)(v - 1)) / v
    InterleavedZeroBubble   (pp - 1) max(f + bi - bw, f, bi) / v   modelled for m >= pp
    ZBVZeroBubble           (pp - 1) max(bi / 2, bi - f, bi - bw, f - bi / 2)   m >= 2 pp
    DualPipeV               (pp - 1)(f + 2 bi - bw) / 2           m >= 2 pp (torch requires it)

These were derived from torch's own action lists, replayed with durations by a dependency
simulation (tests/test_schedule.py does it for every schedule and several (pp, m, v) and
ratios with bi >= f and bi >= bw, as a layer's backward has them, and holds the formulas to it:
exact for the first four inside their ranges, DualPipeV within one chunk's forward, f / 2). Outside the stated
microbatch ranges the zero-bubble schedules' bubble depends on the ratios in ways no short
formula follows; `Pipeline.validate` refuses them rather than guess.

Memory. A microbatch-stage holds its activations from its forward until its backward ends (the
weight gradient, for the zero-bubble schedules). `chunks_held(rank)` is the most rank k holds
at once, counted in stage chunks (1/v of the rank's layers each), from the same action lists:
1F1B min(m, pp - k); Interleaved1F1B min(m v, (v - 1) r + 2 (pp - 1 - k) + 1) with r the
microbatches per round (torch's flexible rounds: m // max(1, m // pp)); InterleavedZeroBubble
min(m v, (v - 1) r + pp); ZBVZeroBubble min(2 pp, 2 m, m + k + 1); DualPipeV 2 pp, and one more
on its last rank.

Point-to-point. Every stage boundary sends the microbatch's activations forward and their
gradient back; in the V schedules the boundary at the V's turn stays on one rank.
"""

import math
from dataclasses import dataclass

from moe_comm.titan_fields import torch_refuses

SCHEDULES = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
SINGLE_STAGE = ("1F1B",)
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")  # run bw apart from bi


def canonical(schedule: str) -> str:
    """The schedule's name as SCHEDULES spells it (torch matches names case-insensitively)."""
    for name in SCHEDULES:
        if name.lower() == schedule.lower():
            return name
    raise ValueError(f"pipeline_parallel_schedule = {schedule!r}: the schedule model covers {list(SCHEDULES)}")


def stages_per_rank(schedule: str, pp: int, n_layers: int, layers_per_stage: int | None = None,
                    first_stage_less_layers: int = 1, last_stage_less_layers: int = 1) -> int:
    """TorchTitan's rule (pipeline_parallel.pipeline_llm), with its refusals as ValueErrors."""
    schedule = canonical(schedule)
    single = schedule in SINGLE_STAGE
    if layers_per_stage is None:
        v = 1 if single else 2
    else:
        stages = math.ceil((n_layers + first_stage_less_layers + last_stage_less_layers) / layers_per_stage)
        if stages % pp:
            raise ValueError(f"pipeline_parallel_layers_per_stage = {layers_per_stage} gives {stages} stages, which "
                             f"pipeline_parallel_degree {pp} does not divide")
        v = stages // pp
        if single and v != 1:
            raise ValueError(f"{schedule} runs one stage per rank; pipeline_parallel_layers_per_stage = "
                             f"{layers_per_stage} gives {v}")
        if not single and v < 2:
            raise ValueError(f"{schedule} needs at least 2 stages per rank; pipeline_parallel_layers_per_stage = "
                             f"{layers_per_stage} gives {v}")
    if schedule in V_SHAPED and v != 2:
        raise ValueError(f"{schedule} runs exactly 2 stages per rank (a V); layers per stage give {v}")
    return v


def layers_per_stage_options(schedule: str, pp: int, n_layers: int, first_stage_less_layers: int = 1,
                             last_stage_less_layers: int = 1) -> dict[int, int | None]:
    """Every stage count per rank TorchTitan can build for a schedule, with the
    `pipeline_parallel_layers_per_stage` that selects it (None: TorchTitan's default)."""
    default = stages_per_rank(schedule, pp, n_layers)
    out: dict[int, int | None] = {default: None}
    effective = n_layers + first_stage_less_layers + last_stage_less_layers
    for per_stage in range(1, effective + 1):
        try:
            v = stages_per_rank(schedule, pp, n_layers, per_stage, first_stage_less_layers, last_stage_less_layers)
        except ValueError:
            continue
        if effective // (pp * v) < max(first_stage_less_layers, last_stage_less_layers, 1):
            continue  # TorchTitan refuses stages thinner than the embedding's or output's weight
        out.setdefault(v, per_stage)
    return out


def stage_layers(n_layers: int, num_stages: int, first_stage_less_layers: int = 1,
                 last_stage_less_layers: int = 1) -> list[list[int]]:
    """The transformer layers of each stage, as TorchTitan's generate_llm_fqn_per_model_part
    splits them: the embedding counts as first_stage_less_layers layers of stage 0, the output
    as last_stage_less_layers of the last stage, and the first stages take the remainder."""
    if num_stages == 1:
        return [list(range(n_layers))]
    effective = n_layers + first_stage_less_layers + last_stage_less_layers
    base, extra = divmod(effective, num_stages)
    out, layer = [], 0
    for s in range(num_stages):
        take = base + (1 if s < extra else 0)
        take -= first_stage_less_layers if s == 0 else 0
        take -= last_stage_less_layers if s == num_stages - 1 else 0
        out.append(list(range(layer, min(layer + max(take, 0), n_layers))))
        layer += max(take, 0)
    return out


def rank_stages(schedule: str, pp: int, v: int, rank: int) -> tuple[int, ...]:
    """The stage indices rank `rank` runs (TorchTitan's _get_stage_indices)."""
    if canonical(schedule) in V_SHAPED:
        return (rank, 2 * pp - 1 - rank)
    return tuple(rank + s * pp for s in range(v))


@dataclass(frozen=True)
class Pipeline:
    schedule: str
    pp: int
    microbatches: int
    v: int  # stages per rank

    def validate(self) -> None:
        """torch's refusals at schedule construction, and the ranges the bubble is modelled in."""
        s, pp, m, v = canonical(self.schedule), self.pp, self.microbatches, self.v
        if m < 1:
            raise ValueError(f"{m} microbatches: local_batch_size / pipeline_parallel_microbatch_size must be >= 1")
        if s in SINGLE_STAGE and v != 1 or s not in SINGLE_STAGE and v < 2 or s in V_SHAPED and v != 2:
            raise ValueError(f"{s} cannot run {v} stages per rank")
        refused = torch_refuses(s, pp, m)
        if refused:
            raise ValueError(f"{s} {refused}")
        if s == "InterleavedZeroBubble" and m < pp:
            raise ValueError(f"InterleavedZeroBubble is modelled for at least pp = {pp} microbatches, not {m}")
        if s == "ZBVZeroBubble" and m < 2 * pp:
            raise ValueError(f"ZBVZeroBubble is modelled for at least 2 x pp = {2 * pp} microbatches, not {m}")

    @property
    def name(self) -> str:
        return canonical(self.schedule)

    def bubble(self, f: float, bi: float, bw: float) -> float:
        """Time a step waits beyond its m (f + b) of work, for per-microbatch, per-rank forward
        f, input-gradient bi and weight-gradient bw times (see the module docstring)."""
        self.validate()
        pp, m, v = self.pp, self.microbatches, self.v
        if pp == 1:
            return 0.0
        s = self.name
        if s == "1F1B":
            return (pp - 1) * (f + bi + bw)
        if s == "Interleaved1F1B":
            return (f + bi + bw) * ((pp - 1) + max(0, pp - m) * (v - 1)) / v
        if s == "InterleavedZeroBubble":
            return (pp - 1) * max(f + bi - bw, f, bi) / v
        if s == "ZBVZeroBubble":
            return (pp - 1) * max(bi / 2, bi - f, bi - bw, f - bi / 2)
        return (pp - 1) * (f + 2 * bi - bw) / 2  # DualPipeV

    def chunks_held(self, rank: int) -> int:
        """Most microbatch-stages rank `rank` holds activations for at once."""
        pp, m, v, r = self.pp, self.microbatches, self.v, rank
        if pp == 1:
            return 1
        s = self.name
        per_round = m // max(1, m // pp)
        if s == "1F1B":
            return min(m, pp - r)
        if s == "Interleaved1F1B":
            return min(m * v, (v - 1) * per_round + 2 * (pp - 1 - r) + 1)
        if s == "InterleavedZeroBubble":
            return min(m * v, (v - 1) * per_round + pp)
        if s == "ZBVZeroBubble":
            return min(2 * pp, 2 * m, m + r + 1)
        return 2 * pp + (1 if r == pp - 1 else 0)  # DualPipeV

    @property
    def peak_chunks(self) -> int:
        """Most microbatch-stages any rank holds at once."""
        return max(self.chunks_held(r) for r in range(self.pp))

    def microbatches_in_flight(self, rank: int) -> float:
        """chunks_held in whole-rank microbatches (a chunk is 1/v of the rank's layers)."""
        return self.chunks_held(rank) / self.v

    @property
    def sends_per_microbatch(self) -> float:
        """Activation sends one rank makes per microbatch on average (the same count of
        gradient sends goes back): the stage boundaries that cross ranks, over pp."""
        if self.pp == 1:
            return 0.0
        stages = self.pp * self.v
        crossing = stages - 1 - (1 if self.name in V_SHAPED else 0)
        return crossing / self.pp

    def microbatch_pairs(self, rank: int) -> int:
        """[moe_comm] overlap = "microbatch" (moe_comm.titan.pipeline.overlapped_order): the
        forward-backward pairs rank `rank` runs as one overlapped action. Its order is torch's
        Interleaved1F1B with one more warmup forward: forward k runs the rank's local stage
        (k // r) % v, backward j stage v - 1 - (j // r) % v (r microbatches per round), and the
        steady state pairs forward w + 1 + i with backward i (w: torch's warmup forwards), merged
        where their stages differ; 0 for every other schedule. The bubble stays Interleaved1F1B's
        (the extra forward delays no backward: tests/test_schedule.py replays both)."""
        if self.name != "Interleaved1F1B" or self.pp == 1:
            return 0
        pp, m, v = self.pp, self.microbatches, self.v
        per_round = m // max(1, m // pp)
        total = m * v
        warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), total)
        return sum(1 for i in range(max(0, total - warmup - 1))
                   if ((warmup + 1 + i) // per_round) % v != v - 1 - (i // per_round) % v)

    @property
    def overlapped_pairs(self) -> int:
        """DualPipeV: the forward-and-backward chunk pairs rank 0 runs as one OVERLAP_F_B action
        (where TorchTitan's DualPipeExpertParallel hides one chunk's MoE communication behind the
        other's compute); 0 for every other schedule."""
        if self.name != "DualPipeV" or self.pp == 1:
            return 0
        pp, m = self.pp, self.microbatches
        return 2 * (m - 2 * pp + 1) + (pp - 1)  # torch's steps 4 and 5 on rank 0
