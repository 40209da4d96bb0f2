"""moe_comm.predict.schedule against torch's own pipeline schedules.

torch.distributed.pipelining's schedule classes build their per-rank action lists on CPU at
construction, from stage objects that only need their index, the stage count and the group's
size and rank. A dependency replay of those lists (each rank runs its actions in order; a
forward waits for the previous stage's forward of the same microbatch, an input gradient for
the next stage's, a weight gradient for its own input gradient; chunk durations f / v, bi / v,
bw / v) gives the step's length and the microbatch-stages each rank holds; the closed forms
must match it."""

from collections import defaultdict

import pytest
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from moe_comm.predict import schedule
from moe_comm.predict.schedule import Pipeline


class _Stage:
    """What a schedule's constructor reads from a PipelineStage."""

    def __init__(self, index: int, num_stages: int, pp: int, rank: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, pp, rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.stage_index_to_group_rank: dict = {}
        self.submod = None


def torch_schedule(name: str, pp: int, m: int, v: int):
    cls = get_schedule_class(name)
    n = pp * v
    if issubclass(cls, PipelineScheduleSingle):
        return cls(_Stage(0, n, pp, 0), n_microbatches=m)
    stages = [_Stage(i, n, pp, 0) for i in schedule.rank_stages(name, pp, v, 0)]
    return cls(stages, n_microbatches=m)


def _compute_actions(sched, m: int) -> dict[int, list]:
    order = {r: [a for a in acts if a is not None and a.is_compute_op] for r, acts in sched.pipeline_order.items()}
    last = len(order) - 1
    forwards = [a.microbatch_index for a in order[last] if a.computation_type == S.FORWARD]
    if sorted(forwards) == list(range(1, m + 1)):
        # torch 2.13's Schedule1F1B._get_pipeline_order numbers the last rank's forwards from 1
        # (its runtime, _step_microbatches, runs microbatch 0 first): renumber them
        order[last] = [a._replace(microbatch_index=a.microbatch_index - 1) if a.computation_type == S.FORWARD else a
                       for a in order[last]]
    return order


def replay(sched, num_stages: int, v: int, m: int, f: float, bi: float, bw: float, pair_save: float = 0.0):
    """(step length, work per rank, peak microbatch-stages held per rank) of torch's lists; an
    overlapped pair (OVERLAP_F_B) takes `pair_save` less than its two actions (the hidden comm)."""
    F, B, I, W, O = S.FORWARD, S.FULL_BACKWARD, S.BACKWARD_INPUT, S.BACKWARD_WEIGHT, S.OVERLAP_F_B
    dur = {F: f / v, B: (bi + bw) / v, I: bi / v, W: bw / v}
    order = _compute_actions(sched, m)
    done: dict = {}
    clock, pos = defaultdict(float), defaultdict(int)
    held, peak, work = defaultdict(int), defaultdict(int), defaultdict(float)

    def ready(a):
        s, t, mb = a.stage_index, a.computation_type, a.microbatch_index
        if t == F:
            need = [] if s == 0 else [(s - 1, F, mb)]
        elif t in (B, I):
            need = [(s, F, mb)] if s == num_stages - 1 else [(s + 1, B, mb), (s + 1, I, mb)]
            if s != num_stages - 1:  # either form of the next stage's input gradient
                ends = [done[k] for k in need if k in done]
                return ends[0] if ends else None
        else:
            need = [(s, I, mb)]
        if any(k not in done for k in need):
            return None
        return max((done[k] for k in need), default=0.0)

    while any(pos[r] < len(order[r]) for r in order):
        moved = False
        for r, acts in order.items():
            if pos[r] == len(acts):
                continue
            a = acts[pos[r]]
            parts = a.sub_actions if a.computation_type == O else (a,)
            starts = [ready(p) for p in parts]
            if any(t is None for t in starts):
                continue
            start = max([clock[r], *starts])
            length = sum(dur[p.computation_type] for p in parts) - (pair_save if a.computation_type == O else 0.0)
            for p in parts:
                done[(p.stage_index, p.computation_type, p.microbatch_index)] = start + length
                held[r] += {F: 1, B: -1, W: -1}.get(p.computation_type, 0)
            peak[r] = max(peak[r], held[r])
            clock[r], work[r] = start + length, work[r] + length
            pos[r] += 1
            moved = True
        assert moved, "the replay deadlocked: the action lists are not what this test expects"
    assert all(h == 0 for h in held.values())
    return max(clock.values()), max(work.values()), dict(peak)


# (f, bi, bw) as a layer has them: no AC (1, 1, 1), full AC's recompute in the input gradient
# (1, 2, 1), and others with bi >= f, bi >= bw
RATIOS = [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.5, 0.5), (1.0, 3.0, 1.0), (1.0, 1.2, 0.8)]
CASES = (
    [("1F1B", pp, m, 1) for pp, m in [(2, 2), (2, 5), (4, 4), (4, 9), (8, 8), (8, 32)]]
    + [("Interleaved1F1B", pp, m, v) for pp, m, v in [(2, 1, 2), (2, 6, 3), (4, 2, 2), (4, 6, 2), (4, 8, 4), (4, 10, 2),
                                                       (8, 4, 2), (8, 15, 2), (8, 16, 4), (8, 32, 2)]]
    + [("InterleavedZeroBubble", pp, m, v) for pp, m, v in [(2, 2, 2), (4, 4, 3), (4, 7, 2), (4, 12, 4),
                                                             (8, 8, 2), (8, 10, 2), (8, 32, 4)]]
    + [("ZBVZeroBubble", pp, m, 2) for pp, m in [(2, 4), (4, 8), (4, 11), (8, 16), (8, 40)]]
    + [("DualPipeV", pp, m, 2) for pp, m in [(2, 4), (4, 8), (4, 13), (8, 16), (8, 32)]]
)


