"""The MoE comm overlap (moe_comm.titan.overlap) on CPU.

- Unit level, one process (a world of one, the nccl backend, TorchTitan's debug model with the
  CPU's fp32 for-loop experts): "chunked" against "none" with activation checkpointing none,
  full, per-op selective and per-layer selective, for an odd token count and for one token (an
  empty second chunk). Equal within fp32 tolerances (CHUNKED_RTOL), not bit for bit: "chunked"
  runs each expert's GEMMs on one chunk's rows instead of all of them, and a CPU BLAS may pick
  its kernel and blocking (hence the order of the sums inside a row) by the row count, so on
  some CPUs a row's result differs in its last bits (2.1e-7 relative was seen in a non-expert
  gradient on one 2-core machine, 0 on others). The expert weights' gradients are moreover a
  sum over two chunks instead of one (~5e-7 relative).
- The stream schedule, with streams that record instead of launching: which op waits for which
  (dispatch(c0) not behind the shared experts, experts(c0) not behind dispatch(c1), combine(c0)
  not behind experts(c1), the sum behind both combines), the record_streams, and the waits
  reported to the metrics in forward and backward.
- DualPipeV's sync points: their order around dispatch and combine, the backward's first D, and
  a chunked call's backward in a pair meeting once per point (and out of order, an error).
- The overlap across microbatches ([moe_comm] overlap = "microbatch", moe_comm.titan.pipeline):
  the action lists built from torch's Interleaved1F1B (no processes), the refusal of other
  schedules, and a failing backward thread failing the step instead of hanging it.
- The checks before launch, and the metrics of an overlapped run.
- Three trainings (the whole path: TorchTitan's trainer, FSDP, the train spec; the ranks started
  as torchrun starts them, tests/ranks.py; the debug model with 4 attention heads),
  each step run once per variant from the same weights (tests/overlap_trainer.py), built with
  full activation checkpointing and each variant also run with fewer or no checkpoints:
  PP 2 x EP 2 with DualPipeV on 4 processes (its EP overlap with two threads, "chunked", the
  two together - the forwards outside a pair chunked, meeting as often as DualPipeV alone - and
  neither); PP 2 x EP 2 with Interleaved1F1B and overlap "microbatch" on 4 processes (against
  torch's own Interleaved1F1B lists); EP 2 on 2 processes ("chunked" and not; dispatch and
  combine calls counted). An overlap across microbatches equals the plain schedule bit for bit,
  and so does every AC mode equal no AC (the same ops on the same shapes in the same order, only
  the two threads' interleaving differs, and CPU ops are synchronous); "chunked" within
  CHUNKED_RTOL, as at unit level. TorchTitan's per-op selective AC with
  FSDP does not run on CPU with or without overlap ("profiler._record_function_enter_new ...
  not found in storage" in FSDP's post-forward during recompute), so it is checked at unit
  level only (here and in tests/test_recompute.py).

What only the GPU covers (tests/gpu/nvshmem_cases.py): real streams and events, the caching
allocator's reuse across streams, autograd's own stream syncs in backward, the recompute
running on the compute stream, and the nvshmem kernels with calls in flight on the comm stream,
from one thread (chunked) and from two (one microbatch's forward beside another's backward).
"""

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import moe_comm.titan  # noqa: F401  CPU adaptations, flavors, train specs
from moe_comm.backends import build_backend, MoELayerSpec
from moe_comm.backends.base import chunk_sizes, CommBackend, tokens_per_call
from moe_comm.backends.nccl import NcclBackend
from moe_comm.config import MoEComm
from moe_comm.errors import RecipeError
from moe_comm.layout import RunPlan
from moe_comm.metrics import instrument, keys
from moe_comm.metrics.instrumented import summarize
from moe_comm.metrics.peaks import resolve_peak
from moe_comm.metrics.step_line import StepLine
from moe_comm.titan import overlap
from moe_comm.titan.model import MoECommDeepSeekV3Model, TokenLevelExperts, TokenLevelMoE

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))  # the GPU cases' modules, which run on CPU too
import ranks  # noqa: E402
from metrics_fakes import free_port  # noqa: E402
from overlap_cases import debug_model_args  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]

# "chunked" against "none", fp32 on CPU: relative bound on the loss and on each gradient (module doc
# says why these are not bit for bit: row-count-dependent BLAS blocking, and the expert weights'
# gradients summed over two chunks). ~100 fp32 ulps; a wrong chunk (a row lost, doubled or sent
# to the wrong expert) moves them by orders of magnitude more.
CHUNKED_RTOL = 1e-5


