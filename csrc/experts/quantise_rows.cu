// Quantise rows: the output gradient dY, rowwise, for the dgrad GEMM dY x W2 (one read of the
// bf16 row, one write of e4m3 and its scale), each row first multiplied channel by channel by
// its expert's W2 row scales where given (experts.h). The gradient floor (kFp8MinAmaxSmall)
// applies. The same read takes each (expert, channel)'s amax of dY for the weight gradient's
// operand (group_columns.cu).
//
// A block walks its rows one after the other, each a block-wide reduction; the next row's loads
// are in flight while it reduces and stores this one (without that, 1.09 ms at the one-GPU
// recipe's layer, 1.34 TB/s: run 44).
#include <cuda_bf16.h>

#include "common/launch.h"
#include "experts/rows.cuh"

namespace moe_comm {

// Resident threads an SM keeps at least (64 registers a thread): with the next row's loads in
// flight the kernel took 72, one block of 512 an SM, and ran 8% slower than without them (run 56);
// held to two such blocks it is 3% faster (run 57).
constexpr int kQuantiseRowsThreadsPerSm = kThreadsPerSm / 2;

template <int kThreads>
__global__ void __launch_bounds__(kThreads, kQuantiseRowsThreadsPerSm / kThreads) quantise_rows_kernel(const QuantiseRowsArgs a) {
  __shared__ float scratch[2 * kThreads / kWarpSize];
  BlockMax<kThreads> block_max{scratch};
  extern __shared__ float4 walk_s[];
  int64_t first, last;
  block_rows(rows_used(a.offsets, a.groups), first, last);
  ExpertWalk walk(a.offsets, a.channel_scale, a.channels, a.col_amax, a.channels, walk_s);
  const int vecs = a.channels / 8;
  // The next row's loads are issued before this row's reduction and stores (rows.cuh).
  const uint4* x = static_cast<const uint4*>(a.x);
  RowPrefetch<kThreads, 1> rows{vecs};
  rows.fetch(first < last, {x + first * vecs});
  for (int64_t row = first; row < last; ++row) {
    const VecSplit channel_scale = walk.enter(row);
    uint4 raw[1][kRowVecs];
    rows.take(raw, row + 1 < last, {x + (row + 1) * vecs});
    float f[kRowVecs][8];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kRowVecs; ++i) {
      const int v = threadIdx.x + i * kThreads;
      if (v < vecs) {
        bf16x8_to_floats(raw[0][i], f[i]);
        walk.take8(f[i], v);
        scale8(f[i], channel_scale, v);
        amax = fmaxf(amax, amax8(f[i]));
      }
    }
    const float scale = fp8_scale(block_max.of(amax), kFp8MinAmaxSmall);
    const float inv_scale = fp8_inverse_scale(scale);
    uint2* q = reinterpret_cast<uint2*>(a.q + row * a.channels);
#pragma unroll
    for (int i = 0; i < kRowVecs; ++i) {
      const int v = threadIdx.x + i * kThreads;
      if (v < vecs) q[v] = fp8_quantise_floats8(f[i], inv_scale);
    }
    if (threadIdx.x == 0) a.scale[row] = scale;
  }
  walk.finish();
}

void launch_quantise_rows(const QuantiseRowsArgs& a, int64_t rows, int sm_count, cudaStream_t stream) {
  const size_t smem = ExpertWalk::smem_bytes(a.channel_scale, a.channels, a.col_amax, a.channels);
  with_row_threads<kRowVecs>(a.channels / 8, [&](auto threads) {
    constexpr int kThreads = decltype(threads)::value;
    const int blocks = walk_blocks(quantise_rows_kernel<kThreads>, kThreads, smem, rows, sm_count);
    quantise_rows_kernel<kThreads><<<blocks, kThreads, smem, stream>>>(a);
  });
  MOE_COMM_CHECK_LAUNCH("fp8_quantise_rows");
}

}  // namespace moe_comm
