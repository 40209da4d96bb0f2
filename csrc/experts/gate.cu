// The gate between the experts' GEMMs, h = silu(h1) * h3 in fp32 from the first GEMM's bf16
// output h13 = [h1 | h3], quantised with one scale per row for the second GEMM: one read of
// h13, one write of e4m3 (the bf16 h is never stored; the backward recomputes it).
#include <cuda_bf16.h>

#include "common/launch.h"
#include "experts/rows.cuh"

namespace moe_comm {

template <int kThreads>
__global__ void __launch_bounds__(kThreads) gate_kernel(const GateArgs a) {
  __shared__ float scratch[2 * kThreads / kWarpSize];
  BlockMax<kThreads> block_max{scratch};
  const int64_t rows = rows_used(a.offsets, a.groups);
  const int vecs = a.inter / 8;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const uint4* h1 = static_cast<const uint4*>(a.h13) + row * 2 * vecs;
    const uint4* h3 = h1 + vecs;
    float h[kRowVecs][8];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kRowVecs; ++i) {
      const int v = threadIdx.x + i * kThreads;
      if (v < vecs) {
        float up[8];
        bf16x8_to_floats(h1[v], h[i]);
        bf16x8_to_floats(h3[v], up);
#pragma unroll
        for (int e = 0; e < 8; ++e) h[i][e] = h[i][e] * sigmoid(h[i][e]) * up[e];
        amax = fmaxf(amax, amax8(h[i]));
      }
    }
    const float scale = fp8_scale(block_max.of(amax), kFp8MinAmaxSmall);
    const float inv_scale = fp8_inverse_scale(scale);
    uint2* q = reinterpret_cast<uint2*>(a.q + row * a.inter);
#pragma unroll
    for (int i = 0; i < kRowVecs; ++i) {
      const int v = threadIdx.x + i * kThreads;
      if (v < vecs) q[v] = fp8_quantise_floats8(h[i], inv_scale);
    }
    if (threadIdx.x == 0) a.scale[row] = scale;
  }
}

void launch_gate(const GateArgs& a, int64_t rows, int sm_count, cudaStream_t stream) {
  with_row_threads<kRowVecs>(a.inter / 8, [&](auto threads) {
    constexpr int kThreads = decltype(threads)::value;
    gate_kernel<kThreads><<<row_blocks<kThreads>(rows, sm_count), kThreads, 0, stream>>>(a);
  });
  MOE_COMM_CHECK_LAUNCH("fp8_gate");
}

}  // namespace moe_comm
