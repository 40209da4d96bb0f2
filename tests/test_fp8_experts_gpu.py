"""The FP8 experts on a Hopper GPU (run on the device: `pytest -m gpu tests/test_fp8_experts_gpu.py`).

Three layers of checks, each against something written apart from what it checks:
  - csrc/experts' kernels against moe_comm.kernels.fp8_reference (itself checked against numpy in
    tests/test_fp8_maths.py): bit for bit where a kernel only quantises; where it also computes
    the SiLU gate, to rounding (CUDA's expf against torch's exp: a value near a rounding boundary
    may land one e4m3 step away);
  - torch._scaled_grouped_mm against its emulation (dequantise, fp32 matmul): the operand
    layouts and scale orders this project relies on, 2D x 3D and 2D x 2D, within 1% (bf16 output
    and fast accumulation);
  - the FP8 experts at the flagship rank's shape (8 experts, hidden 7168, inter 2048, about 33k
    rows, balanced and skewed counts, one expert empty) against TorchTitan's bf16 experts: output
    and every gradient within TOLERANCE; and against the same FP8 maths emulated in fp32 on the
    GPU within EMULATION_TOLERANCE, which separates a kernel's fault from FP8's own error.
"""

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the FP8 experts run on Hopper (SM 9.0) only", allow_module_level=True)

from moe_comm import fp8_experts  # noqa: E402
from moe_comm.fp8_experts import Fp8Rows  # noqa: E402
from moe_comm.kernels import fp8  # noqa: E402
from moe_comm.kernels import fp8_reference as ref  # noqa: E402

DEVICE = torch.device("cuda", 0)
EXPERTS, HIDDEN, INTER = 8, 7168, 2048
ROW_WIDTHS = (HIDDEN, 3072, INTER, 400)
# Relative L2 of the FP8 experts' output and each gradient against the bf16 experts. Each e4m3
# operand carries up to 6.25% rounding error (3 mantissa bits), about 2-3% RMS once scaled to
# its row's or channel's amax, and every result passes two or three such roundings (x or dy,
# the gate or its backward, the weights): this test's maths, run on CPU at hidden 256 with the
# GEMMs emulated, measured 5-7%. 10% leaves room for fast accumulation and the tails of real
# rows; a mis-scaled or mis-routed expert is off by more than 50%.
TOLERANCE = 0.10
# The kernels against the same maths emulated in fp32: rounding flips, bf16 outputs, and fast
# accumulation (the scaled grouped GEMM's e4m3 tensor-core accumulator keeps fewer bits than
# fp32 over K = 7168; measured 2.1-2.3% on one H200, 2026-12-02). Far below FP8's own error, so a
# fault in a kernel's scale or layout (tens of percent) still shows.
EMULATION_TOLERANCE = 0.03
COUNTS = {
    "balanced": [4136] * 8,  # 33,088 rows: the flagship rank's mean
    "skewed": [11000, 8000, 5500, 3600, 2500, 1500, 992, 0],  # hot experts, one empty
}


