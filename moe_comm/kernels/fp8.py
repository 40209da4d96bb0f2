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


def quantise_rows(x_RC: torch.Tensor, offsets_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows -> (e4m3 rows, one scale per row); rows past offsets[-1] left as they are."""
    if x_RC.is_cuda:
        return torch.ops.moe_comm.fp8_quantise_rows(x_RC, offsets_L)
    return ref.quantise_rows(x_RC)


def gate(h13_RI2: torch.Tensor, offsets_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(h1) * h3 quantised rowwise."""
    if h13_RI2.is_cuda:
        return torch.ops.moe_comm.fp8_gate(h13_RI2, offsets_L)
    return ref.gate(h13_RI2)


def gate_backward(h13_RI2: torch.Tensor, grad_h_RI: torch.Tensor, offsets_L: torch.Tensor):
    """(dh13 in e4m3, its row scales, dh13 in bf16, h in bf16)."""
    if h13_RI2.is_cuda:
        return torch.ops.moe_comm.fp8_gate_backward(h13_RI2, grad_h_RI, offsets_L)
    return ref.gate_backward(h13_RI2, grad_h_RI)


def weights(a_LNK: torch.Tensor, b_LNK: torch.Tensor | None = None):
    """(e4m3 [L, N, K], one scale per row [L, N], column amax [L, K])."""
    if a_LNK.is_cuda:
        return torch.ops.moe_comm.fp8_weights(a_LNK, b_LNK)
    return ref.weights(a_LNK, b_LNK)


def weights_transposed(a_LNK: torch.Tensor, b_LNK: torch.Tensor | None, col_amax_LK: torch.Tensor):
    """(e4m3 [L, K, N], one scale per column of the original [L, K])."""
    if a_LNK.is_cuda:
        return torch.ops.moe_comm.fp8_weights_transposed(a_LNK, b_LNK, col_amax_LK)
    return ref.weights_transposed(a_LNK, b_LNK, col_amax_LK)


def group_columns(x_RC: torch.Tensor, row_scale_R: torch.Tensor | None, offsets_L: torch.Tensor, halves: int = 1):
    """(e4m3 [C, rows rounded up to 16], scales [halves, L * C / halves]): token-wise per expert."""
    if x_RC.is_cuda:
        return torch.ops.moe_comm.fp8_group_columns(x_RC, row_scale_R, offsets_L, halves)
    return ref.group_columns(x_RC, row_scale_R, offsets_L, halves)


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
    def _quantise_rows(x, offsets):
        return torch.empty_like(x, dtype=FP8), f32(x, x.shape[0])

    @torch.library.register_fake("moe_comm::fp8_gate")
    def _gate(h13, offsets):
        return h13.new_empty(h13.shape[0], h13.shape[1] // 2, dtype=FP8), f32(h13, h13.shape[0])

    @torch.library.register_fake("moe_comm::fp8_gate_backward")
    def _gate_backward(h13, grad_h, offsets):
        return torch.empty_like(h13, dtype=FP8), f32(h13, h13.shape[0]), torch.empty_like(h13), torch.empty_like(grad_h)

    @torch.library.register_fake("moe_comm::fp8_weights")
    def _weights(a, b):
        rows = a.shape[1] + (b.shape[1] if b is not None else 0)
        return a.new_empty(a.shape[0], rows, a.shape[2], dtype=FP8), f32(a, a.shape[0], rows), f32(a, a.shape[0], a.shape[2])

    @torch.library.register_fake("moe_comm::fp8_weights_transposed")
    def _weights_transposed(a, b, col_amax):
        rows = a.shape[1] + (b.shape[1] if b is not None else 0)
        return a.new_empty(a.shape[0], a.shape[2], rows, dtype=FP8), f32(a, a.shape[0], a.shape[2])

    @torch.library.register_fake("moe_comm::fp8_group_columns")
    def _group_columns(x, row_scale, offsets, halves):
        rows, channels = x.shape
        return (x.new_empty(channels, (rows + 15) // 16 * 16, dtype=FP8),
                f32(x, halves, offsets.shape[0] * (channels // halves)))