@pytest.mark.parametrize("name,pp,m,v", CASES)
def test_bubble_and_peak_match_torchs_action_lists(name, pp, m, v):
    sched = torch_schedule(name, pp, m, v)
    pipe = Pipeline(name, pp, m, v)
    for f, bi, bw in RATIOS:
        length, work, peak = replay(sched, pp * v, v, m, f, bi, bw)
        assert work == pytest.approx(m * (f + bi + bw))
        # DualPipeV: within one chunk's forward (its last rank's first pair runs unoverlapped)
        tol = f / 2 + 1e-9 if name == "DualPipeV" else 1e-9
        assert pipe.bubble(f, bi, bw) == pytest.approx(length - work, abs=tol), (f, bi, bw)
    assert [pipe.chunks_held(r) for r in range(pp)] == [peak[r] for r in range(pp)]
    assert pipe.peak_chunks == max(peak.values())


@pytest.mark.parametrize("name,pp,m,v", [c for c in CASES if c[0] != "1F1B"])
def test_sends_and_overlapped_pairs_match_torch(name, pp, m, v):
    sched = torch_schedule(name, pp, m, v)
    pipe = Pipeline(name, pp, m, v)
    sends = sum(a.computation_type == S.SEND_F for acts in sched.pipeline_order_with_comms.values() for a in acts)
    assert pipe.sends_per_microbatch == pytest.approx(sends / (pp * m))
    overlapped = {r: [a for a in sched.pipeline_order[r] if a is not None and a.computation_type == S.OVERLAP_F_B]
                  for r in range(pp)}
    pairs = [len(overlapped[r]) for r in range(pp)]
    # rank 0 pairs the fewest, so the model's count is the busiest rank's at most
    assert pipe.overlapped_pairs == pairs[0] == min(pairs)
    # every overlapped pair runs a forward and a full backward on two different stages of the rank
    # (two threads cannot share one stage's FSDP module: moe_comm.titan.pipeline)
    assert all(f.computation_type == S.FORWARD and b.computation_type == S.FULL_BACKWARD
               and f.stage_index != b.stage_index for acts in overlapped.values() for f, b in (a.sub_actions for a in acts))


def test_one_stage_no_bubble():
    assert Pipeline("1F1B", 1, 4, 1).bubble(1, 1, 1) == 0 and Pipeline("1F1B", 1, 4, 1).peak_chunks == 1


@pytest.mark.parametrize("pipe,match", [
    (Pipeline("1F1B", 8, 4, 1), "1F1B needs at least 8 microbatches per step, one per stage"),
    (Pipeline("Interleaved1F1B", 4, 11, 2), "multiple of the 2 rounds"),
    (Pipeline("InterleavedZeroBubble", 8, 4, 2), "modelled for at least pp = 8"),
    (Pipeline("ZBVZeroBubble", 4, 6, 2), "modelled for at least 2 x pp = 8"),
    (Pipeline("DualPipeV", 4, 7, 2), "DualPipeV needs at least 8 microbatches"),
    (Pipeline("ZBVZeroBubble", 4, 8, 3), "cannot run 3 stages per rank"),
])
def test_refusals(pipe, match):
    with pytest.raises(ValueError, match=match):
        pipe.bubble(1, 1, 1)