def _model(ac: str, config: MoEComm) -> MoECommDeepSeekV3Model:
    """TorchTitan's debug model with our MoE layers, every MoE layer on an instrumented nccl
    backend over the world of one, and TorchTitan's activation checkpointing."""
    from torchtitan.config.job_config import ActivationCheckpoint

    from moe_comm.titan import recompute

    torch.manual_seed(0)
    model = MoECommDeepSeekV3Model(debug_model_args())
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    for block in model.layers.values():
        if block.moe_enabled:
            moe = block.moe
            layer = MoELayerSpec(moe.experts.num_experts, moe.router.top_k, moe.experts.w1.shape[-1])
            moe.comm_backend = instrument(build_backend(config, layer, dist.group.WORLD))
    if ac != "none":
        mode, option = ac.split(":")
        recompute.apply_ac(model, ActivationCheckpoint(mode=mode, selective_ac_option=option),
                           model_compile_enabled=False, base_folder="")
    return model


def _loss_and_grads(model, config, overlap_mode, tokens):
    config.overlap = overlap_mode
    model.zero_grad(set_to_none=True)
    loss = model(tokens).float().square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_chunk_sizes_and_tokens_per_call():
    assert chunk_sizes(7, 2) == [4, 3]
    assert chunk_sizes(1, 2) == [1, 0] and chunk_sizes(0, 2) == [0, 0]
    assert chunk_sizes(6, 1) == [6]
    assert tokens_per_call(4096, "chunked") == 2048 and tokens_per_call(4097, "chunked") == 2049
    assert tokens_per_call(4096, "none") == 4096


@pytest.mark.parametrize("ac", ["none", "full:2", "selective:op", "selective:2"])
@pytest.mark.parametrize("num_tokens", [7, 1])
def test_chunked_equals_plain_at_layer_level(world_of_one, ac, num_tokens):
    config = MoEComm(backend="nccl")
    model = _model(ac, config)
    tokens = torch.randint(0, model.model_args.vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(1))
    loss_plain, grads_plain = _loss_and_grads(model, config, "none", tokens)
    loss_chunked, grads_chunked = _loss_and_grads(model, config, "chunked", tokens)
    assert torch.allclose(loss_chunked, loss_plain, rtol=CHUNKED_RTOL, atol=0)
    assert grads_plain.keys() == grads_chunked.keys()
    for name, g in grads_plain.items():
        err = (grads_chunked[name] - g).abs().max() / g.abs().max().clamp_min(1e-30)
        assert err <= CHUNKED_RTOL, f"{name}: {err}"


# ---- the stream schedule, recorded -----------------------------------------------------------

class RecordingStreams(overlap.Streams):
    """Streams "S" and "C" that record: each op issued on a stream depends on everything the
    stream was given or waited for before it (so `deps[op]` is what must finish first)."""

    last = None

    def __init__(self, device, inline=False):
        assert not inline, "no recompute in these tests"
        self.cuda, self.compute, self.comm = True, "S", "C"
        self.current = "S"
        self.before = {"S": frozenset(), "C": frozenset()}  # what the next op on it waits for
        self.deps: dict[str, frozenset] = {}
        self.handed: list[tuple[str, int]] = []
        self.clock = 0.0
        RecordingStreams.last = self

    @contextlib.contextmanager
    def on_comm(self):
        previous, self.current = self.current, "C"
        try:
            yield
        finally:
            self.current = previous

    def issue(self, op: str) -> None:
        self.deps[op] = self.before[self.current]
        self.before[self.current] = self.before[self.current] | {op}

    def mark(self, stream):
        return self.before[stream]

    def wait(self, stream, event):
        self.before[stream] = self.before[stream] | event

    def timed_wait(self, event):
        self.wait("S", event)
        self.clock += 1.0
        return self.clock, self.clock + 0.001  # perf_counter-like stamps: 1 ms each

    def hand_over(self, tensors, stream):
        self.handed.append((stream, sum(t is not None for t in tensors)))


class RecordingBackend:
    """The instrumented backend, with each call issued on the recording stream it runs on."""

    def __init__(self, inner):
        self.inner = inner
        self.config = inner.config
        self.calls = {"dispatch": 0, "combine": 0}

    def _issue(self, op):
        RecordingStreams.last.issue(f"{op}{self.calls[op]}")
        self.calls[op] += 1

    def dispatch(self, *args):
        self._issue("dispatch")
        return self.inner.dispatch(*args)

    def combine(self, *args):
        self._issue("combine")
        return self.inner.combine(*args)

    def record_wait(self, *args):
        self.inner.record_wait(*args)


