"""The FP8 maths of csrc/ in pure torch: the specification its kernels are checked against on the
GPU, and what the FP8 experts run on CPU tensors (tests) with the grouped GEMM emulated.

Every quantiser in csrc/ works one way (csrc/common/vec.cuh): over a group of values,
scale = max(amax, floor) / 448 in fp32, q = x * (1 / scale) rounded to the nearest e4m3
(|q| <= 448; the reciprocal and the product each correctly rounded), and the value q stands for
is q * scale. A group is a row (one fp32 scale per row: the FP8
experts' operands), 128 channels of a row (FP8 dispatch's wire), a weight row per expert, or
one channel over one expert's rows (the weight gradients' operands). The floor is
1e-4 for activation rows (FP8 dispatch's, kept so its wire stays as it was) and 1e-30 for
gradients and the experts' own operands, whose values are often far below 1e-4.

Where a kernel only quantises, it equals these functions bit for bit (float32 division,
multiplication and round-to-nearest-even casts are exact in both). Where it also computes (the
SiLU gate and its backward: the hardware's exp2 and reciprocal against torch's sigmoid), the two
agree to rounding.
"""

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX_ROWS = 1e-4  # csrc/common/vec.cuh kFp8MinAmax
MIN_AMAX_SMALL = 1e-30  # kFp8MinAmaxSmall
WIRE_GROUP = 128  # channels per scale on an FP8 wire (kFp8GroupChannels)


def divided(a: torch.Tensor, b: float) -> torch.Tensor:
    """a / b correctly rounded, as the kernels divide, on every device. torch computes a CUDA
    tensor over a Python number as a * (1 / b), rounding the reciprocal first (ATen's
    div_true_kernel_cuda), which is one ulp off for b = 448 (seen on one H200: 328 of 720 row
    scales differed); a tensor divisor takes the true division."""
    return a / torch.full((), b, dtype=a.dtype, device=a.device)


