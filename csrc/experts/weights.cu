// Weights for the forward GEMMs: [experts, rows, cols] (fp32 parameters at world 1, bf16 under
// FSDP) to e4m3 with one scale per row (a row of W1/W3 or W2 is one output channel of its GEMM),
// straight from the parameters, each read once. dgrad takes the same codes transposed
// (group_columns.cu) with these scales folded into its other operand, so no column amax and
// no second pass over the parameters.
//
// A row kernel: a block per row, the row held in registers (kWeightVecs vectors of 8 a thread, so a
// fp32 row of up to kMaxRowChannels is one read), its amax a block reduction. The block is as
// small as holds the row, so that narrow rows (W2's 2048 channels) still put many rows' loads in
// flight per SM: 64 threads for up to 2048 channels, 256 for W1|W3's 7168. The previous kernel
// also took every column's amax (atomics in shared memory) and re-read each row for lack of room
// to hold it: about 1.7 TB/s of fp32 parameters in the one-GPU recipe (results/h200x1/README.md,
// run 32).
#include <cuda_bf16.h>

#include "common/launch.h"
#include "experts/rows.cuh"

namespace moe_comm {

template <int kThreads>
__global__ void __launch_bounds__(kThreads) weights_kernel(const WeightsArgs a) {
  __shared__ float scratch[2 * kThreads / kWarpSize];
  BlockMax<kThreads> block_max{scratch};
  const int rows = a.rows_a + a.rows_b, vecs = a.cols / 8;
  const int64_t total = (int64_t)a.experts * rows;
  for (int64_t row = blockIdx.x; row < total; row += gridDim.x) {
    const int e = (int)(row / rows), n = (int)(row % rows);
    const bool in_a = n < a.rows_a;
    const void* src = in_a ? a.a : a.b;
    const int64_t base = in_a ? ((int64_t)e * a.rows_a + n) * a.cols : ((int64_t)e * a.rows_b + n - a.rows_a) * a.cols;
    float f[kWeightVecs][8];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kWeightVecs; ++i) {
      const int v = threadIdx.x + i * kThreads;
      if (v < vecs) {
        load8(src, a.fp32, base + 8 * v, f[i]);
        amax = fmaxf(amax, amax8(f[i]));
      }
    }
    const float scale = fp8_scale(block_max.of(amax), kFp8MinAmaxSmall);
    const float inv_scale = fp8_inverse_scale(scale);
    uint2* q = reinterpret_cast<uint2*>(a.q + row * a.cols);
#pragma unroll
    for (int i = 0; i < kWeightVecs; ++i) {
      const int v = threadIdx.x + i * kThreads;
      if (v < vecs) q[v] = fp8_quantise_floats8(f[i], inv_scale);
    }
    if (threadIdx.x == 0) a.scale[row] = scale;
  }
}

void launch_weights(const WeightsArgs& a, int sm_count, cudaStream_t stream) {
  const int64_t rows = (int64_t)a.experts * (a.rows_a + a.rows_b);
  if (rows == 0) return;
  with_row_threads<kWeightVecs>(a.cols / 8, [&](auto threads) {
    constexpr int kThreads = decltype(threads)::value;
    weights_kernel<kThreads><<<row_blocks<kThreads>(rows, sm_count), kThreads, 0, stream>>>(a);
  });
  MOE_COMM_CHECK_LAUNCH("fp8_weights");
}

}  // namespace moe_comm
