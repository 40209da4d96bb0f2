// The FP8 experts' own kernels ([moe_comm] expert_dtype = "fp8"): what quantises the grouped
// GEMMs' operands around torch._scaled_grouped_mm, fused with what sits between the GEMMs.
//
// Scales follow torch._scaled_grouped_mm's rowwise recipe on Hopper: one fp32 scale per row of
// the left operand, one per output channel of the right (per expert), each amax / 448 applied by
// division (common/vec.cuh), so moe_comm/kernels/fp8_reference.py reproduces them bit for bit.
// Rows are the expert-major rows dispatch lays out: expert e's segment ends at offsets[e] (the
// GEMM's `offs`), and rows past offsets[L - 1] (the unused tail of the receive capacity) are
// left untouched, as the GEMM never reads them. Local kernels: ordinary launches over the GPU.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe_comm {

// Row kernels: one block of kRowThreads per row, each thread holding up to kRowVecs vectors of
// 8 channels in registers, so a row is read once and its amax is a block reduction.
constexpr int kRowThreads = 256;
constexpr int kRowVecs = 4;
// The widest row the row kernels take (a model's hidden size, or its expert inter dim).
constexpr int kMaxRowChannels = kRowThreads * kRowVecs * 8;

// x [rows, channels] bf16 -> q e4m3 + one scale per row (the output gradient, for dgrad).
struct QuantiseRowsArgs {
  const void* x;
  const int32_t* offsets;  // [groups]: rows of expert e end at offsets[e]
  int groups, channels;
  uint8_t* q;
  float* scale;
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
// one scale per row (the dgrad GEMM's left operand), dh13 in bf16 and h in bf16 (the weight
// gradients').
struct GateBackwardArgs {
  const void* h13;
  const void* grad_h;
  const int32_t* offsets;
  int groups, inter;
  uint8_t* q;          // [rows, 2 inter]
  float* scale;        // [rows]
  void* grad_h13;      // [rows, 2 inter] bf16
  void* h;             // [rows, inter] bf16
};

// Weights [experts, rows_a + rows_b, cols], stacked from a [experts, rows_a, cols] and b (the
// gate and up projections make one GEMM), fp32 or bf16 -> e4m3 with one scale per row (the
// forward GEMM's output channels), and the amax of every column (atomically, over zeros) for
// the transposed copy the backward quantises.
struct WeightsArgs {
  const void* a;
  const void* b;  // null: rows_b == 0
  int experts, rows_a, rows_b, cols;
  bool fp32;
  uint8_t* q;        // [experts, rows, cols]
  float* scale;      // [experts, rows]
  float* col_amax;   // [experts, cols], zeroed by the caller
};

// The same weights transposed: [experts, cols, rows] e4m3 with one scale per column of the
// original (the dgrad GEMM's output channels), from the forward's column amax.
struct WeightsTransposedArgs {
  const void* a;
  const void* b;
  int experts, rows_a, rows_b, cols;
  bool fp32;
  const float* col_amax;
  uint8_t* q;        // [experts, cols, rows]
  float* scale;      // [experts, cols]
};

// The weight gradients' operands: x [rows, channels] (bf16, or e4m3 with row_scale) transposed
// to [channels, row_stride] e4m3 with one scale per (expert, channel) over the expert's rows:
// the K-major layout and token-wise scaling a 2D x 2D scaled grouped GEMM takes. `halves` 2
// splits the channels in two operands (dh1, dh3) whose scales are stored apart:
// scale[(h * groups + e) * (channels / halves) + c].
struct GroupColumnsArgs {
  const void* x;
  const float* row_scale;  // null: x is bf16
  const int32_t* offsets;
  int groups, channels, halves;
  int64_t row_stride;      // of q: the rows rounded up to 16
  uint8_t* q;              // [channels, row_stride]
  float* scale;            // [halves, groups, channels / halves]
};

void launch_quantise_rows(const QuantiseRowsArgs& a, int64_t rows, int sm_count, cudaStream_t stream);
void launch_gate(const GateArgs& a, int64_t rows, int sm_count, cudaStream_t stream);
void launch_gate_backward(const GateBackwardArgs& a, int64_t rows, int sm_count, cudaStream_t stream);
void launch_weights(const WeightsArgs& a, cudaStream_t stream);
void launch_weights_transposed(const WeightsTransposedArgs& a, cudaStream_t stream);
void launch_group_columns(const GroupColumnsArgs& a, cudaStream_t stream);

}  // namespace moe_comm
