"""The FP8 experts' operations: csrc/experts' kernels (torch.ops.moe_comm.fp8_*) on CUDA tensors,
moe_comm.kernels.fp8_reference's pure-torch maths on CPU ones, and the grouped GEMMs between them.

On the GPU every GEMM is torch._scaled_grouped_mm (SM90 CUTLASS, rowwise scales: one fp32 scale
per row of the left operand, one per output channel of the right) with fast accumulation, as
torchao's float8 grouped GEMMs call it. On CPU (the tests) it is emulated by dequantise-then-matmul
(fp8_reference.scaled_grouped_mm): the same maths, so the autograd wiring runs end to end there.
The recipe checks keep training off the CPU path (moe_comm.titan.fp8_experts).

The fake (meta) kernels give every output's shape from the inputs alone.
"""

import torch

from moe_comm.kernels import fp8_reference as ref

FP8 = ref.FP8


def quantise_grad_rows(x_RC: torch.Tensor, offsets_L: torch.Tensor, channel_scale_LC: torch.Tensor | None = None):
    """The bf16 output gradient -> (e4m3 rows, one scale per row, each (expert, channel)'s amax
    [L, C]); each row of expert e times channel_scale_LC[e] before its quantisation, where given;
    rows past offsets[-1] left as they are (fp8_reference.quantise_grad_rows)."""
    if x_RC.is_cuda:
        return torch.ops.moe_comm.fp8_quantise_rows(x_RC, offsets_L, channel_scale_LC)
    return ref.quantise_grad_rows(x_RC, offsets_L, channel_scale_LC)


def gate(h13_RI2: torch.Tensor, offsets_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(h1) * h3 quantised rowwise."""
    if h13_RI2.is_cuda:
        return torch.ops.moe_comm.fp8_gate(h13_RI2, offsets_L)
    return ref.gate(h13_RI2)


def gate_backward(h13_RI2: torch.Tensor, grad_h_RI: torch.Tensor, offsets_L: torch.Tensor,
                  channel_scale_LC: torch.Tensor | None = None, row_scale_R: torch.Tensor | None = None):
    """(dh13 in e4m3, its row scales, dh13 in bf16, h in bf16, the columns' amax [L, 3I] of
    [h | dh1 | dh3]): fp8_reference.gate_backward."""
    if h13_RI2.is_cuda:
        return torch.ops.moe_comm.fp8_gate_backward(h13_RI2, grad_h_RI, offsets_L, channel_scale_LC, row_scale_R)
    return ref.gate_backward(h13_RI2, grad_h_RI, offsets_L, channel_scale_LC, row_scale_R)


def weights(a_LNK: torch.Tensor, b_LNK: torch.Tensor | None = None):
    """(e4m3 [L, N, K], one scale per row [L, N])."""
    if a_LNK.is_cuda:
        return torch.ops.moe_comm.fp8_weights(a_LNK, b_LNK)
    return ref.weights(a_LNK, b_LNK)


def weights_transposed(q_LNK: torch.Tensor) -> torch.Tensor:
    """The forward's e4m3 weights transposed, [L, K, N] (fp8_reference.weights_transposed)."""
    if q_LNK.is_cuda:
        return torch.ops.moe_comm.fp8_weights_transposed(q_LNK)
    return ref.weights_transposed(q_LNK)


def group_columns(x_RC: torch.Tensor, col_amax_LC: torch.Tensor, offsets_L: torch.Tensor, halves: int = 1):
    """(e4m3 [C, rows rounded up to 16], scales [halves, L * C / halves]): bf16 rows token-wise per
    expert, from their producer's column amax."""
    if x_RC.is_cuda:
        return torch.ops.moe_comm.fp8_group_columns(x_RC, col_amax_LC, offsets_L, halves)
    return ref.group_columns(x_RC, col_amax_LC, offsets_L, halves)


def transpose_rows(x_RC: torch.Tensor, offsets_L: torch.Tensor) -> torch.Tensor:
    """e4m3 rows -> [C, rows rounded up to 16], byte for byte."""
    if x_RC.is_cuda:
        return torch.ops.moe_comm.fp8_transpose_rows(x_RC, offsets_L)
    return ref.transpose_rows(x_RC, offsets_L)


def widen(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A bf16 weight gradient into `out`, float32 of x's shape (the dtype of the parameters at
    world 1; csrc/experts/widen.cu says why this is not autograd's own cast). The caller allocates
    out, on the stream that will read it."""
    if x.is_cuda:
        torch.ops.moe_comm.fp8_widen(x.contiguous(), out)
    else:
        out.copy_(x)
    return out


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offsets_L: torch.Tensor) -> torch.Tensor:
    """e4m3 a x e4m3 b with rowwise scales, bf16 out (fp8_reference.scaled_grouped_mm's shapes)."""
    if a.is_cuda:
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offsets_L, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)
    return ref.scaled_grouped_mm(a, b, scale_a, scale_b, offsets_L)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets_L: torch.Tensor) -> torch.Tensor:
    """bf16 a x bf16 b grouped as torch._grouped_mm groups them: the bf16 weight gradients the
    layer benchmark compares FP8 wgrad with."""
    return torch._grouped_mm(a, b, offs=offsets_L)


def register_fakes() -> None:
    """Fake kernels of the fp8_* ops, once their schemas exist (moe_comm.kernels.ops calls it
    after loading the CUDA library)."""

    def f32(like, *size):
        return torch.empty(*size, dtype=torch.float32, device=like.device)

    @torch.library.register_fake("moe_comm::fp8_quantise_rows")
    def _quantise_rows(x, offsets, channel_scale):
        return torch.empty_like(x, dtype=FP8), f32(x, x.shape[0]), f32(x, offsets.shape[0], x.shape[1])

    @torch.library.register_fake("moe_comm::fp8_gate")
    def _gate(h13, offsets):
        return h13.new_empty(h13.shape[0], h13.shape[1] // 2, dtype=FP8), f32(h13, h13.shape[0])

    @torch.library.register_fake("moe_comm::fp8_gate_backward")
    def _gate_backward(h13, grad_h, offsets, channel_scale, row_scale):
        return (torch.empty_like(h13, dtype=FP8), f32(h13, h13.shape[0]), torch.empty_like(h13),
                torch.empty_like(grad_h), f32(h13, offsets.shape[0], 3 * grad_h.shape[1]))

    @torch.library.register_fake("moe_comm::fp8_weights")
    def _weights(a, b):
        rows = a.shape[1] + (b.shape[1] if b is not None else 0)
        return a.new_empty(a.shape[0], rows, a.shape[2], dtype=FP8), f32(a, a.shape[0], rows)

    @torch.library.register_fake("moe_comm::fp8_weights_transposed")
    def _weights_transposed(q):
        return q.new_empty(q.shape[0], q.shape[2], q.shape[1])

    @torch.library.register_fake("moe_comm::fp8_group_columns")
    def _group_columns(x, col_amax, offsets, halves):
        rows, channels = x.shape
        return (x.new_empty(channels, (rows + 15) // 16 * 16, dtype=FP8),
                f32(x, halves, offsets.shape[0] * (channels // halves)))

    @torch.library.register_fake("moe_comm::fp8_widen")
    def _widen(x, out):
        return None

    @torch.library.register_fake("moe_comm::fp8_transpose_rows")
    def _transpose_rows(x, offsets):
        rows, channels = x.shape
        return x.new_empty(channels, (rows + 15) // 16 * 16)
