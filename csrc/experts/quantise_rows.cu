// Quantise rows: the output gradient dY, rowwise, for the dgrad GEMM dY x W2 (one read of the
// bf16 row, one write of e4m3 and its scale). The gradient floor (kFp8MinAmaxSmall) applies.
#include <cuda_bf16.h>

#include "common/launch.h"
#include "experts/rows.cuh"

namespace moe_comm {

__global__ void __launch_bounds__(kRowThreads) quantise_rows_kernel(const QuantiseRowsArgs a) {
  __shared__ float scratch[kRowThreads / kWarpSize];
  const int64_t rows = rows_used(a.offsets, a.groups);
  const int vecs = a.channels / 8;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const uint4* x = static_cast<const uint4*>(a.x) + row * vecs;
    float f[kRowVecs][8];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kRowVecs; ++i) {
      const int v = threadIdx.x + i * kRowThreads;
      if (v < vecs) {
        bf16x8_to_floats(x[v], f[i]);
        amax = fmaxf(amax, amax8(f[i]));
      }
    }
    const float scale = fp8_scale(block_max(amax, scratch), kFp8MinAmaxSmall);
    uint2* q = reinterpret_cast<uint2*>(a.q + row * a.channels);
#pragma unroll
    for (int i = 0; i < kRowVecs; ++i) {
      const int v = threadIdx.x + i * kRowThreads;
      if (v < vecs) q[v] = fp8_quantise_floats8(f[i], scale);
    }
    if (threadIdx.x == 0) a.scale[row] = scale;
  }
}

void launch_quantise_rows(const QuantiseRowsArgs& a, int64_t rows, int sm_count, cudaStream_t stream) {
  quantise_rows_kernel<<<row_blocks(rows, sm_count), kRowThreads, 0, stream>>>(a);
  MOE_COMM_CHECK_LAUNCH("fp8_quantise_rows");
}

}  // namespace moe_comm
