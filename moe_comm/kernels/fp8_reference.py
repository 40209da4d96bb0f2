"""The FP8 maths of csrc/ in pure torch: the specification its kernels are checked against on the
GPU, and what the FP8 experts run on CPU tensors (tests) with the grouped GEMM emulated.

Every quantiser in csrc/ works one way (csrc/common/vec.cuh): over a group of values,
scale = max(amax, floor) / 448 in fp32, q = x / scale rounded to the nearest e4m3 (|q| <= 448),
and the value q stands for is q * scale. A group is a row (one fp32 scale per row: the FP8
experts' operands), 128 channels of a row (FP8 dispatch's wire), a weight row or column per
expert, or one channel over one expert's rows (the weight gradients' operands). The floor is
1e-4 for activation rows (FP8 dispatch's, kept so its wire stays as it was) and 1e-30 for
gradients and the experts' own operands, whose values are often far below 1e-4.

Where a kernel only quantises, it equals these functions bit for bit (float32 division and
round-to-nearest-even casts are exact in both). Where it also computes (the SiLU gate and its
backward: CUDA's expf against torch's exp), the two agree to rounding.
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


def quantise(x32: torch.Tensor, amax: torch.Tensor, min_amax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x32 in e4m3 with scale max(amax, min_amax) / 448 (amax broadcast over its group)."""
    scale = divided(amax.clamp(min=min_amax), FP8_MAX)
    return (x32 / scale).to(FP8), scale


def quantise_rows(x_RC: torch.Tensor, min_amax: float = MIN_AMAX_SMALL) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows in e4m3 with one fp32 scale per row: (q_RC, scale_R)."""
    x32 = x_RC.float()
    q, scale = quantise(x32, x32.abs().amax(dim=1, keepdim=True), min_amax)
    return q, scale.squeeze(1)


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


def gate_backward(h13_RI2: torch.Tensor, grad_h_RI: torch.Tensor):
    """The gate's backward: (dh13 quantised rowwise, its scales, dh13 in bf16, h in bf16)."""
    h1, h3 = h13_RI2.float().chunk(2, dim=1)
    g = grad_h_RI.float()
    s = torch.sigmoid(h1)
    act = h1 * s
    grad_h13 = torch.cat([g * h3 * s * (1 + h1 * (1 - s)), g * act], dim=1)
    q, scale = quantise_rows(grad_h13)
    return q, scale, grad_h13.to(torch.bfloat16), (act * h3).to(torch.bfloat16)


def _stacked(a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return (a if b is None else torch.cat([a, b], dim=1)).float()


def weights(a_LNK: torch.Tensor, b_LNK: torch.Tensor | None = None):
    """Weights [L, N, K] (a, then b, stacked along N) in e4m3 with one scale per row (output
    channel), and every column's amax: (q_LNK, scale_LN, col_amax_LK)."""
    w = _stacked(a_LNK, b_LNK)
    q, scale = quantise(w, w.abs().amax(dim=2, keepdim=True), MIN_AMAX_SMALL)
    return q, scale.squeeze(2), w.abs().amax(dim=1)


def weights_transposed(a_LNK: torch.Tensor, b_LNK: torch.Tensor | None, col_amax_LK: torch.Tensor):
    """The same weights transposed, [L, K, N] e4m3, one scale per column of the original:
    (q_LKN, scale_LK)."""
    w = _stacked(a_LNK, b_LNK)
    q, scale = quantise(w, col_amax_LK[:, None, :], MIN_AMAX_SMALL)
    return q.transpose(1, 2).contiguous(), scale.squeeze(1)


def segments(offsets_L: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each expert's rows from the grouped GEMM's cumulative offsets."""
    ends = offsets_L.tolist()
    return list(zip([0] + ends[:-1], ends))


def group_columns(x_RC: torch.Tensor, row_scale_R: torch.Tensor | None, offsets_L: torch.Tensor, halves: int = 1):
    """x (bf16, or e4m3 with a scale per row) transposed to [C, rows rounded up to 16] e4m3,
    one scale per (expert, channel) over the expert's rows: (q_CR, scale [halves, L * C/halves]).
    Columns past the last expert's rows are zero (the kernel leaves them as they were)."""
    x32 = x_RC.float() if row_scale_R is None else dequantise_rows(x_RC, row_scale_R)
    rows, channels = x32.shape
    per_half = channels // halves
    q = torch.zeros(channels, (rows + 15) // 16 * 16, dtype=FP8, device=x_RC.device)
    scale = torch.empty(halves, len(offsets_L), per_half, dtype=torch.float32, device=x_RC.device)
    for g, (start, end) in enumerate(segments(offsets_L)):
        seg = x32[start:end]
        amax = seg.abs().amax(dim=0) if end > start else torch.zeros(channels, device=x_RC.device)
        q_seg, s = quantise(seg, amax, MIN_AMAX_SMALL)
        q[:, start:end] = q_seg.t()
        scale[:, g] = s.view(halves, per_half)
    return q, scale.view(halves, -1)


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
