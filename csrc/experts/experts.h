// The FP8 experts' own kernels ([moe_comm] expert_dtype = "fp8"): what quantises the grouped
// GEMMs' operands around torch._scaled_grouped_mm, fused with what sits between the GEMMs.
//
// Scales follow torch._scaled_grouped_mm's rowwise recipe on Hopper: one fp32 scale per row of
// the left operand, one per output channel of the right (per expert), each amax / 448 applied as
// a product with its reciprocal (common/vec.cuh), so moe_comm/kernels/fp8_reference.py reproduces
// them bit for bit.
// Rows are the expert-major rows dispatch lays out: expert e's segment ends at offsets[e] (the
// GEMM's `offs`), and rows past offsets[L - 1] (the unused tail of the receive capacity) are
// left untouched, as the GEMM never reads them. Local kernels: ordinary launches over the GPU.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe_comm {

// Row kernels: one block per row (rows.cuh's with_row_threads sizes it), each thread
// holding a few vectors of 8 channels in registers, so a row is read once and its amax is a block
// reduction. The weights' kernel holds kWeightVecs a thread: fp32 rows and nothing but the row in
// its loop, so each thread's loads in flight set its pace. The rows' kernels (quantise_rows, gate,
// gate_backward) hold kRowVecs: their per-expert shared arrays and the row's reduction stall them,
// and twice the warps on a row hid more of that (gate_backward 1.81 -> 1.24 ms at the one-GPU
// recipe's layer, 150 -> 103 registers; the weights' kernel went 1.18 -> 1.58 ms that way: run 43).
constexpr int kWeightVecs = 4;
constexpr int kRowVecs = 2;
// The transposing kernel's blocks (group_columns.cu).
constexpr int kTileThreads = 256;
// The widest row the row kernels take (a model's hidden size, or its expert inter dim).
constexpr int kMaxRowChannels = 8192;

// x [rows, channels] bf16 -> q e4m3 + one scale per row (the output gradient, for dgrad).
// channel_scale, where given, multiplies each row of expert e channel by channel before the
// quantisation: dgrad's weights are the forward's e4m3 codes transposed, and the forward's scale
// of each weight row (one per channel of this operand) moves onto this side of the GEMM.
// col_amax, where given, receives each (expert, channel)'s amax of x (the weight gradient's
// token-wise scales: GroupColumnsArgs).
struct QuantiseRowsArgs {
  const void* x;
  const int32_t* offsets;  // [groups]: rows of expert e end at offsets[e]
  const float* channel_scale;  // null, or [groups, channels]
  int groups, channels;
  uint8_t* q;
  float* scale;
  float* col_amax;  // null, or [groups, channels], zeroed by the caller
};

// The gate between the GEMMs: h = silu(h1) * h3 of h13 = [h1 | h3] [rows, 2 inter] bf16,
// quantised with one scale per row (the second GEMM's left operand).
struct GateArgs {
  const void* h13;
  const int32_t* offsets;
  int groups, inter;
  uint8_t* q;     // [rows, inter]
  float* scale;   // [rows]
};

// Its backward: from h13 and dh = dL/dh [rows, inter] bf16, dh13 = [dh1 | dh3] quantised with
// one scale per row (the dgrad GEMM's left operand; times channel_scale first, as in
// QuantiseRowsArgs), and the weight gradients' operands in bf16: dh13 times row_scale (the
// experts' input rows' e4m3 scales, so that their weight gradient takes the rows' codes as they
// are) and h, with each (expert, channel)'s amax of [h | dh1 | dh3] in col_amax.
struct GateBackwardArgs {
  const void* h13;
  const void* grad_h;
  const int32_t* offsets;
  const float* channel_scale;  // null, or [groups, 2 inter]
  const float* row_scale;      // null, or [rows]
  int groups, inter;
  uint8_t* q;          // [rows, 2 inter]
  float* scale;        // [rows]
  void* grad_h13;      // [rows, 2 inter] bf16
  void* h;             // [rows, inter] bf16
  float* col_amax;     // null, or [groups, 3 inter], zeroed by the caller
};

// Weights [experts, rows_a + rows_b, cols], stacked from a [experts, rows_a, cols] and b (the
// gate and up projections make one GEMM), fp32 or bf16 -> e4m3 with one scale per row (the
// forward GEMM's output channels). dgrad uses the same codes transposed (GroupColumnsArgs)
// with these scales folded into its left operand, so the parameters are read once.
struct WeightsArgs {
  const void* a;
  const void* b;  // null: rows_b == 0
  int experts, rows_a, rows_b, cols;
  bool fp32;
  uint8_t* q;        // [experts, rows, cols]
  float* scale;      // [experts, rows]
};

// The transposes (group_columns.cu): the weight gradients' operands, x [rows, channels] to
// [channels, row_stride] e4m3, the K-major layout a 2D x 2D scaled grouped GEMM takes for a
// contraction over the rows; and dgrad's weights, the forward's codes [experts, rows, cols] to
// [experts, cols, rows] (uniform_rows = rows: each expert's own matrix). bf16 x
// is quantised with one scale per (expert, channel) over the expert's rows, from the amax its
// producer took (quantise_rows.cu, gate_backward.cu): token-wise scaling, which rowwise scaling
// cannot give. e4m3 x (the experts' input rows) is transposed byte for byte: its row scales went
// into the other operand (gate_backward.cu). `halves` 2 splits the channels in two operands
// (dh1, dh3) whose scales are stored apart: scale[(h * groups + e) * (channels / halves) + c].
struct GroupColumnsArgs {
  const void* x;
  bool bytes;              // x is e4m3, copied as it is (col_amax and scale unused)
  const float* col_amax;   // [groups, channels] with rows amax_stride apart
  int64_t amax_stride;
  const int32_t* offsets;  // groups end at offsets[g] (uniform_rows 0)
  int64_t uniform_rows;    // 0, or every group has these rows and its own [channels, uniform_rows] in q
  int groups, channels, halves;
  int64_t row_stride;      // of q: the rows rounded up to 16 (uniform_rows: uniform_rows)
  uint8_t* q;              // [channels, row_stride]
  float* scale;            // [halves, groups, channels / halves]
};

// The weight gradients (bf16, from the wgrad GEMMs) widened to fp32 parameters' dtype: n values,
// a multiple of 4, both tensors 16-byte aligned.
struct WidenArgs {
  const void* x;  // bf16 [n]
  float* out;     // [n]
  int64_t n;
};
constexpr int kWidenThreads = 256;

void launch_quantise_rows(const QuantiseRowsArgs& a, int64_t rows, int sm_count, cudaStream_t stream);
void launch_gate(const GateArgs& a, int64_t rows, int sm_count, cudaStream_t stream);
void launch_gate_backward(const GateBackwardArgs& a, int64_t rows, int sm_count, cudaStream_t stream);
void launch_weights(const WeightsArgs& a, int sm_count, cudaStream_t stream);
void launch_group_columns(const GroupColumnsArgs& a, cudaStream_t stream);
void launch_widen(const WidenArgs& a, cudaStream_t stream);

}  // namespace moe_comm
