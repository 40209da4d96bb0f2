// What the FP8 experts' row kernels share: the row loop, the block's amax, loads of 8 channels.
#pragma once

#include <cuda_bf16.h>

#include "common/vec.cuh"
#include "experts/experts.h"

namespace moe_comm {

#if defined(__CUDACC__)

// Rows the GEMM reads: those before the last expert's segment end.
__device__ __forceinline__ int64_t rows_used(const int32_t* offsets, int groups) { return offsets[groups - 1]; }

// Max of v over the block, on every thread. `scratch`: kRowThreads / 32 floats of shared memory,
// free again when this returns (the first barrier keeps a previous call's readers ahead).
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float m = 0.f;
#pragma unroll
  for (int w = 0; w < kRowThreads / kWarpSize; ++w) m = fmaxf(m, scratch[w]);
  return m;
}

// Grid of a row kernel: a block per row, at most eight resident per SM's worth.
inline int row_blocks(int64_t rows, int sm_count) {
  const int64_t most = (int64_t)sm_count * 8;
  return (int)(rows < most ? (rows > 0 ? rows : 1) : most);
}

// 8 consecutive values of a float or bf16 array, from element `index` (a multiple of 8).
__device__ __forceinline__ void load8(const void* base, bool fp32, int64_t index, float (&out)[8]) {
  if (fp32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(base) + index);
    const float4 lo = p[0], hi = p[1];
    out[0] = lo.x, out[1] = lo.y, out[2] = lo.z, out[3] = lo.w;
    out[4] = hi.x, out[5] = hi.y, out[6] = hi.z, out[7] = hi.w;
  } else {
    bf16x8_to_floats(*reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(base) + index), out);
  }
}

// Where a transpose tile (kTransposeRows rows of kTransposeVecs 8-channel vectors, stored a row
// of kPitch bytes per channel) keeps channel ch's byte of row r: its 16-byte chunks XOR-swizzled
// by the channel's vector. A warp's loads are 4 rows x the 8 vectors, and its writes of channel
// k of each vector then fall on 8 banks; unswizzled, the 8 vectors' rows sit a multiple of 32
// banks apart and the writes went 8-way on one bank. A chunk read back stays 16 contiguous bytes.
constexpr int kTransposeRows = 128;
constexpr int kTransposeVecs = 8;
template <int kPitch>
__device__ __forceinline__ int tile_offset(int ch, int r) {
  return ch * kPitch + ((r / 16) ^ (ch / 8 % kTransposeVecs)) * 16 + r % 16;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

#endif  // __CUDACC__

}  // namespace moe_comm