def _recorded_layer(monkeypatch, dual_pipe_v=False, overlap_mode="chunked"):
    args = debug_model_args()
    torch.manual_seed(0)
    moe = TokenLevelMoE(args.moe_args, dim=args.dim, hidden_dim=args.moe_inter_dim)
    with torch.no_grad():
        moe.init_weights(0.02, buffer_device=torch.device("cpu"))
    layer = MoELayerSpec(moe.experts.num_experts, moe.router.top_k, args.dim)
    wrapped = instrument(NcclBackend(layer, dist.group.WORLD, MoEComm(backend="nccl", overlap=overlap_mode)))
    moe.comm_backend = RecordingBackend(wrapped)
    moe.sync_points = dual_pipe_v
    monkeypatch.setattr(overlap, "Streams", RecordingStreams)
    calls = {"n": 0}
    forward = TokenLevelExperts.forward

    def experts_forward(self, *a):
        RecordingStreams.last.issue(f"experts{calls['n']}")
        calls["n"] += 1
        return forward(self, *a)

    monkeypatch.setattr(TokenLevelExperts, "forward", experts_forward)
    moe.shared_experts.register_forward_pre_hook(lambda *_: RecordingStreams.last.issue("shared"))
    return moe, wrapped


def test_chunked_schedule_orders_the_streams(world_of_one, monkeypatch):
    moe, wrapped = _recorded_layer(monkeypatch)
    x = torch.randn(1, 9, moe.experts.w1.shape[-1], requires_grad=True)
    out = moe(x)
    s = RecordingStreams.last
    d = s.deps
    assert set(d) == {"shared", "dispatch0", "dispatch1", "experts0", "experts1", "combine0", "combine1"}
    assert "shared" not in d["dispatch0"]  # dispatch(c0) runs beside the shared experts
    assert "dispatch0" in d["experts0"] and "dispatch1" not in d["experts0"]  # beside dispatch(c1)
    assert "dispatch1" in d["experts1"]
    assert "experts0" in d["combine0"] and "experts1" not in d["combine0"]  # beside experts(c1)
    assert {"experts1", "combine0"} <= d["combine1"]
    assert not any(op.startswith(("dispatch", "combine")) for op in d["shared"])
    assert {"combine0", "combine1"} <= s.before["S"]  # the sum waits for both combines
    # record_stream: router outputs and x to C (3), each chunk's rows and counts to S (2 + 2),
    # each chunk's expert output to C (1 + 1), both combine outputs to S (2)
    assert s.handed == [("C", 3), ("S", 2), ("S", 2), ("C", 1), ("C", 1), ("S", 2)]

    out.float().square().sum().backward()
    # backward: S waits once for dispatch's backward (both chunks' inputs cross together) and
    # once per chunk for combine's; the gradients of what crossed to S go back to C
    phases = sorted(phase for phase, _, _ in wrapped.stats.waits)
    assert phases == ["combine_bwd", "combine_bwd", "combine_fwd", "dispatch_bwd", "dispatch_fwd", "dispatch_fwd"]
    # D's gradients to C (2), C's to S (1 + 1), B's to C (1 + 1: the counts have none), A's to
    # S (2: x and the routing weights)
    assert sorted(s.handed[6:]) == sorted([("C", 2), ("S", 1), ("S", 1), ("C", 1), ("C", 1), ("S", 2)])
    metrics = summarize([wrapped], steps=1)
    assert metrics[keys.COMM_EXPOSED_MS] == pytest.approx(6 * 0.001e3)  # six waits of 1 ms
    assert metrics[keys.DISPATCH_EXPOSED_MS] == pytest.approx(3.0)
    assert metrics[keys.COMM_HIDDEN_PCT] == pytest.approx(100 * (1 - 6.0 / metrics[keys.COMM_MS]))


def test_dual_pipe_v_sync_points_sit_around_dispatch_and_combine(world_of_one, monkeypatch):
    from torchtitan.distributed import dual_pipe_v

    moe, _ = _recorded_layer(monkeypatch, dual_pipe_v=True, overlap_mode="none")
    coordinator = dual_pipe_v._hook_coordinator
    order = []
    monkeypatch.setattr(coordinator, "barrier", lambda: order.append("|"))
    issue = RecordingStreams.issue

    def issue_in_order(self, op):
        order.append(op)
        issue(self, op)

    monkeypatch.setattr(RecordingStreams, "issue", issue_in_order)
    coordinator.enable_coordination(num_layers=2)  # a second layer follows: D passes a barrier too
    try:
        out = moe(torch.randn(1, 5, moe.experts.w1.shape[-1], requires_grad=True))
        # TorchTitan's order: A dispatch B experts C combine D, then the shared experts
        assert order == ["|", "dispatch0", "|", "experts0", "|", "combine0", "|", "shared"]
        order.clear()
        coordinator.enable_coordination(num_layers=2)  # as the overlap callback does per action
        out.float().square().sum().backward()
        # the backward's first point (D) has no partner in the forward thread: C, B, A only
        assert order == ["|", "|", "|"]
    finally:
        coordinator.disable_coordination()


