// Weights for the forward GEMMs: [experts, rows, cols] (fp32 parameters at world 1, bf16 under
// FSDP) to e4m3 with one scale per row (a row of W1/W3 or W2 is one output channel of its GEMM),
// once per forward call, straight from the parameters. The same pass takes each column's amax,
// which the backward's transposed copy (weights_transposed.cu) scales by, so that copy needs
// one pass too.
//
// A block takes kWeightRows rows of one expert; each thread keeps its columns' running amax in
// registers over those rows and adds them to col_amax with one atomicMax each (non-negative
// floats order as their bits do).
#include <cuda_bf16.h>

#include "common/launch.h"
#include "experts/rows.cuh"

namespace moe_comm {

constexpr int kWeightRows = 64;  // 512 blocks for the flagship rank's W1|W3, 896 for its W2

__global__ void __launch_bounds__(kRowThreads) weights_kernel(const WeightsArgs a) {
  __shared__ float scratch[kRowThreads / kWarpSize];
  const int e = blockIdx.y, rows = a.rows_a + a.rows_b, vecs = a.cols / 8;
  const int first = blockIdx.x * kWeightRows, last = min(rows, first + kWeightRows);
  float col[kRowVecs][8] = {};
  for (int n = first; n < last; ++n) {
    const bool in_a = n < a.rows_a;
    const void* src = in_a ? a.a : a.b;
    const int64_t base = in_a ? ((int64_t)e * a.rows_a + n) * a.cols : ((int64_t)e * a.rows_b + n - a.rows_a) * a.cols;
    float f[kRowVecs][8];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kRowVecs; ++i) {
      const int v = threadIdx.x + i * kRowThreads;
      if (v < vecs) {
        load8(src, a.fp32, base + 8 * v, f[i]);
        amax = fmaxf(amax, amax8(f[i]));
#pragma unroll
        for (int c = 0; c < 8; ++c) col[i][c] = fmaxf(col[i][c], fabsf(f[i][c]));
      }
    }
    const float scale = fp8_scale(block_max(amax, scratch), kFp8MinAmaxSmall);
    const int64_t row = (int64_t)e * rows + n;
    uint2* q = reinterpret_cast<uint2*>(a.q + row * a.cols);
#pragma unroll
    for (int i = 0; i < kRowVecs; ++i) {
      const int v = threadIdx.x + i * kRowThreads;
      if (v < vecs) q[v] = fp8_quantise_floats8(f[i], scale);
    }
    if (threadIdx.x == 0) a.scale[row] = scale;
  }
  int* col_amax = reinterpret_cast<int*>(a.col_amax + (int64_t)e * a.cols);
#pragma unroll
  for (int i = 0; i < kRowVecs; ++i) {
    const int v = threadIdx.x + i * kRowThreads;
    if (v < vecs) {
#pragma unroll
      for (int c = 0; c < 8; ++c) atomicMax(col_amax + 8 * v + c, __float_as_int(col[i][c]));
    }
  }
}

void launch_weights(const WeightsArgs& a, cudaStream_t stream) {
  const int rows = a.rows_a + a.rows_b;
  if (a.experts == 0 || rows == 0) return;
  const dim3 grid((rows + kWeightRows - 1) / kWeightRows, a.experts);
  weights_kernel<<<grid, kRowThreads, 0, stream>>>(a);
  MOE_COMM_CHECK_LAUNCH("fp8_weights");
}

}  // namespace moe_comm