def inverse_scale(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale correctly rounded (a tensor divisor: `divided` says why), what the kernels
    multiply a group's values by (csrc/common/vec.cuh fp8_inverse_scale)."""
    return torch.ones_like(scale) / scale


def quantise(x32: torch.Tensor, amax: torch.Tensor, min_amax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x32 in e4m3 with scale max(amax, min_amax) / 448 (amax broadcast over its group)."""
    scale = divided(amax.clamp(min=min_amax), FP8_MAX)
    return (x32 * inverse_scale(scale)).to(FP8), scale


def quantise_rows(x_RC: torch.Tensor, min_amax: float = MIN_AMAX_SMALL) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows in e4m3 with one fp32 scale per row: (q_RC, scale_R)."""
    x32 = x_RC.float()
    q, scale = quantise(x32, x32.abs().amax(dim=1, keepdim=True), min_amax)
    return q, scale.squeeze(1)


def per_row(channel_scale_LC: torch.Tensor, offsets_L: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, C] fp32: row r's expert's channel_scale row, ones past the last expert's segment."""
    out = torch.ones(rows, channel_scale_LC.shape[1], dtype=torch.float32, device=channel_scale_LC.device)
    for g, (start, end) in enumerate(segments(offsets_L)):
        out[start:end] = channel_scale_LC[g]
    return out


def column_amax(x_RC: torch.Tensor, offsets_L: torch.Tensor) -> torch.Tensor:
    """[L, C] fp32: each (expert, channel)'s amax over the expert's rows (0 for an expert without)."""
    x32 = x_RC.float().abs()
    out = torch.zeros(len(offsets_L), x_RC.shape[1], dtype=torch.float32, device=x_RC.device)
    for g, (start, end) in enumerate(segments(offsets_L)):
        if end > start:
            out[g] = x32[start:end].amax(dim=0)
    return out


def quantise_grad_rows(x_RC: torch.Tensor, offsets_L: torch.Tensor, channel_scale_LC: torch.Tensor | None = None):
    """dgrad's left operand from the bf16 output gradient: each row times its expert's channel
    scales (where given: the forward's weight row scales, see `weights_transposed`; in fp32, one
    rounding), then rowwise e4m3; and the weight gradient's column amax of the rows as they are:
    (q_RC, scale_R, col_amax_LC)."""
    x32 = x_RC.float()
    if channel_scale_LC is not None:
        x32 = x32 * per_row(channel_scale_LC, offsets_L, x_RC.shape[0])
    q, scale = quantise_rows(x32)
    return q, scale, column_amax(x_RC, offsets_L)


def dequantise_rows(q_RC: torch.Tensor, scale_R: torch.Tensor) -> torch.Tensor:
    """What rowwise e4m3 rows stand for, in fp32."""
    return q_RC.float() * scale_R[:, None]


def wire_round_trip(x_TD: torch.Tensor, min_amax: float) -> torch.Tensor:
    """bf16 rows through an FP8 wire (one scale per 128 channels) and back to bf16, as the
    receiver's layout kernel dequantises them."""
    t, d = x_TD.shape
    x32 = x_TD.float().view(t, d // WIRE_GROUP, WIRE_GROUP)
    q, scale = quantise(x32, x32.abs().amax(dim=2, keepdim=True), min_amax)
    return (q.float() * scale).view(t, d).to(torch.bfloat16)


def gate(h13_RI2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h = silu(h1) * h3 in fp32 for h13 = [h1 | h3], quantised rowwise: (q_RI, scale_R)."""
    h1, h3 = h13_RI2.float().chunk(2, dim=1)
    return quantise_rows(h1 * torch.sigmoid(h1) * h3)


def gate_backward(h13_RI2: torch.Tensor, grad_h_RI: torch.Tensor, offsets_L: torch.Tensor,
                  channel_scale_LC: torch.Tensor | None = None, row_scale_R: torch.Tensor | None = None):
    """The gate's backward: (dh13 quantised rowwise, its scales, dh13 in bf16, h in bf16, the
    columns' amax [L, 3I] of [h | dh1 | dh3] as stored). The quantised dh13 is times its expert's
    channel_scale first, where given (dgrad's folded weight scales); the bf16 dh13 is times the
    row's row_scale, where given (the e4m3 input rows' scales, which their weight gradient then
    does not apply)."""
    h1, h3 = h13_RI2.float().chunk(2, dim=1)
    g = grad_h_RI.float()
    s = torch.sigmoid(h1)
    act = h1 * s
    grad_h13 = torch.cat([g * h3 * s * (1 + h1 * (1 - s)), g * act], dim=1)
    rows = h13_RI2.shape[0]
    scaled = grad_h13 if channel_scale_LC is None else grad_h13 * per_row(channel_scale_LC, offsets_L, rows)
    q, scale = quantise_rows(scaled)
    wgrad_h13 = (grad_h13 if row_scale_R is None else grad_h13 * row_scale_R[:, None]).to(torch.bfloat16)
    h = (act * h3).to(torch.bfloat16)
    return q, scale, wgrad_h13, h, column_amax(torch.cat([h, wgrad_h13], dim=1), offsets_L)


def _stacked(a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return (a if b is None else torch.cat([a, b], dim=1)).float()


def weights(a_LNK: torch.Tensor, b_LNK: torch.Tensor | None = None):
    """Weights [L, N, K] (a, then b, stacked along N) in e4m3 with one scale per row (output
    channel): (q_LNK, scale_LN)."""
    w = _stacked(a_LNK, b_LNK)
    q, scale = quantise(w, w.abs().amax(dim=2, keepdim=True), MIN_AMAX_SMALL)
    return q, scale.squeeze(2)


def weights_transposed(q_LNK: torch.Tensor) -> torch.Tensor:
    """dgrad's right operand: the forward's codes transposed, [L, K, N], byte for byte. It stands
    for W / scale_LN, so dgrad multiplies its left operand's channels by scale_LN first
    (quantise_rows_scaled, gate_backward's channel_scale): dX = (dY diag(s)) Wq."""
    return q_LNK.transpose(1, 2).contiguous()


def segments(offsets_L: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each expert's rows from the grouped GEMM's cumulative offsets."""
    ends = offsets_L.tolist()
    return list(zip([0] + ends[:-1], ends))


def group_columns(x_RC: torch.Tensor, col_amax_LC: torch.Tensor, offsets_L: torch.Tensor, halves: int = 1):
    """bf16 x transposed to [C, rows rounded up to 16] e4m3, one scale per (expert, channel) from
    the expert's column amax (`column_amax` of x, as its producer took it): (q_CR, scale [halves,
    L * C/halves]). Columns past the last expert's rows are zero (the kernel leaves them)."""
    x32 = x_RC.float()
    rows, channels = x32.shape
    per_half = channels // halves
    q = torch.zeros(channels, (rows + 15) // 16 * 16, dtype=FP8, device=x_RC.device)
    scale = torch.empty(halves, len(offsets_L), per_half, dtype=torch.float32, device=x_RC.device)
    for g, (start, end) in enumerate(segments(offsets_L)):
        q_seg, s = quantise(x32[start:end], col_amax_LC[g], MIN_AMAX_SMALL)
        q[:, start:end] = q_seg.t()
        scale[:, g] = s.view(halves, per_half)
    return q, scale.view(halves, -1)


def transpose_rows(x_RC: torch.Tensor, offsets_L: torch.Tensor) -> torch.Tensor:
    """e4m3 rows transposed byte for byte to [C, rows rounded up to 16] (the weight gradient's
    operand of the experts' input rows, whose row scales went into the other operand); columns
    past the last expert's rows are zero."""
    rows, channels = x_RC.shape
    q = torch.zeros(channels, (rows + 15) // 16 * 16, dtype=FP8, device=x_RC.device)
    used = int(offsets_L[-1])
    q[:, :used] = x_RC[:used].t()
    return q


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offs: torch.Tensor) -> torch.Tensor:
    """What torch._scaled_grouped_mm computes (rowwise scales, bf16 out), as dequantise, then an
    fp32 matmul per group:
      a [R, K] x b [L, K, N] (rows grouped by offs): out [R, N], scale_a [R], scale_b [L, N];
      a [M, R] x b [R, N] (the contraction grouped by offs): out [L, M, N], scale_a [L * M],
      scale_b [L * N]. Rows past offs[-1] are zero here (undefined in torch's)."""
    spans = segments(offs)
    if b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.bfloat16, device=a.device)
        for g, (start, end) in enumerate(spans):
            lhs = a[start:end].float() * scale_a[start:end, None]
            out[start:end] = (lhs @ (b[g].float() * scale_b[g][None, :])).to(torch.bfloat16)
        return out
    m, n = a.shape[0], b.shape[1]
    out = torch.zeros(len(spans), m, n, dtype=torch.bfloat16, device=a.device)
    for g, (start, end) in enumerate(spans):
        lhs = a[:, start:end].float() * scale_a[g * m:(g + 1) * m, None]
        out[g] = (lhs @ (b[start:end].float() * scale_b[g * n:(g + 1) * n][None, :])).to(torch.bfloat16)
    return out