def test_chunked_outside_a_pair_meets_once_per_point_in_a_paired_backward(world_of_one, monkeypatch):
    """DualPipeV with [moe_comm] overlap = "chunked": a forward outside a pair runs chunked and
    meets nowhere; its backward, run in a pair, meets once per sync point as a one-chunk call's:
    C after both chunks' combine backwards, B before both dispatch backwards."""
    from torchtitan.distributed import dual_pipe_v
    from moe_comm.metrics import instrumented

    moe, _ = _recorded_layer(monkeypatch, dual_pipe_v=True, overlap_mode="chunked")
    coordinator = dual_pipe_v._hook_coordinator
    order = []
    monkeypatch.setattr(coordinator, "barrier", lambda: order.append("|"))
    for name in ("begin", "end"):
        real = getattr(instrumented._BackwardInterval, name)
        monkeypatch.setattr(instrumented._BackwardInterval, name,
                            lambda self, device, real=real, name=name: (order.append(f"{self.phase} {name}"),
                                                                        real(self, device))[1])
    assert not overlap.in_pair()
    out = moe(torch.randn(1, 9, moe.experts.w1.shape[-1], requires_grad=True))
    assert moe.comm_backend.calls == {"dispatch": 2, "combine": 2} and order == []  # chunked, no meeting
    coordinator.enable_coordination(num_layers=2)  # the backward runs in a pair
    try:
        out.float().square().sum().backward()
    finally:
        coordinator.disable_coordination()
    # the backward's first D has no partner (skipped); then C, B, A once each
    assert order == ["combine_bwd begin", "combine_bwd end", "combine_bwd begin", "combine_bwd end", "|", "|",
                     "dispatch_bwd begin", "dispatch_bwd end", "dispatch_bwd begin", "dispatch_bwd end", "|"]
    # in a pair's forward half the same layer runs one chunk and meets the other thread
    coordinator.enable_coordination(num_layers=2)
    try:
        assert overlap.chunks_for(chunked=True, sync_points=True) == 1
    finally:
        coordinator.disable_coordination()
    assert overlap.chunks_for(chunked=True, sync_points=True) == overlap.CHUNKS
    assert overlap.chunks_for(chunked=False, sync_points=True) == 1


def test_a_chunked_backward_out_of_order_is_an_error():
    """Should autograd ever run a dispatch backward before every combine backward of the call,
    the meetings could not pair with the other thread's: an error, not two threads at once."""
    c = overlap.Join(2, meets_last=True)
    b = overlap.Join(2, meets_last=False, after=c)
    assert c.meets() is False
    with pytest.raises(RuntimeError, match="after 1 of its 2 combine backwards"):
        b.meets()
    assert c.meets() is True and b.meets() is True and b.meets() is False


def test_backward_skips_only_its_first_d(monkeypatch):
    """TorchTitan's SyncHook skips a backward D while the forward thread has passed no D yet,
    which also catches the second D when the backward runs ahead; ours skips the first only."""
    from torchtitan.distributed import dual_pipe_v

    coordinator = dual_pipe_v._hook_coordinator
    passed = []
    monkeypatch.setattr(coordinator, "barrier", lambda: passed.append(1))
    d = overlap.Handoff(overlap.Streams(torch.device("cpu")), "combine", "D", None)
    coordinator.enable_coordination(num_layers=2)
    try:
        d.sync_backward()
        assert passed == []
        assert coordinator._cycle_count == 0  # the forward thread has passed no D
        d.sync_backward()
        assert passed == [1]
        coordinator.enable_coordination(num_layers=2)  # the next overlapped action: skip again
        d.sync_backward()
        assert passed == [1]
    finally:
        coordinator.disable_coordination()


# ---- the action lists of the overlap across microbatches ---------------------------------------