def rel_l2(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def bf16(*shape, scale=1.0, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(torch.bfloat16)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    from moe_comm.kernels.runtime import load_library

    load_library()


def offsets_of(counts) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int32, device=DEVICE).cumsum(0, dtype=torch.int32)


def codes(q):
    return q.view(torch.uint8)


# ---- kernels against the reference ----------------------------------------------------------

def assert_same_codes(got_q, got_s, want_q, want_s, what=""):
    """Bit for bit; on a mismatch the message says how many codes and scales differ and shows the
    first few differing values (code values and scales) so the cause can be read off one run."""
    got_c, want_c = codes(got_q), codes(want_q)
    same_q, same_s = torch.equal(got_c, want_c), torch.equal(got_s, want_s)
    if same_q and same_s:
        return
    lines = [f"{what}: {(got_c != want_c).sum().item()} of {got_c.numel()} codes and "
             f"{(got_s != want_s).sum().item()} of {got_s.numel()} scales differ"]
    for idx in (got_c != want_c).nonzero()[:6].tolist():
        lines.append(f"  at {idx}: ours {got_q[tuple(idx)].float().item()!r} want {want_q[tuple(idx)].float().item()!r}")
    bad_s = (got_s != want_s).nonzero()[:3].tolist()
    for idx in bad_s:
        lines.append(f"  scale at {idx}: ours {got_s[tuple(idx)].item()!r} want {want_s[tuple(idx)].item()!r}")
    raise AssertionError("\n".join(lines))


def test_rows_and_weights_quantise_bit_for_bit():
    counts = [160, 0, 48, 512]
    total = sum(counts)
    x = bf16(total + 32, HIDDEN, seed=1)
    x[5] = 0
    x[6] = 0  # a zero row with negative zeros: the codes keep their signs
    x[6, ::3] = -0.0
    x[7] *= 1e-9
    offsets = offsets_of(counts)
    # dgrad's rows: each times its expert's weight row scales first (an expert with no rows
    # between), or as they are; and the rows' (expert, channel) amax
    # at each block size the row kernels take (csrc/experts/rows.cuh, with_row_threads): 7168
    # channels in blocks of 512 threads, 3072 in blocks of 256, 2048 of 128, 400 of 64
    for width in ROW_WIDTHS:
        xw = x[:, :width].contiguous()
        channel_scale = torch.rand(len(counts), width, device=DEVICE) * 1e-3 + 1e-5
        for cs, what in ((None, "rows"), (channel_scale, "rows with the weights' scales folded in")):
            what = f"{what}, {width} channels"
            q, scale, col_amax = fp8.quantise_grad_rows(xw, offsets, cs)
            want_q, want_scale, want_amax = ref.quantise_grad_rows(xw[:total], offsets, cs)
            assert_same_codes(q[:total], scale[:total], want_q, want_scale, what)
            assert torch.equal(col_amax, want_amax), what
    # tens of rows a block (each row's loads issued while the block finishes the one before),
    # expert boundaries inside blocks' shares
    many = [7000, 0, 12000, 3008]
    xm, om = bf16(sum(many), HIDDEN, seed=13), offsets_of(many)
    cs = torch.rand(len(many), HIDDEN, device=DEVICE) * 1e-3 + 1e-5
    q, scale, col_amax = fp8.quantise_grad_rows(xm, om, cs)
    want_q, want_scale, want_amax = ref.quantise_grad_rows(xm, om, cs)
    assert_same_codes(q, scale, want_q, want_scale, "many rows a block")
    assert torch.equal(col_amax, want_amax), "many rows a block"

    for dtype in (torch.bfloat16, torch.float32):
        w1, w3 = bf16(4, INTER, HIDDEN, scale=0.02, seed=2).to(dtype), bf16(4, INTER, HIDDEN, scale=0.02, seed=3).to(dtype)
        w2 = bf16(4, HIDDEN, INTER, scale=0.02, seed=4).to(dtype)
        # and a tile cut short (96 rows, the stack's seam at 80 inside a tile), a row that is not a
        # whole number of passes (400 channels)
        odd_a, odd_b = bf16(3, 80, 400, seed=7).to(dtype), bf16(3, 16, 400, scale=3.0, seed=8).to(dtype)
        for a, b in ((w1, w3), (w2, None), (odd_a, odd_b)):
            got, want = fp8.weights(a, b), ref.weights(a, b)
            assert_same_codes(got[0], got[1], want[0], want[1], f"weights {dtype}")
            got_t = fp8.weights_transposed(got[0])
            assert torch.equal(codes(got_t), codes(ref.weights_transposed(want[0]))), f"weights transposed {dtype}"


def test_weight_gradients_widen_bit_for_bit():
    """fp8.widen (the weight gradients to fp32 parameters' dtype) is exactly torch's cast, for
    every bf16 value: finite, subnormal, infinite, NaN, at a gradient's shape and a small one."""
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(DEVICE)
    for x in (every, bf16(3, 40, 72, seed=11), bf16(32, 64, 7168, seed=12)):
        got = fp8.widen(x, torch.full(x.shape, float("nan"), device=DEVICE))
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert torch.equal(got.view(torch.int32), x.float().view(torch.int32))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        fp8.widen(bf16(3, 5), torch.empty(3, 5, device=DEVICE))
    with pytest.raises(RuntimeError, match="out must be"):
        fp8.widen(bf16(3, 8), torch.empty(3, 8, device=DEVICE, dtype=torch.bfloat16))


@pytest.mark.parametrize("counts", [[48, 0, 320, 1024, 16], [2496, 0, 1040, 16, 3088]])
def test_group_columns_bit_for_bit(counts):
    """Experts of fewer rows than a block's chunk, of exactly one chunk, of several with a part
    left over, and without rows (its scales are still written). A chunk is the mean expert's rows
    in whole tiles, at least 1,024: 1,024 rows in the first case, 1,408 in the second."""
    total = sum(counts)
    offsets = offsets_of(counts)
    x = bf16(total + 40, 2 * INTER, scale=1e-4, seed=5)
    col_amax = ref.column_amax(x[:total], offsets)
    for halves in (1, 2):
        q, scale = fp8.group_columns(x, col_amax, offsets, halves)
        want_q, want_scale = ref.group_columns(x[:total], col_amax, offsets, halves)
        assert q.shape[1] % 16 == 0 and q.shape[1] >= x.shape[0]
        assert_same_codes(q[:, :total], scale, want_q[:, :total], want_scale, f"group columns, halves {halves}")
    # the amax as a view of a wider [experts, 3 inter] (the gate's backward hands it so)
    wide = torch.cat([torch.rand(len(counts), INTER, device=DEVICE), col_amax], dim=1)
    q, scale = fp8.group_columns(x, wide[:, INTER:], offsets, 2)
    want_q, want_scale = ref.group_columns(x[:total], col_amax, offsets, 2)
    assert_same_codes(q[:, :total], scale, want_q[:, :total], want_scale, "group columns, amax a view")
    xq, _ = ref.quantise_rows(bf16(total + 40, HIDDEN, seed=6), ref.MIN_AMAX_ROWS)
    got, want = fp8.transpose_rows(xq, offsets), ref.transpose_rows(xq, offsets)
    assert got.shape == want.shape and torch.equal(codes(got[:, :total]), codes(want[:, :total])), "rows transposed"


@pytest.mark.parametrize("inter, counts", [(INTER, [256, 0, 736]), (3072, [256, 0, 736]), (400, [256, 0, 736]),
                                          (INTER, [5000, 0, 11000, 3008])])
def test_gate_and_its_backward_to_rounding(inter, counts):
    """At each block size the row kernels take: inter 400 in blocks of 64 threads, 2048 of 128,
    3072 of 256 (whose folded scales and amax need more than 48 KiB of shared memory); and with
    tens of rows a block, each row's loads issued while the block finishes the one before."""
    total = sum(counts)
    offsets = offsets_of(counts)
    h13 = bf16(total, 2 * inter, scale=2.0, seed=7)
    dh = bf16(total, inter, scale=1e-5, seed=8)

    def close_codes(got_q, got_s, want_q, want_s):
        assert torch.allclose(got_s, want_s, rtol=1e-5, atol=0)
        differ = (codes(got_q) != codes(want_q)).float().mean().item()
        assert differ < 1e-3, f"{differ:.2%} of the e4m3 values differ"
        got, want = got_q.float() * got_s[:, None], want_q.float() * want_s[:, None]
        assert torch.allclose(got, want, rtol=2 ** -3, atol=want_s.max().item() * 2 ** -9)

    close_codes(*fp8.gate(h13, offsets), *ref.gate(h13))
    channel_scale = torch.rand(len(counts), 2 * inter, device=DEVICE) * 1e-2 + 1e-4
    row_scale = torch.rand(total, device=DEVICE) * 1e-2
    # dgrad's folded weight scales and the input rows' scales, or neither
    for cs, rs in ((None, None), (channel_scale, row_scale)):
        got, want = fp8.gate_backward(h13, dh, offsets, cs, rs), ref.gate_backward(h13, dh, offsets, cs, rs)
        close_codes(got[0], got[1], want[0], want[1])
        for g, w in zip(got[2:], want[2:]):  # dh13 and h in bf16, their columns' amax
            assert torch.allclose(g.float(), w.float(), rtol=1e-2, atol=w.float().abs().max().item() * 1e-3)
        # the amax is exactly that of the bf16 rows the kernel wrote
        assert torch.equal(got[4], ref.column_amax(torch.cat([got[3], got[2]], dim=1), offsets))


def test_scaled_grouped_mm_takes_our_layouts():
    counts = [512, 0, 1536, 2048]
    offsets = offsets_of(counts)
    total = sum(counts)
    a = bf16(total, HIDDEN, seed=9).to(ref.FP8)
    b = bf16(4, INTER, HIDDEN, seed=10).to(ref.FP8).transpose(-2, -1)  # [L, K, N] column-major
    sa = torch.rand(total, device=DEVICE) + 0.5
    sb = torch.rand(4, INTER, device=DEVICE) + 0.5
    got, want = fp8.scaled_grouped_mm(a, b, sa, sb, offsets), ref.scaled_grouped_mm(a, b, sa, sb, offsets)
    assert rel_l2(got, want) < 0.01

    # 2D x 2D: the weight gradients' layout (A [M, rows] row-major, B [rows, N] column-major)
    m, n = INTER, HIDDEN
    rows = (total + 15) // 16 * 16
    a2 = bf16(m, rows, seed=11).to(ref.FP8)
    b2 = bf16(n, rows, seed=12).to(ref.FP8).t()
    sa2 = torch.rand(4 * m, device=DEVICE) + 0.5
    sb2 = torch.rand(4 * n, device=DEVICE) + 0.5
    got, want = fp8.scaled_grouped_mm(a2, b2, sa2, sb2, offsets), ref.scaled_grouped_mm(a2, b2, sa2, sb2, offsets)
    assert rel_l2(got[[0, 2, 3]], want[[0, 2, 3]]) < 0.01
    assert torch.equal(got[1], torch.zeros_like(got[1])), "an expert with no rows got a nonzero weight gradient"


# ---- the experts at the flagship rank's shape ------------------------------------------------

def flagship_case(counts):
    padded = [(c + 15) // 16 * 16 for c in counts]
    rows = sum(padded) + 64  # the receive capacity's unused tail
    x = torch.zeros(rows, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
    dy = torch.zeros_like(x)
    real = []
    start = 0
    for c, p in zip(counts, padded):
        real += range(start, start + c)
        start += p
    real = torch.tensor(real, device=DEVICE)
    x[real] = bf16(len(real), HIDDEN, seed=13)
    dy[real] = bf16(len(real), HIDDEN, scale=1e-5, seed=14)
    w = [bf16(EXPERTS, INTER, HIDDEN, scale=0.02, seed=15), bf16(EXPERTS, HIDDEN, INTER, scale=0.02, seed=16),
         bf16(EXPERTS, INTER, HIDDEN, scale=0.02, seed=17)]
    return x, dy, w, torch.tensor(padded, dtype=torch.int32, device=DEVICE), real


def bf16_experts(x, dy, w, counts_L):
    from torchtitan.models.moe.moe import _run_experts_grouped_mm

    leaves = [t.clone().requires_grad_(True) for t in (x, *w)]
    y = _run_experts_grouped_mm(leaves[1], leaves[2], leaves[3], leaves[0], counts_L)
    y.backward(dy)
    return {"y": y.detach(), "x": leaves[0].grad, "w1": leaves[1].grad, "w2": leaves[2].grad, "w3": leaves[3].grad}


def fp8_run(x, dy, w, counts_L, wgrad_fp8=True):
    q, scale = ref.quantise_rows(x, ref.MIN_AMAX_ROWS)  # the rows as dispatch hands them
    leaves = [t.clone().requires_grad_(True) for t in w]
    carrier = torch.zeros((), dtype=torch.bfloat16, device=DEVICE, requires_grad=True).expand(x.shape)
    grads = {}
    carrier.register_hook(lambda g: grads.setdefault("x", g))
    y = fp8_experts.grouped_experts(*leaves, carrier, Fp8Rows(q, scale), counts_L, wgrad_fp8=wgrad_fp8)
    y.backward(dy)
    return {"y": y.detach(), "x": grads["x"], "w1": leaves[0].grad, "w2": leaves[1].grad, "w3": leaves[2].grad}


def errors(got, want, real, counts):
    live = [e for e, c in enumerate(counts) if c]
    out = {k: rel_l2(got[k][real], want[k][real]) for k in ("y", "x")}
    out.update({k: rel_l2(got[k][live], want[k][live]) for k in ("w1", "w2", "w3")})
    return out


@pytest.mark.parametrize("routing", list(COUNTS))
@pytest.mark.parametrize("wgrad_fp8", [True, False])
def test_flagship_shape_against_bf16(routing, wgrad_fp8):
    counts = COUNTS[routing]
    x, dy, w, counts_L, real = flagship_case(counts)
    got = fp8_run(x, dy, w, counts_L, wgrad_fp8)
    want = bf16_experts(x, dy, w, counts_L)
    err = errors(got, want, real, counts)
    print(f"{routing}, wgrad {'fp8' if wgrad_fp8 else 'bf16'}: relative L2 against bf16 "
          + ", ".join(f"{k} {v:.4f}" for k, v in err.items()))
    assert all(v <= TOLERANCE for v in err.values()), err
    for k in ("w1", "w2", "w3"):
        assert torch.isfinite(got[k]).all()
        for e, c in enumerate(counts):
            if not c:
                assert torch.equal(got[k][e], torch.zeros_like(got[k][e])), f"{k}: empty expert {e}"


@pytest.mark.parametrize("routing", list(COUNTS))
def test_flagship_shape_against_the_emulation(routing, monkeypatch):
    """The same FP8 maths with every kernel and GEMM replaced by fp8_reference on the GPU."""
    counts = COUNTS[routing]
    x, dy, w, counts_L, real = flagship_case(counts)
    got = fp8_run(x, dy, w, counts_L)
    monkeypatch.setattr(fp8, "quantise_grad_rows", ref.quantise_grad_rows)
    monkeypatch.setattr(fp8, "gate", lambda h13, offsets: ref.gate(h13))
    monkeypatch.setattr(fp8, "gate_backward", ref.gate_backward)
    monkeypatch.setattr(fp8, "weights", ref.weights)
    monkeypatch.setattr(fp8, "weights_transposed", ref.weights_transposed)
    monkeypatch.setattr(fp8, "group_columns", ref.group_columns)
    monkeypatch.setattr(fp8, "transpose_rows", ref.transpose_rows)
    monkeypatch.setattr(fp8, "scaled_grouped_mm", ref.scaled_grouped_mm)
    want = fp8_run(x, dy, w, counts_L)
    err = errors(got, want, real, counts)
    print(f"{routing}: relative L2 against the emulation " + ", ".join(f"{k} {v:.4f}" for k, v in err.items()))
    assert all(v <= EMULATION_TOLERANCE for v in err.values()), err


@pytest.mark.parametrize("routing", list(COUNTS))
def test_the_weight_cache_at_the_flagship_shape(routing):
    """Two microbatches, an optimizer step, one more, with and without the WeightCache: the
    weights quantised once per step, and the outputs and gradients bit for bit the same (the same
    kernels on the same operands: the cache only keeps what they made). The GEMMs are not
    deterministic across calls in general; these are, for the same operands, on one stream."""
    counts = COUNTS[routing]
    x, dy, w, counts_L, _ = flagship_case(counts)
    q, scale = ref.quantise_rows(x, ref.MIN_AMAX_ROWS)
    used = int(counts_L.sum())  # rows past the last expert's segment are never written
    runs = {}
    for cached in (False, True):
        leaves = [t.clone().float().requires_grad_(True) for t in w]
        opt = torch.optim.SGD(leaves, lr=1e-3)
        cache = fp8_experts.WeightCache() if cached else None
        out = []
        for mb in range(3):
            carrier = torch.zeros((), dtype=torch.bfloat16, device=DEVICE, requires_grad=True).expand(x.shape)
            y = fp8_experts.grouped_experts(*leaves, carrier, Fp8Rows(q, scale), counts_L, cache=cache)
            y.backward(dy)
            out.append(y.detach()[:used])
            if mb == 1:
                out += [t.grad.clone() for t in leaves]
                opt.step()
                opt.zero_grad()
        out += [t.grad.clone() for t in leaves]
        runs[cached] = (out, cache.made if cache else None)
    assert runs[True][1] == {"forward": 2, "transposed": 4}
    for i, (got, want) in enumerate(zip(runs[True][0], runs[False][0])):
        assert torch.equal(got, want), i


def test_the_weight_cache_makes_whole_weights_ahead_on_its_own_stream(monkeypatch):
    """The one-GPU recipe's cache: given the weights, it makes both copies at each optimizer step
    on a stream of its own. Three steps (forward, backward, a fused AdamW step as TorchTitan's) give the uncached run's
    outputs and gradients bit for bit. Both waits are provoked: the optimizer's step is queued
    behind 20 ms of sleep on the main stream (copies made without waiting for it would be of the
    old weights), and each making starts with 20 ms of sleep on the cache's stream (a forward
    that did not wait for it would read copies not yet written)."""
    x, dy, w, counts_L, _ = flagship_case(COUNTS["skewed"])
    q, scale = ref.quantise_rows(x, ref.MIN_AMAX_ROWS)
    used = int(counts_L.sum())
    cycles = int(torch.cuda.get_device_properties(DEVICE).clock_rate * 20)  # kHz x 20 ms
    quantise = fp8.weights

    def slow_weights(*args):
        torch.cuda._sleep(cycles)
        return quantise(*args)

    runs = {}
    for ahead in (False, True):
        leaves = [t.clone().float().requires_grad_(True) for t in w]
        opt = torch.optim.AdamW(leaves, lr=1e-3, fused=True)  # TorchTitan's: no version bumps
        cache = fp8_experts.WeightCache(lambda: tuple(leaves)) if ahead else None
        out = []
        for step in range(3):
            carrier = torch.zeros((), dtype=torch.bfloat16, device=DEVICE, requires_grad=True).expand(x.shape)
            y = fp8_experts.grouped_experts(*leaves, carrier, Fp8Rows(q, scale), counts_L, cache=cache)
            y.backward(dy)
            out += [y.detach()[:used]] + [t.grad.clone() for t in leaves]
            torch.cuda._sleep(cycles)
            if ahead:
                monkeypatch.setattr(fp8, "weights", slow_weights)
            opt.step()
            monkeypatch.setattr(fp8, "weights", quantise)
            opt.zero_grad()
        torch.cuda.synchronize()
        runs[ahead] = (out, cache.made if cache else None)
    assert runs[True][1] == {"forward": 4, "transposed": 8}  # the first step's, then one making per step
    for i, (got, want) in enumerate(zip(runs[True][0], runs[False][0])):
        assert torch.equal(got, want), i


def test_the_backward_waits_for_the_work_beside_its_gemms(monkeypatch):
    """The wgrad operands' transposes and the fp32 weight gradients' widening run on a stream
    beside the grouped GEMMs. With each of them delayed by 20 ms of sleep on that stream, the
    output and the weight gradients (read on the main stream right after the backward) equal
    those of the same backward with everything on the main stream, bit for bit: the wgrad GEMMs
    and the gradients' readers waited. The delayed run goes first, on memory filled with NaN, so
    that a read too early cannot find the right values left there."""
    x, dy, w, counts_L, _ = flagship_case(COUNTS["skewed"])
    q, scale = ref.quantise_rows(x, ref.MIN_AMAX_ROWS)
    used = int(counts_L.sum())
    cycles = int(torch.cuda.get_device_properties(DEVICE).clock_rate * 20)  # kHz x 20 ms
    main = torch.cuda.current_stream()
    delayed = []

    def slow(kernel):
        def call(*args):
            if torch.cuda.current_stream() != main:
                torch.cuda._sleep(cycles)
                delayed.append(kernel.__name__)
            return kernel(*args)
        return call

    def run(beside_gemms):
        leaves = [t.clone().float().requires_grad_(True) for t in w]
        carrier = torch.zeros((), dtype=torch.bfloat16, device=DEVICE, requires_grad=True).expand(x.shape)
        y = fp8_experts.grouped_experts(*leaves, carrier, Fp8Rows(q, scale), counts_L, beside_gemms=beside_gemms)
        y.backward(dy)
        return [y.detach()[:used].clone()] + [t.grad.clone() for t in leaves]

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    junk = torch.full((torch.cuda.mem_get_info()[0] // 8,), float("nan"), device=DEVICE)
    del junk
    for name in ("group_columns", "transpose_rows", "widen"):
        monkeypatch.setattr(fp8, name, slow(getattr(fp8, name)))
    beside = run(True)
    monkeypatch.undo()
    # dy's, x's and dh13's transposes (h's runs on the main stream); the three widenings
    assert sorted(set(delayed)) == ["group_columns", "transpose_rows", "widen"] and len(delayed) == 6, delayed
    in_line = run(False)
    torch.cuda.synchronize()
    for i, (got, want) in enumerate(zip(beside, in_line)):
        assert torch.equal(got, want), i


def test_the_weight_cache_reserves_nothing_more_step_after_step():
    """The copies in the cache's own pool: 12 steps of a miss (the weights changed), a forward,
    a backward and activation-sized allocations in between, and the allocator's reserve stays
    where it was after the second step (in the shared pool it grew by the copies' size each step
    in the one-GPU recipe under AC, run 29)."""
    x, dy, w, counts_L, _ = flagship_case(COUNTS["balanced"])
    q, scale = ref.quantise_rows(x, ref.MIN_AMAX_ROWS)
    leaves = [t.clone().float().requires_grad_(True) for t in w]
    cache = fp8_experts.WeightCache()
    reserved = []
    for step in range(12):
        for t in leaves:
            torch.autograd.graph.increment_version(t)
        carrier = torch.zeros((), dtype=torch.bfloat16, device=DEVICE, requires_grad=True).expand(x.shape)
        y = fp8_experts.grouped_experts(*leaves, carrier, Fp8Rows(q, scale), counts_L, cache=cache)
        activations = [torch.empty(96 << 20, dtype=torch.uint8, device=DEVICE) for _ in range(4)]
        y.backward(dy)
        del y, activations[::2]
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    assert cache.made["forward"] == 12
    assert reserved[-1] <= reserved[1], [r >> 20 for r in reserved]
