"""The FP8 experts' autograd on CPU, where moe_comm.kernels.fp8 runs the pure-torch maths and
emulates torch._scaled_grouped_mm (dequantise, then matmul): every gradient reaches its input
(rows, W1, W2, W3, expert by expert), padding and empty experts behave, and nothing reads the
rows past the last expert's segment.

Tolerance: FP8's. Against float64 SwiGLU experts on the same (dequantised) input rows, the
output and every gradient must be within 10% relative L2 error. e4m3 rounds each operand to 3
mantissa bits (a rounding error of up to 6.25%, about 2-3% RMS for a row scaled to its amax), and
each result passes through two GEMMs and a requantisation, which measured 4-6% here; a gradient
routed to the wrong expert or weight is off by about 100%, which the test checks it would see."""

import dataclasses

import pytest
import torch

from moe_comm import fp8_experts
from moe_comm.fp8_experts import Fp8Rows
from moe_comm.kernels import fp8_reference as ref

L, D, I = 4, 64, 32
REAL = [13, 0, 40, 30]  # rows per expert; expert 1 gets none
PADDED = [16, 0, 48, 32]  # each segment padded to fp8_experts.ROW_ALIGN
TAIL = 16  # rows past the last segment (the receive capacity's unused end)
TOLERANCE = 0.10


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@dataclasses.dataclass
class Case:
    x_RD: torch.Tensor  # bf16 rows as dispatch lays them out (padding zero, tail NaN)
    rows: Fp8Rows
    counts_L: torch.Tensor
    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor
    dy_RD: torch.Tensor

    @property
    def real_rows(self) -> list[int]:
        starts = torch.tensor([0] + PADDED[:-1]).cumsum(0).tolist()
        return [r for s, n in zip(starts, REAL) for r in range(s, s + n)]

    @property
    def padding_rows(self) -> list[int]:
        real = set(self.real_rows)
        return [r for r in range(sum(PADDED)) if r not in real]


def make_case(seed: int = 0, param_dtype=torch.bfloat16) -> Case:
    g = torch.Generator().manual_seed(seed)
    rows = sum(PADDED) + TAIL
    x = torch.zeros(rows, D)
    dy = torch.zeros(rows, D)
    case = Case(x, None, torch.tensor(PADDED, dtype=torch.int32), None, None, None, dy)
    for r in case.real_rows:
        x[r] = torch.randn(D, generator=g)
        dy[r] = torch.randn(D, generator=g) * 1e-3  # gradient-sized: the floor must not flatten it
    x[sum(PADDED):] = float("nan")
    dy[sum(PADDED):] = float("nan")
    case.x_RD, case.dy_RD = x.to(torch.bfloat16), dy.to(torch.bfloat16)
    q, scale = ref.quantise_rows(case.x_RD, ref.MIN_AMAX_ROWS)
    q[sum(PADDED):] = float("nan")
    scale[sum(PADDED):] = float("nan")
    case.rows = Fp8Rows(q, scale)
    case.w1 = (torch.randn(L, I, D, generator=g) * 0.1).to(param_dtype)
    case.w2 = (torch.randn(L, D, I, generator=g) * 0.1).to(param_dtype)
    case.w3 = (torch.randn(L, I, D, generator=g) * 0.1).to(param_dtype)
    return case


def run_fp8(case: Case, wgrad_fp8: bool = True) -> dict[str, torch.Tensor]:
    """Output and gradients of the FP8 experts; the rows' gradient comes back through the
    zero-stride carrier, as dispatch_fp8_rows hands it to combine."""
    w = [t.clone().requires_grad_(True) for t in (case.w1, case.w2, case.w3)]
    carrier = torch.zeros((), dtype=torch.bfloat16, requires_grad=True).expand(case.x_RD.shape)
    grads = {}
    carrier.register_hook(lambda g: grads.setdefault("x", g))
    y = fp8_experts.grouped_experts(*w, carrier, case.rows, case.counts_L, wgrad_fp8=wgrad_fp8)
    y.backward(case.dy_RD)
    return {"y": y.detach(), "x": grads["x"], "w1": w[0].grad, "w2": w[1].grad, "w3": w[2].grad}