def _torch_interleaved(pp: int, v: int, n: int) -> dict:
    """torch's own Interleaved1F1B compute lists (its pipeline_order), without building stages."""
    import types

    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    rounds = max(1, n // pp)
    shim = types.SimpleNamespace(n_local_stages=v, pp_group_size=pp, _n_microbatches=n, number_of_rounds=rounds,
                                 microbatches_per_round=n // rounds)
    return {r: ScheduleInterleaved1F1B._calculate_single_rank_operations(shim, r) for r in range(pp)}


@pytest.mark.parametrize("pp,v,n", [(2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 4, 16), (8, 4, 32), (2, 3, 6)])
def test_microbatch_overlap_action_lists(pp, v, n):
    """overlap_microbatches' lists, from torch's Interleaved1F1B: the same forwards and backwards,
    each kind in torch's order; one more warmup forward; every steady-state forward/backward pair
    on two different stages merged into an OVERLAP_F_B, never a pair on one stage; and torch's
    lowering (sends, receives, FSDP, gradient reduction) accepts them, which it refuses for an
    order that would deadlock. Each list is a function of the pipeline rank only, so every rank of
    an EP group (one pipeline rank) pairs the same actions."""
    from torch.distributed.pipelining.schedules import (
        _add_reduce_grad, _add_send_recv, _add_unshard_reshard, FORWARD, FULL_BACKWARD, OVERLAP_F_B,
    )

    from moe_comm.titan.pipeline import overlapped_order

    theirs = {r: [a for a in acts if a is not None] for r, acts in _torch_interleaved(pp, v, n).items()}
    ours = overlapped_order(theirs)
    for r in range(pp):
        flat = [x for a in ours[r] for x in (a.sub_actions or (a,))]
        for kind in (FORWARD, FULL_BACKWARD):
            assert [a for a in flat if a.computation_type == kind] == [a for a in theirs[r] if a.computation_type == kind]
        first_b = next(i for i, a in enumerate(flat) if a.computation_type == FULL_BACKWARD)
        assert first_b == next(i for i, a in enumerate(theirs[r]) if a.computation_type == FULL_BACKWARD) + 1
        pairs = [a for a in ours[r] if a.computation_type == OVERLAP_F_B]
        assert pairs, f"rank {r} overlaps nothing"
        for pair in pairs:
            f, b = pair.sub_actions
            assert (f.computation_type, b.computation_type) == (FORWARD, FULL_BACKWARD)
            assert f.stage_index != b.stage_index and f.stage_index % pp == b.stage_index % pp == r
        # what stays unmerged in the steady state is a forward and a backward of one stage
        for a, nxt in zip(ours[r], ours[r][1:]):
            if a.computation_type == FORWARD and nxt.computation_type == FULL_BACKWARD:
                assert a.stage_index == nxt.stage_index, (r, a, nxt)
    lowered = {r: _add_reduce_grad(_add_unshard_reshard(acts), n) for r, acts in ours.items()}
    _add_send_recv(lowered, lambda stage: stage % pp, pp * v)  # raises on a malformed schedule
    assert ours == overlapped_order(_torch_interleaved(pp, v, n))


def test_overlap_microbatches_refuses_other_schedules():
    from torch.distributed.pipelining.schedules import Schedule1F1B

    from moe_comm.titan.pipeline import overlap_microbatches

    with pytest.raises(RecipeError, match=r'"microbatch".*Interleaved1F1B.*built Schedule1F1B'):
        overlap_microbatches(Schedule1F1B.__new__(Schedule1F1B))


def test_overlap_f_b_fails_the_step_when_its_backward_thread_fails(monkeypatch):
    """TorchTitan's callback loses an exception of its backward thread and leaves the forward
    thread waiting at the next sync point; ours frees the wait and raises it."""
    import threading

    from torchtitan.distributed import dual_pipe_v

    from moe_comm.titan import pipeline

    def callback(action, ctx):  # the shape of TorchTitan's: coordinate, backward in a thread, meet
        dual_pipe_v._hook_coordinator.enable_coordination(num_layers=1)
        thread = threading.Thread(target=lambda: 1 / 0, daemon=True)
        thread.start()
        dual_pipe_v._hook_coordinator.barrier()  # the backward thread never comes
        thread.join()

    monkeypatch.setattr(dual_pipe_v, "overlap_callback", callback)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # no traceback on the console
    outcome = {}

    def run():
        try:
            pipeline.overlap_f_b("action", None)
        except RuntimeError as e:
            outcome["error"] = e

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=30)
    assert not runner.is_alive(), "the forward thread waited for the failed backward thread"
    assert isinstance(outcome["error"].__cause__, ZeroDivisionError)
    assert not dual_pipe_v._hook_coordinator.is_coordination_enabled()


# ---- checks before launch --------------------------------------------------------------------

def _plan(**kw) -> RunPlan:
    options = {k: kw.pop(k) for k in ("overlap", "backend") if k in kw}
    base = dict(options=MoEComm(**options), device="cpu", ep=2, ranks_per_node=2, nodes=1, num_experts=8,
                top_k=3, hidden=256)
    return RunPlan(**(base | kw))


class NoOverlapBackend(CommBackend):
    name = "no-overlap"

    def dispatch(self, x_TD, topk_idx_TK, topk_w_TK):
        raise NotImplementedError

    def combine(self, y_RD, handle):
        raise NotImplementedError


def test_check_run_overlap_rules():
    assert NcclBackend.check_run(_plan(overlap="chunked")) == []
    # DualPipeV's EP overlap with activation checkpointing: the recompute is comm-free
    assert NcclBackend.check_run(_plan(dual_pipe_v=True, activation_checkpoint="full")) == []
    with pytest.raises(RecipeError, match=r'\[moe_comm\] overlap = "chunked".*"no-overlap"'):
        NoOverlapBackend.check_run(_plan(overlap="chunked"))
    # the chunked overlap outside DualPipeV's pairs (moe_comm.titan.overlap.chunks_for)
    assert NcclBackend.check_run(_plan(overlap="chunked", dual_pipe_v=True, activation_checkpoint="full")) == []
    interleaved = dict(overlap="microbatch", pp=2, pp_schedule="Interleaved1F1B")
    assert NcclBackend.check_run(_plan(**interleaved, activation_checkpoint="selective")) == []
    assert NcclBackend.check_run(_plan(overlap="microbatch")) == []  # pp and schedule unknown (a backend's build)
    with pytest.raises(RecipeError, match=r'"microbatch".*expert_parallel_degree = 1'):
        NcclBackend.check_run(_plan(**interleaved, ep=1))
    with pytest.raises(RecipeError, match=r'"microbatch".*pipeline_parallel_degree = 1'):
        NcclBackend.check_run(_plan(**(interleaved | {"pp": 1})))
    with pytest.raises(RecipeError, match=r'"Interleaved1F1B" only, not "1F1B": with one stage per rank.*FSDP'):
        NcclBackend.check_run(_plan(**(interleaved | {"pp_schedule": "1F1B"})))
    with pytest.raises(RecipeError, match=r'not "DualPipeV": DualPipeV overlaps its own'):
        NcclBackend.check_run(_plan(**(interleaved | {"pp_schedule": "DualPipeV"})))
    with pytest.raises(RecipeError, match=r'not "GPipe"'):
        NcclBackend.check_run(_plan(**(interleaved | {"pp_schedule": "GPipe"})))


def test_recipe_checks_the_overlaps_across_microbatches_before_launch(monkeypatch):
    from moe_comm import recipe

    monkeypatch.chdir(REPO)
    pp2 = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]
    dual_pipe = pp2 + ["--parallelism.pipeline_parallel_schedule", "DualPipeV"]
    r = recipe.load("recipes/debug_cpu.toml", dual_pipe + ["--activation_checkpoint.mode", "selective"],
                    device="cpu", nproc_per_node=4)
    assert r.plan.dual_pipe_v and r.plan.activation_checkpoint == "selective"
    off = ["--parallelism.no-pipeline_parallel_expert_parallel_overlap", "--moe_comm.overlap", "chunked"]
    assert not recipe.load("recipes/debug_cpu.toml", dual_pipe + off, device="cpu", nproc_per_node=4).plan.dual_pipe_v
    microbatch = ["--moe_comm.overlap", "microbatch", "--activation_checkpoint.mode", "full"]
    r = recipe.load("recipes/debug_cpu.toml", pp2 + ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]
                    + microbatch, device="cpu", nproc_per_node=4)
    assert (r.plan.pp, r.plan.pp_schedule, r.plan.options.overlap) == (2, "Interleaved1F1B", "microbatch")
    with pytest.raises(RecipeError, match=r'not "1F1B"'):
        recipe.load("recipes/debug_cpu.toml", pp2 + ["--parallelism.pipeline_parallel_schedule", "1F1B"] + microbatch,
                    device="cpu", nproc_per_node=4)
    with pytest.raises(RecipeError, match=r"pipeline_parallel_degree = 1"):
        recipe.load("recipes/debug_cpu.toml", microbatch, device="cpu", nproc_per_node=2)


