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
- DualPipeV's sync points: their order around dispatch and combine, and the backward's first D.
- The checks before launch, and the metrics of an overlapped run.
- Two trainings under torchrun (the whole path: TorchTitan's trainer, FSDP, the train spec),
  each step run once per variant from the same weights (tests/overlap_trainer.py):
  PP 2 x EP 2 with DualPipeV on 4 processes (its EP overlap with two threads, "chunked", and
  neither), and EP 2 with full activation checkpointing on 2. DualPipeV's EP overlap equals the
  plain schedule bit for bit (the same ops on the same shapes in the same order, only the two
  threads' interleaving differs, and CPU ops are synchronous); "chunked" within CHUNKED_RTOL,
  as at unit level. TorchTitan's per-op selective AC with
  FSDP does not run on CPU with or without overlap ("profiler._record_function_enter_new ...
  not found in storage" in FSDP's post-forward during recompute), so it is checked at unit
  level only.

What only the GPU covers (tests/gpu/nvshmem_cases.py): real streams and events, the caching
allocator's reuse across streams, autograd's own stream syncs in backward, the recompute
running on the compute stream, and the nvshmem kernels with calls in flight on the comm stream.
"""

import contextlib
import copy
import json
import os
import subprocess
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

REPO = Path(__file__).resolve().parents[1]

# "chunked" against "none", fp32 on CPU: relative bound on the loss and on each gradient (module doc
# says why these are not bit for bit: row-count-dependent BLAS blocking, and the expert weights'
# gradients summed over two chunks). ~100 fp32 ulps; a wrong chunk (a row lost, doubled or sent
# to the wrong expert) moves them by orders of magnitude more.
CHUNKED_RTOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    """Torch's intra-op threads crawl when the cores are oversubscribed (a shared CI machine):
    one thread keeps these small models at about a second each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _debug_args():
    from torchtitan.models.deepseek_v3 import deepseekv3_args

    args = copy.deepcopy(deepseekv3_args["debugmodel"])
    args.moe_impl = "standard"  # update_from_config sets these in a run; on CPU grouped_mm is off
    args.moe_args.use_grouped_mm = False
    args.n_layers = 3  # one dense layer and two MoE layers
    return args


def _model(ac: str, config: MoEComm) -> MoECommDeepSeekV3Model:
    """TorchTitan's debug model with our MoE layers, every MoE layer on an instrumented nccl
    backend over the world of one, and TorchTitan's activation checkpointing."""
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac

    from moe_comm.titan.parallelize import sac_save_list

    torch.manual_seed(0)
    model = MoECommDeepSeekV3Model(_debug_args())
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    for block in model.layers.values():
        if block.moe_enabled:
            moe = block.moe
            layer = MoELayerSpec(moe.experts.num_experts, moe.router.top_k, moe.experts.w1.shape[-1])
            moe.comm_backend = instrument(build_backend(config, layer, dist.group.WORLD))
    if ac != "none":
        mode, option = ac.split(":")
        apply_ac(model, ActivationCheckpoint(mode=mode, selective_ac_option=option),
                 op_sac_save_list=sac_save_list("nccl"))
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

    def __init__(self, device):
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
    args = _debug_args()
    torch.manual_seed(0)
    moe = TokenLevelMoE(args.moe_args, dim=args.dim, hidden_dim=args.moe_inter_dim)
    with torch.no_grad():
        moe.init_weights(0.02, buffer_device=torch.device("cpu"))
    layer = MoELayerSpec(moe.experts.num_experts, moe.router.top_k, args.dim)
    wrapped = instrument(NcclBackend(layer, dist.group.WORLD, MoEComm(backend="nccl", overlap=overlap_mode)))
    moe.comm_backend = RecordingBackend(wrapped)
    moe.dual_pipe_v = dual_pipe_v
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
    assert NcclBackend.check_run(_plan(dual_pipe_v=True, activation_checkpoint="none")) == []
    with pytest.raises(RecipeError, match=r'\[moe_comm\] overlap = "chunked".*"no-overlap"'):
        NoOverlapBackend.check_run(_plan(overlap="chunked"))
    with pytest.raises(RecipeError, match=r'DualPipeV.*pipeline_parallel_expert_parallel_overlap.*'
                                          r'\[activation_checkpoint\] mode = "full"'):
        NcclBackend.check_run(_plan(dual_pipe_v=True, activation_checkpoint="full"))
    with pytest.raises(RecipeError, match=r'overlap = "chunked" and DualPipeV'):
        NcclBackend.check_run(_plan(overlap="chunked", dual_pipe_v=True))


def test_recipe_refuses_dual_pipe_v_with_ac_before_launch(monkeypatch):
    from moe_comm import recipe

    monkeypatch.chdir(REPO)
    dual_pipe = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                 "DualPipeV", "--training.local_batch_size", "4"]
    r = recipe.load("recipes/debug_cpu.toml", dual_pipe, device="cpu", nproc_per_node=4)
    assert r.plan.dual_pipe_v and r.plan.activation_checkpoint == "none"
    with pytest.raises(RecipeError, match="activation_checkpoint"):
        recipe.load("recipes/debug_cpu.toml", dual_pipe + ["--activation_checkpoint.mode", "selective"],
                    device="cpu", nproc_per_node=4)
    off = ["--parallelism.no-pipeline_parallel_expert_parallel_overlap", "--moe_comm.overlap", "chunked",
           "--activation_checkpoint.mode", "full"]
    assert not recipe.load("recipes/debug_cpu.toml", dual_pipe + off, device="cpu", nproc_per_node=4).plan.dual_pipe_v


def test_overlap_is_part_of_the_run_name(monkeypatch):
    from moe_comm import recipe
    from moe_comm.metrics import naming

    monkeypatch.chdir(REPO)

    def name(*overrides):
        r = recipe.load("recipes/deepseek_v3_671b_b200.toml", list(overrides), check_paths=False)
        return naming.run_name(naming.run_identity(r.config, r.layout.nodes, r.layout.procs_per_node))

    nccl = ["--moe_comm.backend", "nccl", "--training.local_batch_size", "8"]
    off = name(*nccl, "--moe_comm.overlap", "none")
    assert off == "deepseek_v3_671b_b200-nccl-32x8-ep32-pp8-b8x4096"  # names from before overlap stay
    assert name(*nccl, "--moe_comm.overlap", "chunked") == "deepseek_v3_671b_b200-nccl-chunked-32x8-ep32-pp8-b8x4096"


def test_step_line_says_how_much_was_hidden():
    line = StepLine(step=3, total_steps=5, seconds_per_step=1.0, eta_s=2.0, loss=6.0, grad_norm=1.0,
                    tokens_per_s=100.0, mfu_pct=float("nan"), peak=resolve_peak("CPU", []), mem_gib=None,
                    mem_pct=None, dispatch_ms=4.12, combine_ms=3.21, comm_pct=1.04, hidden_pct=71.6)
    assert "dispatch 4.1ms combine 3.2ms (1.0% of step, 72% hidden)" in line.format()


# ---- trainings under torchrun ----------------------------------------------------------------

def _train(tmp: Path, name: str, nproc: int, variants: str, *overrides: str) -> list[dict]:
    dump = tmp / name
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", MOE_COMM_TEST_VARIANTS=variants)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(REPO / "tests" / "overlap_trainer.py"), "--job.config_file", "recipes/debug_cpu.toml",
           "--job.dump_folder", str(dump), "--training.steps", "2", "--training.seq_len", "64",
           "--metrics.no-enable_wandb", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
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
    ranks = _train(tmp_path, "pp2_ep2", 4, "plain,dualpipev,chunked",
                   "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                   "DualPipeV", "--training.local_batch_size", "4")
    assert all(r["built_with_sync_points"] for r in ranks)  # parallelize wired DualPipeV's EP overlap
    _assert_variant_matches(ranks, "dualpipev", exact=True)
    _assert_variant_matches(ranks, "chunked", exact=False)
    # PP rank 1 holds stages 1 and 2 (two MoE layers each): its threads met at every sync point
    # (7 per overlapped forward/backward pair and thread, 3 pairs a step); PP rank 0's stage 0 has
    # no MoE layer, so TorchTitan does not coordinate there
    for rank, record in enumerate(ranks):
        barriers = [s["sync_barriers"] for s in record["dualpipev"]]
        assert barriers == ([42, 42] if rank >= 2 else [0, 0]), (rank, barriers)
        assert all(s["sync_barriers"] == 0 for v in ("plain", "chunked") for s in record[v])


def test_chunked_matches_plain_ep2_full_ac(tmp_path):
    ranks = _train(tmp_path, "ep2_full_ac", 2, "plain,chunked", "--activation_checkpoint.mode", "full")
    _assert_variant_matches(ranks, "chunked", exact=False)


# ---- the GPU cases, run on CPU: the cases themselves, not the streams ---------------------------

def test_gpu_overlap_cases_run_on_cpu(world_of_one):
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import overlap_cases
    from oracles import routing

    def backend(num_experts, top_k, hidden):
        return NcclBackend(MoELayerSpec(num_experts, top_k, hidden), dist.group.WORLD, MoEComm(backend="nccl"))

    def route(T, E, K, mode, g):
        return routing(T, E, K, mode, g, torch.device("cpu"))

    cpu = torch.device("cpu")
    overlap_cases.calls_in_flight(0, 1, cpu, route, backend(8, 2, 64), 64, 8, 2, iters=3)
    overlap_cases.layer_matches_plain(0, 1, cpu, backend)
