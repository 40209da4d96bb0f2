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

// Store of one vector; kStream marks data nobody reads soon (expert-major rows written once,
// read by the next GEMM), so it does not evict what the copies still read from L2.
template <bool kStream>
__device__ __forceinline__ void store_vec(uint4* p, uint4 v) {
  if constexpr (kStream) {
    __stcs(p, v);
  } else {
    *p = v;
  }
}

// `src` must not be written by anyone while the copy runs; null destinations are skipped.
// Copies vectors [begin, end) of the row (all of it by default).
template <int kDsts, int kUnroll = kCopyUnroll, bool kStream = false>
__device__ __forceinline__ void copy_row(const uint4* src, uint4* const (&dst)[kDsts], int row_vecs, int lane,
                                         int begin = 0) {
  int v = begin + lane;
  for (; v + (kUnroll - 1) * kWarpSize < row_vecs; v += kUnroll * kWarpSize) {
    uint4 value[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) value[u] = src[v + u * kWarpSize];
#pragma unroll
    for (int d = 0; d < kDsts; ++d) {
      if (dst[d] == nullptr) continue;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) store_vec<kStream>(dst[d] + v + u * kWarpSize, value[u]);
    }
  }
  for (; v < row_vecs; v += kWarpSize) {
    const uint4 value = src[v];
#pragma unroll
    for (int d = 0; d < kDsts; ++d) {
      if (dst[d] != nullptr) store_vec<kStream>(dst[d] + v, value);
    }
  }
}

// Small calls leave most of the GPU idle if one warp moves a whole row: split each row into
// up to kMaxRowParts parts, one warp each, when there are fewer rows than warps.
constexpr int kMaxRowParts = 8;

struct RowSplit {
  int parts;
  __device__ __forceinline__ RowSplit(int items, int warps) {
    parts = items > 0 ? min(kMaxRowParts, max(1, warps / items)) : 1;
  }
  // Part `part` of a row of n units covers [begin, end); vectors stay warp-aligned.
  __device__ __forceinline__ void range(int part, int n, int& begin, int& end) const {
    const int per = (n + parts * kWarpSize - 1) / (parts * kWarpSize) * kWarpSize;
    begin = min(n, part * per);
    end = min(n, begin + per);
  }
};

#endif  // __CUDACC__

}  // namespace moe_comm