def test_overlap_is_part_of_the_run_name(monkeypatch):
    from moe_comm import recipe
    from moe_comm.metrics import naming

    monkeypatch.chdir(REPO)

    def name(*overrides):
        r = recipe.load("recipes/deepseek_v3_671b_b200.toml", list(overrides), check_paths=False)
        return naming.run_name(naming.run_identity(r.config, r.layout.nodes, r.layout.procs_per_node))

    nccl = ["--moe_comm.backend", "nccl", "--training.local_batch_size", "16",
            "--parallelism.pipeline_parallel_expert_parallel_overlap", "false"]
    off = name(*nccl, "--moe_comm.overlap", "none")
    assert off == "deepseek_v3_671b_b200-nccl-32x8-ep32-pp8-b16x4096"  # names from before overlap stay
    assert name(*nccl, "--moe_comm.overlap", "chunked") == "deepseek_v3_671b_b200-nccl-chunked-32x8-ep32-pp8-b16x4096"


def test_step_line_says_how_much_was_hidden():
    line = StepLine(step=3, total_steps=5, seconds_per_step=1.0, eta_s=2.0, loss=6.0, grad_norm=1.0,
                    tokens_per_s=100.0, mfu_pct=float("nan"), peak=resolve_peak("CPU", []), mem_gib=None,
                    mem_pct=None, dispatch_ms=4.12, combine_ms=3.21, comm_pct=1.04, hidden_pct=71.6)
    assert "dispatch 4.1ms combine 3.2ms (1.0% of step, 72% hidden)" in line.format()


# ---- trainings under torchrun ----------------------------------------------------------------

