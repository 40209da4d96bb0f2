// The weight gradients' operands in FP8: dW = A^T B over each expert's rows is a 2D x 2D grouped
// GEMM that contracts over the rows (tokens), and FP8 tensor cores take both operands K-major,
// so x [rows, channels] is transposed to [channels, row_stride]. bf16 x (the output gradient dy,
// h, dh13) is scaled per (expert, channel) over the expert's rows, from the amax the kernel that
// wrote x took (experts.h); e4m3 x (the experts' input rows) is copied byte for byte. One read of
// the rows: the amax pass this kernel once made over them cost as much as the transpose.
//
// A block takes 64 channels of one expert's rows and transposes them 128 rows at a time through
// shared memory: loads along the channels, 16-byte stores along the rows (the tile swizzled:
// tile_offset).
#include <cuda_bf16.h>

#include "common/launch.h"
#include "experts/rows.cuh"

namespace moe_comm {

constexpr int kGroupCols = 64;
constexpr int kGroupRows = 128;
constexpr int kGroupPitch = kGroupRows + 16;
constexpr int kColVecs = kGroupCols / 8;  // 8-channel vectors per row of the tile
static_assert(kGroupRows == kTransposeRows && kColVecs == kTransposeVecs, "tile_offset's tile");

// 8 bytes of row r from channel c: bf16 quantised by the columns' scales, or e4m3 as it is.
__device__ __forceinline__ uint2 load_row8(const GroupColumnsArgs& a, int64_t r, int c, const float* scales) {
  if (a.bytes) return *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(a.x) + r * a.channels + c);
  float f[8];
  bf16x8_to_floats(*reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.x) + r * a.channels + c), f);
  uint32_t word[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t packed = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(f[4 * h + k] / scales[4 * h + k], __NV_SATFINITE, __NV_E4M3);
      packed |= (uint32_t)q << (8 * k);
    }
    word[h] = packed;
  }
  return make_uint2(word[0], word[1]);
}

__global__ void __launch_bounds__(kTileThreads) group_columns_kernel(const GroupColumnsArgs a) {
  __shared__ __align__(16) uint8_t tile[kGroupCols * kGroupPitch];
  __shared__ float scales[kGroupCols];
  const int g = blockIdx.y, c0 = blockIdx.x * kGroupCols;
  const int64_t start = g == 0 ? 0 : a.offsets[g - 1], end = a.offsets[g];
  if (!a.bytes && threadIdx.x < kGroupCols) {
    const int col = c0 + threadIdx.x;
    const float scale = col < a.channels ? fp8_scale(a.col_amax[g * a.amax_stride + col], kFp8MinAmaxSmall) : 1.f;
    scales[threadIdx.x] = scale;
    if (col < a.channels) {
      const int per_half = a.channels / a.halves, h = col / per_half;
      a.scale[((int64_t)h * a.groups + g) * per_half + col % per_half] = scale;
    }
  }
  __syncthreads();

  constexpr int kLoads = kGroupRows * kColVecs / kTileThreads;
  constexpr int kStores = kGroupCols * kGroupRows / 16 / kTileThreads;
  for (int64_t r0 = start; r0 < end; r0 += kGroupRows) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int id = threadIdx.x + i * kTileThreads;
      const int rl = id / kColVecs, v = id % kColVecs;
      const int64_t r = r0 + rl;
      if (r >= end || c0 + 8 * v >= a.channels) continue;
      put8_in_tile<kGroupPitch>(tile, 8 * v, rl, load_row8(a, r, c0 + 8 * v, scales + 8 * v));
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kStores; ++i) {
      const int id = threadIdx.x + i * kTileThreads;
      const int cl = id / (kGroupRows / 16), seg = id % (kGroupRows / 16);
      const int col = c0 + cl;
      const int64_t r = r0 + 16 * seg;
      if (col >= a.channels || r >= end) continue;
      uint8_t* out = a.q + (int64_t)col * a.row_stride + r;
      const uint8_t* from = tile + tile_offset<kGroupPitch>(cl, 16 * seg);
      if (r + 16 <= end && r % 16 == 0) {
        *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(from);
      } else {
        for (int k = 0; k < 16 && r + k < end; ++k) out[k] = from[k];
      }
    }
    __syncthreads();
  }
}

void launch_group_columns(const GroupColumnsArgs& a, cudaStream_t stream) {
  if (a.groups == 0 || a.channels == 0) return;
  const dim3 grid((a.channels + kGroupCols - 1) / kGroupCols, a.groups);
  group_columns_kernel<<<grid, kTileThreads, 0, stream>>>(a);
  MOE_COMM_CHECK_LAUNCH("fp8_group_columns");
}

}  // namespace moe_comm