def test_torch_refuses_what_the_model_refuses():
    """The refusals that are torch's own are torch's own."""
    with pytest.raises(ValueError, match="greater than"):
        torch_schedule("1F1B", 8, 4, 1)
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        torch_schedule("Interleaved1F1B", 4, 11, 2)
    with pytest.raises(ValueError, match="at least as many microbatches as stages"):
        torch_schedule("DualPipeV", 4, 7, 2)


def test_stages_per_rank_follows_torchtitan():
    # 671B: 61 layers + embedding + output = 63 "layers"
    assert schedule.stages_per_rank("1F1B", 8, 61) == 1
    assert schedule.stages_per_rank("Interleaved1F1B", 8, 61) == 2
    assert schedule.stages_per_rank("Interleaved1F1B", 8, 61, layers_per_stage=2) == 4
    assert schedule.layers_per_stage_options("Interleaved1F1B", 8, 61) == {2: None, 4: 2}
    assert schedule.layers_per_stage_options("ZBVZeroBubble", 8, 61) == {2: None}
    with pytest.raises(ValueError, match="does not divide"):
        schedule.stages_per_rank("Interleaved1F1B", 8, 61, layers_per_stage=3)
    with pytest.raises(ValueError, match="exactly 2 stages"):
        schedule.stages_per_rank("DualPipeV", 8, 61, layers_per_stage=2)
    with pytest.raises(ValueError, match="covers"):
        schedule.canonical("GPipe")


def test_stage_layers_follow_torchtitans_split():
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    for stages in (1, 2, 8, 16, 32):
        theirs = generate_llm_fqn_per_model_part(stages, 61, 1, 1)
        ours = schedule.stage_layers(61, stages)
        assert [[f"layers.{i}" for i in s] for s in ours] == [[n for n in t if n.startswith("layers.")] for t in theirs]


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (8, 32, 4), (8, 16, 2), (8, 32, 2), (2, 64, 2),
                                    (8, 8, 4), (4, 6, 2)])
def test_microbatch_overlap_pairs_and_bubble_follow_its_action_lists(pp, m, v):
    """[moe_comm] overlap = "microbatch" (moe_comm.titan.pipeline.overlapped_order on torch's
    Interleaved1F1B): the pairs each rank runs overlapped are Pipeline.microbatch_pairs'; its one
    more warmup forward holds one more microbatch-stage and leaves the bubble Interleaved1F1B's;
    with each pair shorter (the hidden comm), the busiest rank's work plus the bubble at its
    averaged f, bi, bw is the replayed step within 2%."""
    from moe_comm.titan.pipeline import overlapped_order

    sched = torch_schedule("Interleaved1F1B", pp, m, v)
    plain = replay(sched, pp * v, v, m, 1.0, 2.0, 1.0)
    sched.pipeline_order = overlapped_order(sched.pipeline_order)
    pipe = Pipeline("Interleaved1F1B", pp, m, v)
    pairs = [sum(a.computation_type == S.OVERLAP_F_B for a in sched.pipeline_order[r]) for r in range(pp)]
    assert [pipe.microbatch_pairs(r) for r in range(pp)] == pairs
    length, work, peak = replay(sched, pp * v, v, m, 1.0, 2.0, 1.0)
    assert length - work == pytest.approx(plain[0] - plain[1])
    assert all(peak[r] == min(m * v, pipe.chunks_held(r) + 1) for r in range(pp))
    save = 0.4  # of one pair's (f + b) / v
    f, bi, bw = 1.0, 2.0, 1.0
    shortened, _, _ = replay(sched, pp * v, v, m, f, bi, bw, pair_save=save * (f + bi + bw) / v)
    busiest = max(range(pp), key=lambda r: -pairs[r])
    k = 1 - pairs[busiest] * save / (m * v)
    model = m * (f + bi + bw) * k + pipe.bubble(f * k, bi * k, bw * k)
    assert model == pytest.approx(shortened, rel=0.02)