def _train(tmp: Path, name: str, nproc: int, variants: str, *overrides: str) -> list[dict]:
    dump = tmp / name
    argv = ["--job.config_file", "recipes/debug_cpu.toml", "--job.dump_folder", str(dump), "--training.steps", "2",
            "--training.seq_len", "64", "--model.flavor", "debugmodel_4heads",  # overlap_trainer.FLAVOR
            "--metrics.no-enable_wandb", *overrides]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_DATASETS_OFFLINE", "1")
        env.setenv("WANDB_MODE", "offline")
        ranks.spawn("overlap_trainer:run_rank", args=(nproc, free_port(), variants, argv), nprocs=nproc)
    return [json.loads((dump / f"overlap_rank{r}.json").read_text()) for r in range(nproc)]


def _assert_variant_matches(ranks: list[dict], variant: str, exact: bool) -> None:
    """`exact`: bit for bit (the same ops on the same shapes); else within CHUNKED_RTOL."""
    rtol = 0.0 if exact else CHUNKED_RTOL
    for rank, record in enumerate(ranks):
        for step, (plain, got) in enumerate(zip(record["plain"], record[variant], strict=True)):
            where = f"{variant}, rank {rank}, step {step + 1}"
            # every variant starts each step from the same weights
            ref, loss = float.fromhex(plain["loss"]), float.fromhex(got["loss"])
            assert abs(loss - ref) <= rtol * abs(ref), where
            assert got["other_grad_rel"] <= rtol, where
            assert got["experts_grad_rel"] <= rtol, where