def run_reference(case: Case, perm=(0, 1, 2, 3)) -> dict[str, torch.Tensor]:
    """float64 SwiGLU experts on the same rows as the FP8 experts see them (dequantised), expert
    e's rows through the weights of expert perm[e] (a wrong routing when perm is not identity)."""
    x = ref.dequantise_rows(case.rows.data_RD, case.rows.scale_R).double().requires_grad_(True)
    w = [t.double().requires_grad_(True) for t in (case.w1, case.w2, case.w3)]
    y = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(PADDED):
        rows = slice(start, start + n)
        h1, h3 = x[rows] @ w[0][perm[e]].T, x[rows] @ w[2][perm[e]].T
        y[rows] = (h1 * torch.sigmoid(h1) * h3) @ w[1][perm[e]].T
        start += n
    used = sum(PADDED)
    y[:used].backward(case.dy_RD[:used].double())
    return {"y": y.detach(), "x": x.grad, "w1": w[0].grad, "w2": w[1].grad, "w3": w[2].grad}


def compare(got, want, rows) -> dict[str, float]:
    errors = {k: rel_l2(got[k][rows], want[k][rows]) for k in ("y", "x")}
    for k in ("w1", "w2", "w3"):
        errors[k] = rel_l2(got[k], want[k])
    return errors


@pytest.mark.parametrize("wgrad_fp8", [True, False])
def test_output_and_every_gradient_within_fp8_tolerance(wgrad_fp8):
    case = make_case()
    got, want = run_fp8(case, wgrad_fp8), run_reference(case)
    errors = compare(got, want, case.real_rows)
    assert all(e <= TOLERANCE for e in errors.values()), errors
    # the tolerance tells a wrong routing apart: another expert's weights, or W1 and W3 swapped
    wrong = compare(got, run_reference(case, perm=(2, 1, 3, 0)), case.real_rows)
    assert min(wrong[k] for k in ("y", "x", "w1", "w2", "w3")) > 0.5, wrong
    swapped = dict(got, w1=got["w3"], w3=got["w1"])
    assert min(compare(swapped, want, case.real_rows)[k] for k in ("w1", "w3")) > 0.5


def test_padding_empty_experts_and_the_tail():
    case = make_case(1)
    got = run_fp8(case)
    used = sum(PADDED)
    assert torch.isfinite(got["y"][:used]).all() and torch.isfinite(got["x"][:used]).all()
    for k in ("w1", "w2", "w3"):
        assert torch.isfinite(got[k]).all(), f"{k}: the NaN tail rows reached a weight gradient"
        assert torch.equal(got[k][1], torch.zeros_like(got[k][1])), f"{k}: the empty expert got a gradient"
    assert torch.equal(got["x"][case.padding_rows], torch.zeros(len(case.padding_rows), D, dtype=torch.bfloat16))
    assert torch.equal(got["y"][case.padding_rows], torch.zeros(len(case.padding_rows), D, dtype=torch.bfloat16))


def test_fp32_parameters_get_their_gradients():
    """At world 1 TorchTitan trains fp32 parameters under autocast: the weights are quantised from
    fp32 and their gradients arrive in fp32, equal to those of the bf16 copy's up to its rounding."""
    case = make_case(2, param_dtype=torch.float32)
    got = run_fp8(case)
    assert all(got[k].dtype == torch.float32 for k in ("w1", "w2", "w3"))
    errors = compare(got, run_reference(case), case.real_rows)
    assert all(e <= TOLERANCE for e in errors.values()), errors


def test_shapes_the_kernels_cannot_take_are_refused():
    with pytest.raises(ValueError, match=r"multiples of 16.*expert_dtype"):
        fp8_experts.check_shapes(7168, 2040)
    with pytest.raises(ValueError, match="at most 8192"):
        fp8_experts.check_shapes(16384, 2048)
    fp8_experts.check_shapes(7168, 2048)


