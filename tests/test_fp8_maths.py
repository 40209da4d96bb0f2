"""The FP8 maths of csrc/ (moe_comm/kernels/fp8_reference.py, which the GPU cases hold the
kernels to bit for bit) against references written here from the definitions, in numpy with
e4m3 rounding from a table of its 255 finite values: scales per row, per 128-channel group, per
weight row, per (expert, channel) over the expert's rows; dgrad's folded weight scales; the layouts the scaled
grouped GEMM takes; and the GEMM emulation against torch's own bf16 grouped GEMM."""

import numpy as np
import pytest
import torch

from moe_comm.kernels import fp8_reference as ref

F32 = np.float32


def _e4m3_table() -> np.ndarray:
    """Every non-negative finite e4m3fn value, by code 0..126 (0x7f is NaN)."""
    values = []
    for code in range(127):
        exp, man = code >> 3, code & 7
        values.append(man / 8 * 2.0 ** -6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return np.array(values)


TABLE = _e4m3_table()


def e4m3(x: np.ndarray) -> np.ndarray:
    """Round to the nearest e4m3 value, ties to the even code, saturating at 448."""
    mag = np.minimum(np.abs(x.astype(np.float64)), 448.0)
    hi = np.clip(np.searchsorted(TABLE, mag), 1, 126)
    lo = hi - 1
    d_lo, d_hi = mag - TABLE[lo], TABLE[hi] - mag
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(mag <= 0, 0, code)
    return np.sign(x) * TABLE[code]


def scale_of(amax: np.ndarray, floor: float) -> np.ndarray:
    """amax / 448 in float32, as the kernels divide."""
    return (np.maximum(amax.astype(F32), F32(floor)) / F32(448)).astype(F32)


def quantised(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x times the scale's float32 reciprocal, in float32, rounded to e4m3: as the kernels apply it."""
    inverse = (F32(1) / scale.astype(F32)).astype(F32)
    return e4m3((x.astype(F32) * inverse).astype(F32))


def bf16(shape, seed, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def test_the_table_is_torchs_cast():
    x = torch.randn(20000) * 100
    x = torch.cat([x, torch.tensor([0.0, 448.0, -448.0, 2.0 ** -9, 0.0009765625, 17.0, 18.0, 19.0])])
    assert np.array_equal(x.to(ref.FP8).double().numpy(), e4m3(x.numpy()))


def test_rows_one_scale_per_row():
    x = bf16((37, 96), 1)
    x[3] = 0  # an all-zero row keeps a finite scale
    x[5] *= 1e-8  # a gradient-sized row keeps e4m3's range under the small floor
    for floor in (ref.MIN_AMAX_ROWS, ref.MIN_AMAX_SMALL):
        q, scale = ref.quantise_rows(x, floor)
        xf = x.float().numpy()
        want_scale = scale_of(np.abs(xf).max(axis=1), floor)
        assert np.array_equal(scale.numpy(), want_scale)
        assert np.array_equal(q.double().numpy(), quantised(xf, want_scale[:, None]))
    q, scale = ref.quantise_rows(x, ref.MIN_AMAX_SMALL)
    assert q.float()[5].abs().max() == 448  # the row's own amax maps onto e4m3's largest value
    assert torch.equal(q.float()[3], torch.zeros(96))


def test_wire_groups_of_128_channels():
    x = bf16((9, 384), 2)
    x[:, 130] = 40.0  # an outlier channel moves its own group's scale only
    got = ref.wire_round_trip(x, ref.MIN_AMAX_ROWS).float().numpy()
    xf = x.float().numpy().reshape(9, 3, 128)
    s = scale_of(np.abs(xf).max(axis=2), ref.MIN_AMAX_ROWS)[:, :, None]
    want = (quantised(xf, s) * s).astype(F32).reshape(9, 384)
    assert np.array_equal(got, torch.from_numpy(want).to(torch.bfloat16).float().numpy())


def test_wire_round_trip_matches_the_gpu_oracle():
    from moe_comm.kernels.fp8_format import round_trip  # FP8 dispatch's oracle, written apart

    x = bf16((16, 256), 3)
    assert torch.equal(ref.wire_round_trip(x, ref.MIN_AMAX_ROWS), round_trip(x))


def test_gate_forward_and_backward():
    rows, inter = 24, 48
    h13 = bf16((rows, 2 * inter), 4, scale=3.0)
    dh = bf16((rows, inter), 5)
    q, scale = ref.gate(h13)
    h1, h3 = h13.double().chunk(2, dim=1)
    h = h1 * torch.sigmoid(h1) * h3
    assert torch.allclose(q.double() * scale.double()[:, None], h, rtol=2 ** -3, atol=scale.max().item() * 2 ** -9)
    # silu in fp32 (ours) and float64 (here) differ in the last bits: the scales to within them
    assert np.allclose(scale.numpy(), scale_of(h.abs().amax(dim=1).numpy(), ref.MIN_AMAX_SMALL), rtol=1e-6)

    # the backward's formulas against autograd of the forward
    leaf = h13.double().requires_grad_(True)
    a, b = leaf.chunk(2, dim=1)
    (a * torch.sigmoid(a) * b).backward(dh.double())
    q, scale, grad_h13, h_bf16, _ = ref.gate_backward(h13, dh, torch.tensor([h13.shape[0]], dtype=torch.int32))
    assert torch.allclose(grad_h13.double(), leaf.grad, rtol=1e-2, atol=1e-3)
    assert torch.allclose(h_bf16.double(), h, rtol=1e-2, atol=1e-3)
    assert torch.allclose(q.double() * scale.double()[:, None], leaf.grad, rtol=2 ** -3,
                          atol=scale.max().item() * 2 ** -9)


def test_weights_and_dgrads_transposed_codes():
    a = bf16((3, 32, 48), 6, scale=0.02)  # [experts, rows, cols], e.g. W1
    b = bf16((3, 16, 48), 7, scale=0.02)  # stacked after a (W3)
    q, scale = ref.weights(a, b)
    w = np.concatenate([a.float().numpy(), b.float().numpy()], axis=1)
    want_scale = scale_of(np.abs(w).max(axis=2), ref.MIN_AMAX_SMALL)
    assert q.shape == (3, 48, 48) and np.array_equal(scale.numpy(), want_scale)
    assert np.array_equal(q.double().numpy(), quantised(w, want_scale[:, :, None]))

    qt = ref.weights_transposed(q)  # dgrad's right operand: the same codes, K-major the other way
    assert qt.shape == (3, 48, 48) and qt.is_contiguous()
    assert np.array_equal(qt.view(torch.uint8).numpy(), q.view(torch.uint8).numpy().transpose(0, 2, 1))
    # fp32 parameters (world 1) holding the same values quantise the same
    q32, s32 = ref.weights(a.float(), b.float())
    assert torch.equal(q32.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s32, scale)


def test_dgrad_folds_the_weights_row_scales_into_its_rows():
    """dX = dY W with W = diag(s) Wq: dgrad quantises dY diag(s) rowwise (each row times its
    expert's s, in fp32, then one scale per row) against the transposed codes Wq^T; the same read
    takes dY's (expert, channel) amax as it is, for the weight gradient."""
    offsets = torch.tensor([16, 16, 48], dtype=torch.int32)  # expert 1 has no rows
    rows, channels = 56, 64  # 8 rows past the last expert
    x = bf16((rows, channels), 9)
    s = torch.rand(3, channels, generator=torch.Generator().manual_seed(10)) * 1e-3 + 1e-4
    q, scale, col_amax = ref.quantise_grad_rows(x, offsets, s)
    x32 = x.float().numpy()
    expert = np.array([0] * 16 + [2] * 32 + [-1] * 8)
    scaled = np.where(expert[:, None] >= 0, x32 * s.numpy()[np.maximum(expert, 0)], x32).astype(F32)
    want_scale = scale_of(np.abs(scaled).max(axis=1), ref.MIN_AMAX_SMALL)
    assert np.array_equal(scale.numpy(), want_scale)
    assert np.array_equal(q.double().numpy(), quantised(scaled, want_scale[:, None]))
    want_amax = np.stack([np.abs(x32[:16]).max(axis=0), np.zeros(channels), np.abs(x32[16:48]).max(axis=0)])
    assert np.array_equal(col_amax.numpy(), want_amax.astype(F32))

    # the gate's backward quantises dh13 the same way; its bf16 dh13 (the weight gradient's) is
    # times the input rows' scales instead, and its column amax is of [h | dh1 | dh3] as stored
    h13, dh = bf16((rows, 2 * channels), 11), bf16((rows, channels), 12, scale=1e-3)
    s13 = torch.rand(3, 2 * channels, generator=torch.Generator().manual_seed(13)) + 0.5
    row_scale = torch.rand(rows, generator=torch.Generator().manual_seed(14)) * 1e-2
    q, scale, grad_h13, h, col_amax = ref.gate_backward(h13, dh, offsets, s13, row_scale)
    plain = ref.gate_backward(h13, dh, offsets)
    assert torch.equal(h, plain[3])
    leaf = h13.double().requires_grad_(True)
    g1, g3 = leaf.chunk(2, dim=1)
    (g1 * torch.sigmoid(g1) * g3).backward(dh.double())
    assert torch.allclose(grad_h13.double(), leaf.grad * row_scale.double()[:, None], rtol=1e-2, atol=1e-9)
    want = leaf.grad * ref.per_row(s13, offsets, rows).double()
    assert torch.allclose(q.double() * scale.double()[:, None], want, rtol=2 ** -3, atol=scale.max().item() * 2 ** -9)
    assert not torch.allclose(q.double() * scale.double()[:, None], leaf.grad, rtol=2 ** -3,
                              atol=scale.max().item() * 2 ** -9)  # the scales did move it
    stored = torch.cat([h, grad_h13], dim=1).float().abs().numpy()
    want_amax = np.stack([stored[:16].max(axis=0), np.zeros(3 * channels), stored[16:48].max(axis=0)])
    assert np.array_equal(col_amax.numpy(), want_amax.astype(F32))


def test_group_columns_per_expert_and_channel():
    offsets = torch.tensor([16, 16, 48, 64], dtype=torch.int32)  # expert 1 has no rows
    rows, channels = 70, 64  # 6 rows past the last expert: never read
    x = bf16((rows, channels), 8)
    x[64:] = float("nan")
    col_amax = ref.column_amax(x, offsets)
    q, scale = ref.group_columns(x, col_amax, offsets, halves=2)
    assert q.shape == (64, 80) and scale.shape == (2, 4 * 32)
    xf = x.float().numpy()
    for g, (s, e) in enumerate([(0, 16), (16, 16), (16, 48), (48, 64)]):
        amax = np.abs(xf[s:e]).max(axis=0) if e > s else np.zeros(channels)
        assert np.array_equal(col_amax[g].numpy(), amax.astype(F32))
        want = scale_of(amax, ref.MIN_AMAX_SMALL)
        for c in range(channels):
            h, cc = divmod(c, 32)
            assert scale[h, g * 32 + cc].item() == want[c]
            assert np.array_equal(q[c, s:e].double().numpy(), quantised(xf[s:e, c], want[c]))
    assert torch.equal(q[:, 64:].float(), torch.zeros(64, 16))

    # e4m3 rows are transposed as they are (their row scales go into the other operand)
    xq, _ = ref.quantise_rows(x[:64])
    xq = torch.cat([xq, torch.full((6, channels), float("nan")).to(ref.FP8)])
    t = ref.transpose_rows(xq, offsets)
    assert t.shape == (64, 80)
    assert np.array_equal(t[:, :64].view(torch.uint8).numpy(), xq[:64].view(torch.uint8).numpy().T)
    assert torch.equal(t[:, 64:].float(), torch.zeros(64, 16))


def _power_of_two_scales(n, seed):
    g = torch.Generator().manual_seed(seed)
    return 2.0 ** torch.randint(-6, 3, (n,), generator=g).float()


def test_scaled_grouped_mm_groups_rows_as_torch_does():
    """2D x 3D: with power-of-two scales every dequantised value is exact in bf16, so torch's bf16
    grouped GEMM on the dequantised operands is an independent implementation of the same sums."""
    offsets = torch.tensor([16, 16, 48], dtype=torch.int32)
    a = bf16((48, 32), 9).to(ref.FP8)
    b = bf16((3, 32, 24), 10).to(ref.FP8)  # [L, K, N]
    sa, sb = _power_of_two_scales(48, 11), _power_of_two_scales(3 * 24, 12).view(3, 24)
    got = ref.scaled_grouped_mm(a, b, sa, sb, offsets)
    a_deq = (a.float() * sa[:, None]).to(torch.bfloat16)
    b_deq = (b.float() * sb[:, None, :]).to(torch.bfloat16)
    want = torch._grouped_mm(a_deq, b_deq, offs=offsets)
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert got[:16].abs().sum() > 0


def test_scaled_grouped_mm_groups_the_contraction_as_torch_does():
    """2D x 2D (the weight gradients): out[g] = A[:, rows of g] B[rows of g], scales group-major."""
    offsets = torch.tensor([16, 32, 32, 64], dtype=torch.int32)
    m, n = 24, 40
    a = bf16((m, 64), 13).to(ref.FP8)  # [M, rows]
    b = bf16((64, n), 14).to(ref.FP8)  # [rows, N]
    sa, sb = _power_of_two_scales(4 * m, 15), _power_of_two_scales(4 * n, 16)
    got = ref.scaled_grouped_mm(a, b, sa, sb, offsets)
    assert got.shape == (4, m, n) and torch.equal(got[2], torch.zeros(m, n, dtype=torch.bfloat16))
    for g, (s, e) in enumerate([(0, 16), (16, 32), (32, 32), (32, 64)]):
        lhs = a[:, s:e].double() * sa[g * m:(g + 1) * m, None].double()
        rhs = b[s:e].double() * sb[g * n:(g + 1) * n][None, :].double()
        assert torch.allclose(got[g].double(), lhs @ rhs, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("floor", [ref.MIN_AMAX_ROWS, ref.MIN_AMAX_SMALL])
def test_quantisation_error_stays_within_half_a_step(floor):
    """A row's values after the round trip: within e4m3's half step (2^-4 relative) wherever they
    are normal numbers after scaling, the property FP8's accuracy claims rest on."""
    x = bf16((64, 512), 17)
    q, scale = ref.quantise_rows(x, floor)
    back = q.double() * scale.double()[:, None]
    normal = (x.double() / scale.double()[:, None]).abs() >= 2 ** -6
    rel = ((back - x.double()).abs() / x.double().abs())[normal]
    assert rel.max().item() <= 2 ** -4 + 1e-9
