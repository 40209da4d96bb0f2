// The one row-copy loop: a warp moves one row of 16-byte vectors from a source to up to kDsts
// destinations (peers' buffers through NVLink, expert-major rows in HBM, a staging slot), with
// several loads in flight per lane. With one load in flight a row copy waits one memory round
// trip per 512 bytes of the warp, and the copies, not the link, bound the kernels.
#pragma once

#include <cuda_runtime.h>

#include "common/vec.cuh"

namespace moe_comm {

// 16-byte vectors each lane loads before it stores any.
constexpr int kCopyUnroll = 4;

#if defined(__CUDACC__)

// `src` must not be written by anyone while the copy runs; null destinations are skipped.
template <int kDsts, int kUnroll = kCopyUnroll>
__device__ __forceinline__ void copy_row(const uint4* src, uint4* const (&dst)[kDsts], int row_vecs, int lane) {
  int v = lane;
  for (; v + (kUnroll - 1) * kWarpSize < row_vecs; v += kUnroll * kWarpSize) {
    uint4 value[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) value[u] = src[v + u * kWarpSize];
#pragma unroll
    for (int d = 0; d < kDsts; ++d) {
      if (dst[d] == nullptr) continue;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) dst[d][v + u * kWarpSize] = value[u];
    }
  }
  for (; v < row_vecs; v += kWarpSize) {
    const uint4 value = src[v];
#pragma unroll
    for (int d = 0; d < kDsts; ++d) {
      if (dst[d] != nullptr) dst[d][v] = value;
    }
  }
}

#endif  // __CUDACC__

}  // namespace moe_comm