def test_token_level_experts_take_the_fp8_rows():
    """TorchTitan's experts module, as the model builds it: with FP8 rows it runs the FP8 experts
    on its own weights; the gradient carrier alone (rows lost on the way) is an error, never a
    bf16 GEMM over zeros."""
    from moe_comm.titan.model import TokenLevelExperts

    case = make_case(3)
    experts = TokenLevelExperts(dim=D, hidden_dim=I, num_experts=L, use_grouped_mm=True)
    experts.rows_from_backend = True
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(experts, name).copy_(getattr(case, name))
    carrier = torch.zeros((), dtype=torch.bfloat16).expand(case.x_RD.shape)
    y = experts(carrier, case.counts_L, case.rows)
    assert torch.equal(y, run_fp8(case)["y"])
    with pytest.raises(RuntimeError, match="recv_fp8"):
        experts(carrier, case.counts_L)


def test_the_instrumented_backend_hands_the_fp8_rows_on(group):
    from moe_comm.backends.base import DispatchResult, MoELayerSpec
    from moe_comm.config import MoEComm
    from moe_comm.metrics.instrumented import InstrumentedBackend

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from metrics_fakes import FakeBackend

    rows = Fp8Rows(torch.zeros(4, 16, dtype=ref.FP8), torch.ones(4))

    class Fp8Fake(FakeBackend):
        def dispatch(self, x_TD, topk_idx_TK, topk_w_TK):
            return dataclasses.replace(super().dispatch(x_TD, topk_idx_TK, topk_w_TK), recv_fp8=rows)

    backend = InstrumentedBackend(Fp8Fake(MoELayerSpec(4, 2, 16), group, MoEComm()))
    x = torch.randn(2, 16, requires_grad=True)
    result = backend.dispatch(x, torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2))
    assert isinstance(result, DispatchResult) and result.recv_fp8 is rows


def test_autocast_leaves_the_fp8_maths_alone():
    """At world 1 TorchTitan trains under autocast; the FP8 experts choose every dtype themselves
    (on CPU, autocast would turn the emulated GEMMs' fp32 matmuls into bf16 ones)."""
    case = make_case(4)
    plain = run_fp8(case)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = run_fp8(case)
    for k in plain:
        assert torch.equal(plain[k], under[k]), k