def test_dual_pipe_v_and_chunked_match_plain_pp2_ep2(tmp_path):
    """DualPipeV with full activation checkpointing (now that its recompute is comm-free), each
    step also run without the checkpoints; and DualPipeV with [moe_comm] overlap = "chunked",
    whose forwards outside a pair run chunked, with full AC, per-layer selective AC and none."""
    both = ("dualpipev+chunked_noac", "dualpipev+chunked", "dualpipev+chunked_layerac")
    ranks = _train(tmp_path, "pp2_ep2", 4, ",".join(("plain_noac", "plain", "dualpipev_noac", "dualpipev",
                                                     "chunked_noac") + both),
                   "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                   "DualPipeV", "--training.local_batch_size", "4", "--activation_checkpoint.mode", "full")
    assert all(r["built_with_sync_points"] for r in ranks)  # parallelize wired DualPipeV's EP overlap
    for variant in ("plain", "dualpipev_noac", "dualpipev"):
        _assert_variant_matches(ranks, variant, exact=True)
    for variant in ("chunked_noac",) + both:
        _assert_variant_matches(ranks, variant, exact=False)
    # PP rank 1 holds stages 1 and 2 (two MoE layers each): its threads met at every sync point
    # (7 per overlapped forward/backward pair and thread, 3 pairs a step), and the backward
    # thread's recompute at none; PP rank 0's stage 0 has no MoE layer, so TorchTitan does not
    # coordinate there. With the forwards outside a pair chunked, the threads meet exactly as
    # often: a chunked layer's backward meets once per sync point, whichever thread it runs in
    for rank, record in enumerate(ranks):
        for variant in ("dualpipev_noac", "dualpipev") + both:
            barriers = [s["sync_barriers"] for s in record[variant]]
            assert barriers == ([42, 42] if rank >= 2 else [0, 0]), (rank, variant, barriers)
        assert all(s["sync_barriers"] == 0 for v in ("plain_noac", "plain", "chunked_noac") for s in record[v])
        # every variant calls dispatch and combine once per MoE layer and microbatch (the launch's
        # very first variant step also runs torch's shape inference: one forward more)
        per_step = record["plain_noac"][1]["calls"]
        assert per_step["dispatch"] > 0 and all(s["calls"] == per_step
                                                for v in ("plain", "dualpipev_noac", "dualpipev") for s in record[v])
        # ... and, chunked, twice where the forward ran outside a pair: on PP rank 0 everywhere
        # (no pair coordinates), on PP rank 1 in 5 of its 8 stage-forwards (3 ran in a pair), of
        # two MoE layers each: 3 x 2 + 5 x 2 x 2
        chunked = {"dispatch": 8, "combine": 8} if rank < 2 else {"dispatch": 26, "combine": 26}
        assert per_step == ({"dispatch": 4, "combine": 4} if rank < 2 else {"dispatch": 16, "combine": 16})
        assert all(s["calls"] == chunked for v in both for s in record[v]), (rank, [record[v] for v in both])


def test_microbatch_overlap_matches_plain_pp2_ep2(tmp_path):
    """[moe_comm] overlap = "microbatch" on Interleaved1F1B, PP 2 x EP 2, 2 stages per rank, 4
    microbatches, with full activation checkpointing, per-layer selective (the even layers') and
    none: the loss and every gradient equal torch's own Interleaved1F1B bit for bit (the same
    forwards and backwards, each stage's in the same microbatch order; only their interleaving
    and threads differ, and CPU ops are synchronous). Per-op selective AC does not run on CPU
    with FSDP at all (the module doc), so the unit tests and the GPU cases cover it."""
    ranks = _train(tmp_path, "pp2_ep2_microbatch", 4,
                   "plain_noac,microbatch_noac,plain,microbatch,plain_layerac,microbatch_layerac",
                   "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                   "Interleaved1F1B", "--training.local_batch_size", "4", "--moe_comm.overlap", "microbatch",
                   "--activation_checkpoint.mode", "full")
    for variant in ("microbatch_noac", "plain", "microbatch", "plain_layerac", "microbatch_layerac"):
        _assert_variant_matches(ranks, variant, exact=True)
    # stages 0 (embedding, the dense layer 0) and 2 (MoE layers 3, 4) on PP rank 0, 1 (MoE layers
    # 1, 2) and 3 (MoE layer 5, the output) on PP rank 1: what overlap_microbatches built
    built = {0: "0F0 0F1 2F0 2F1 0F2 (0F3;2B0)OVERLAP_F_B 2F2 2B1 (2F3;0B0)OVERLAP_F_B 0B1 2B2 2B3 0B2 0B3",
             1: "1F0 1F1 3F0 3F1 3B0 (1F2;3B1)OVERLAP_F_B 1F3 1B0 (3F2;1B1)OVERLAP_F_B 3F3 3B2 3B3 1B2 1B3"}
    for rank, record in enumerate(ranks):
        pp_rank = rank // 2
        assert record["built_with_sync_points"] and record["built_callback"]
        assert " ".join(record["built_actions"]) == built[pp_rank]
        for ac in ("_noac", "", "_layerac"):
            steps = record[f"microbatch{ac}"]
            assert [s["overlapped_actions"] for s in steps] == [2, 2]
            assert all(s["overlapped_actions"] == 0 and s["sync_barriers"] == 0 for s in record[f"plain{ac}"])
            # PP rank 0 pairs a stage without MoE layers with one that has two: nothing to
            # coordinate. PP rank 1 pairs stage 1 (two MoE layers) with stage 3 (one): the threads
            # meet at the one layer's points, 3 per thread (6 or 7 calls: the longer thread's
            # next D may call before the shorter one ends the coordination)
            barriers = [s["sync_barriers"] for s in steps]
            if pp_rank == 0:
                assert barriers == [0, 0], (rank, ac, barriers)
            else:
                assert all(12 <= b <= 14 for b in barriers), (rank, ac, barriers)
            # dispatch and combine once per MoE layer and microbatch, whatever the AC mode (the
            # launch's very first variant step also runs torch's shape inference: one forward more)
            per_step = {"dispatch": 2 * 4, "combine": 2 * 4} if pp_rank == 0 else {"dispatch": 3 * 4, "combine": 3 * 4}
            assert all(s["calls"] == per_step for s in steps)
            plain = record[f"plain{ac}"][1:] if ac == "_noac" else record[f"plain{ac}"]
            assert all(s["calls"] == per_step for s in plain)


def test_chunked_matches_plain_ep2_full_ac(tmp_path):
    """EP 2 with full activation checkpointing, each step also run without the checkpoints: the
    same loss and gradients bit for bit (the recompute replays the forward's dispatch and combine,
    and recomputes the rest with the same ops), and dispatch and combine called exactly as often
    (moe_comm.titan.recompute): once per MoE layer (5 in the debug model) and chunk."""
    ranks = _train(tmp_path, "ep2_full_ac", 2, "plain_noac,plain,chunked", "--activation_checkpoint.mode", "full")
    _assert_variant_matches(ranks, "plain", exact=True)
    _assert_variant_matches(ranks, "chunked", exact=False)
    for record in ranks:
        assert [s["calls"] for s in record["plain_noac"]] == [{"dispatch": 5, "combine": 5}] * 2
        assert [s["calls"] for s in record["plain"]] == [{"dispatch": 5, "combine": 5}] * 2
        assert [s["calls"] for s in record["chunked"]] == [{"dispatch": 10, "combine": 10}] * 2


# ---- the GPU cases, run on CPU: the cases themselves, not the streams ---------------------------

def test_gpu_overlap_cases_run_on_cpu(world_of_one):
    import overlap_cases
    from oracles import routing

    def backend(num_experts, top_k, hidden):
        return NcclBackend(MoELayerSpec(num_experts, top_k, hidden), dist.group.WORLD, MoEComm(backend="nccl"))

    def route(T, E, K, mode, g):
        return routing(T, E, K, mode, g, torch.device("cpu"))

    cpu = torch.device("cpu")
    overlap_cases.calls_in_flight(0, 1, cpu, route, backend(8, 2, 64), 64, 8, 2, iters=3)
    overlap_cases.layer_matches_plain(0, 1, cpu, backend)
    overlap_cases.microbatch_calls_in_flight(0, 1, cpu, route, backend(8, 2, 64), 64, 8, 2, iters=3)
    overlap_cases.microbatch_layer_matches_plain(0, 1, cpu, backend)