def _microbatch(case: Case, w: list[torch.Tensor], cache, dy_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """One microbatch's forward and backward through the FP8 experts on the weights `w` (leaves
    that accumulate their gradients), with `cache` or without."""
    carrier = torch.zeros((), dtype=torch.bfloat16, requires_grad=True).expand(case.x_RD.shape)
    grads = {}
    carrier.register_hook(lambda g: grads.setdefault("x", g))
    y = fp8_experts.grouped_experts(*w, carrier, case.rows, case.counts_L, cache=cache)
    y.backward(case.dy_RD * dy_scale)
    return {"y": y.detach(), "x": grads["x"]}


def test_the_weight_cache_quantises_once_per_step_and_changes_nothing():
    """Two microbatches and an optimizer step, then two more: with the cache the weights are
    quantised once per step (and dgrad's two transposed copies once), and every output, rows'
    gradient and accumulated weight gradient equals the uncached run's bit for bit (the same
    kernels on the same operands)."""
    case = make_case(3)
    runs = {}
    for cached in (False, True):
        w = [t.clone().float().requires_grad_(True) for t in (case.w1, case.w2, case.w3)]
        opt = torch.optim.SGD(w, lr=0.5)
        cache = fp8_experts.WeightCache() if cached else None
        out, made = [], []
        for step in range(2):
            for mb in range(2):
                out.append(_microbatch(case, w, cache, dy_scale=1.0 + mb))
            out.append({f"grad_w{i}": t.grad.clone() for i, t in enumerate(w)})
            made.append(dict(cache.made) if cache else None)
            opt.step()
            opt.zero_grad()
        runs[cached] = (out, made, [t.detach().clone() for t in w])
    for got, want in zip(runs[True][0], runs[False][0]):
        for k in want:
            assert torch.equal(got[k], want[k]), k
    assert all(torch.equal(a, b) for a, b in zip(runs[True][2], runs[False][2]))
    assert runs[True][1] == [{"forward": 1, "transposed": 2}, {"forward": 2, "transposed": 4}]


def test_the_weight_cache_sees_every_change_of_the_weights():
    """A weight written in place (version bump) is quantised again; so is one whose values FSDP
    replaced with its version counter preserved, once any optimizer steps (FSDP2's all-gather
    does exactly that each step); a different tensor is never served another's copy."""
    case = make_case(4)
    w = [t.clone().float() for t in (case.w1, case.w2, case.w3)]
    cache = fp8_experts.WeightCache()

    def forward(weights):
        y = fp8_experts.grouped_experts(*weights, torch.zeros((), dtype=torch.bfloat16).expand(case.x_RD.shape),
                                        case.rows, case.counts_L, cache=cache)
        fresh = fp8_experts.grouped_experts(*weights, torch.zeros((), dtype=torch.bfloat16).expand(case.x_RD.shape),
                                            case.rows, case.counts_L)
        assert torch.equal(y, fresh)
        return cache.made["forward"]

    assert forward(w) == 1 and forward(w) == 1
    w[1].mul_(2.0)  # in place: the version counter moves
    assert forward(w) == 2
    with torch.autograd._unsafe_preserve_version_counter(w[0]):
        w[0].mul_(-1.0)  # as FSDP2's all-gather writes the unsharded parameter
    other = torch.zeros(1, requires_grad=True)
    other.grad = torch.ones(1)
    torch.optim.SGD([other], lr=0.1).step()  # an optimizer step, whichever optimizer
    assert forward(w) == 3
    assert forward([t.clone() for t in w]) == 4  # other tensors: never another's copy


class _Experts(torch.nn.Module):
    """The experts' weights as a model part TorchTitan's optimizer containers take."""

    def __init__(self, case: Case):
        super().__init__()
        self.w1, self.w2, self.w3 = (torch.nn.Parameter(t.clone().float()) for t in (case.w1, case.w2, case.w3))


def _titan_optimizers(kind: str, model: torch.nn.Module):
    """TorchTitan's own optimizer containers, as build_optimizers makes them: its AdamW fused (the
    recipes' implementation: it writes the weights without bumping their versions) or foreach,
    stepped by an OptimizersContainer (itself an optimizer that steps its own: torch's step hooks
    run for both), or one optimizer per parameter stepped in the backward."""
    from torchtitan.components.optimizer import OptimizersContainer, OptimizersInBackwardContainer

    kwargs = {"lr": 0.05, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "fused": kind != "foreach",
              "foreach": kind == "foreach"}
    container = OptimizersInBackwardContainer if kind == "in_backward" else OptimizersContainer
    return container([model], torch.optim.AdamW, kwargs)


@pytest.mark.parametrize("kind", ["fused", "foreach", "in_backward"])
def test_the_weight_cache_makes_whole_weights_ahead_of_the_next_step(kind):
    """Given the weights, the cache makes both copies at each step of TorchTitan's optimizers (the
    one-GPU recipe: while the host logs the step): once a step although the container's and its
    AdamW's step hooks both run, and although the fused AdamW leaves the versions as they were
    (a118067 keyed the copies on versions and never made them again: run 60). The next forward
    and backward make nothing, and every output, rows' gradient and weight gradient equals the
    uncached run's bit for bit, so the copies are of the weights the optimizer just wrote.
    Optimizers in backward step each parameter alone: the copies are made after each of the
    layer's three, and once more at the container's step, not after every other parameter's."""
    case = make_case(5)
    runs = {}
    for ahead in (False, True):
        model = _Experts(case)
        bystander = torch.nn.Linear(4, 4)  # another parameter the optimizers step
        opt = _titan_optimizers(kind, torch.nn.ModuleList([model, bystander]))
        w = [model.w1, model.w2, model.w3]
        cache = fp8_experts.WeightCache(lambda: tuple(w)) if ahead else None
        out, made = [], []
        for step in range(3):
            out.append(_microbatch(case, w, cache))
            bystander(torch.ones(4)).sum().backward()
            if kind != "in_backward":
                out.append({f"grad_w{i}": t.grad.clone() for i, t in enumerate(w)})
            made.append(cache.made["forward"] if cache else None)
            opt.step()
            opt.zero_grad()
        out.append({f"w{i}": t.detach().clone() for i, t in enumerate(w)})
        runs[ahead] = (out, made)
    for got, want in zip(runs[True][0], runs[False][0]):
        for k in want:
            assert torch.equal(got[k], want[k]), k
    if kind == "in_backward":  # the forward's, then 3 + 1 a step
        assert runs[True][1] == [4, 8, 12]
    else:  # the first step's forward makes them; then each optimizer step does, none between
        assert runs[True][1] == [1, 2, 3]


class _Raising(torch.optim.Optimizer):
    """An optimizer whose step raises after its own optimizer stepped, once."""

    def __init__(self, params):
        self.inner = torch.optim.SGD(params, lr=0.5)
        self.raised = False
        super().__init__(params, {"lr": 0.5})

    def step(self, closure=None):
        self.inner.step()
        if not self.raised:
            self.raised = True
            raise RuntimeError("a step that failed")


def test_an_optimizer_step_that_raised_leaves_later_steps_counted():
    """A step that raised never reaches torch's post hooks; the next step of the same optimizer
    still counts, and the weights made ahead are made again."""
    w = [torch.ones(4, 16, 32, requires_grad=True), torch.ones(4, 32, 16, requires_grad=True),
         torch.ones(4, 16, 32, requires_grad=True)]
    for t in w:
        t.grad = torch.ones_like(t)
    cache = fp8_experts.WeightCache(lambda: tuple(w))
    opt = _Raising(w)
    steps = fp8_experts._optimizer_steps
    with pytest.raises(RuntimeError, match="failed"):
        opt.step()
    assert fp8_experts._optimizer_steps == steps
    opt.step()
    assert fp8_experts._optimizer_steps == steps + 1 and not fp8_experts._stepping
    assert cache.made["forward"] == 1


def test_a_run_caches_the_weights_where_they_are_reused_or_whole_between_steps():
    assert not fp8_experts.caches_weights(1, "none", True)  # one forward a step on FSDP's gathered weights
    assert fp8_experts.caches_weights(1, "none", False)  # whole weights (world 1): made ahead of the step
    assert fp8_experts.caches_weights(2, "none", True)  # pipeline microbatches or gradient accumulation
    assert fp8_experts.caches_weights(1, "full", True) and fp8_experts.caches_weights(1, "selective", True)  # recompute
    from moe_comm.layout import Layout

    def layout(**degrees):
        d = dict(world=8, nodes=1, procs_per_node=8, dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1)
        return Layout(**{**d, **degrees})

    assert not layout(world=1, procs_per_node=1).experts_sharded
    assert not layout(dp_replicate=8).experts_sharded  # DDP keeps whole parameters
    assert layout(dp_shard=8, ep=8).experts_sharded and layout(dp_shard=8).experts_sharded
    assert layout(tp=8).experts_sharded
    # the forward's e4m3 copies with one fp32 scale per row; dgrad's transposed codes, no scales
    assert fp8_experts.forward_weight_bytes(8, 7168, 2048) == 3 * 8 * 7168 * 2048 + 4 * 8 * (2 * 2048 + 7168)
    assert fp8_experts.cached_weight_bytes(8, 7168, 2048) == 2 * 3 * 8 * 7168 * 2048 + 4 * 8 * (2 * 2048 + 7168)


def test_forwards_per_step_counts_microbatches_and_accumulation():
    """What moe_comm.titan.parallelize asks before it gives each MoE layer a WeightCache."""
    from types import SimpleNamespace as NS

    from moe_comm.titan.parallelize import forwards_per_step

    def job(local, global_=-1, mb=1):
        return NS(training=NS(local_batch_size=local, global_batch_size=global_),
                  parallelism=NS(pipeline_parallel_microbatch_size=mb))

    dims = NS(dp_replicate=1, dp_shard=4, pp_enabled=False)
    assert forwards_per_step(job(2), dims) == 1
    assert forwards_per_step(job(2, global_=16), dims) == 2  # 16 / (2 x 4): two accumulation steps
    assert forwards_per_step(job(32, mb=1), NS(dp_replicate=1, dp_shard=32, pp_enabled=True)) == 32
