// The weight gradients' operands in FP8: dW = A^T B over each expert's rows is a 2D x 2D grouped
// GEMM that contracts over the rows (tokens), and FP8 tensor cores take both operands K-major,
// so x [rows, channels] is transposed to [channels, row_stride], scaled per (expert, channel)
// over the expert's rows: token-wise scaling, the second quantisation rowwise scaling cannot
// give. x is bf16 (the output gradient, dh13, h) or e4m3 with a scale per row (the experts'
// input rows, dequantised on the way: their values are q * row_scale).
//
// A block takes 64 channels of one expert's rows: a pass for the columns' amax over the rows,
// then one that quantises 128-row tiles and transposes them through shared memory (loads along
// the channels, 16-byte stores along the rows; the tile swizzled: tile_offset).
#include <cuda_bf16.h>

#include "common/launch.h"
#include "experts/rows.cuh"

namespace moe_comm {

constexpr int kGroupCols = 64;
constexpr int kGroupRows = 128;
constexpr int kGroupPitch = kGroupRows + 16;
constexpr int kColVecs = kGroupCols / 8;              // 8-channel vectors per row of the tile
constexpr int kRowLanes = kRowThreads / kColVecs;     // rows the amax pass reads at once
static_assert(kGroupRows == kTransposeRows && kColVecs == kTransposeVecs, "tile_offset's tile");

// 8 channels of row r from channel c: bf16, or e4m3 times the row's scale.
__device__ __forceinline__ void load_row8(const GroupColumnsArgs& a, int64_t r, int c, float (&f)[8]) {
  if (a.row_scale == nullptr) {
    bf16x8_to_floats(*reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.x) + r * a.channels + c), f);
    return;
  }
  fp8x8_to_floats(*reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(a.x) + r * a.channels + c), f);
  const float s = a.row_scale[r];
#pragma unroll
  for (int k = 0; k < 8; ++k) f[k] *= s;
}

__global__ void __launch_bounds__(kRowThreads) group_columns_kernel(const GroupColumnsArgs a) {
  __shared__ __align__(16) uint8_t tile[kGroupCols * kGroupPitch];
  __shared__ float partial[kRowLanes][kGroupCols];
  __shared__ float scales[kGroupCols];
  const int g = blockIdx.y, c0 = blockIdx.x * kGroupCols;
  const int64_t start = g == 0 ? 0 : a.offsets[g - 1], end = a.offsets[g];
  const int cv = threadIdx.x % kColVecs, lane_row = threadIdx.x / kColVecs;
  const int c = c0 + 8 * cv;
  const bool has_cols = c < a.channels;

  // Pass 1: each column's amax over the expert's rows.
  float amax[8] = {};
  if (has_cols) {
    for (int64_t r = start + lane_row; r < end; r += kRowLanes) {
      float f[8];
      load_row8(a, r, c, f);
#pragma unroll
      for (int k = 0; k < 8; ++k) amax[k] = fmaxf(amax[k], fabsf(f[k]));
    }
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) partial[lane_row][8 * cv + k] = amax[k];
  __syncthreads();
  if (threadIdx.x < kGroupCols) {
    float m = 0.f;
    for (int l = 0; l < kRowLanes; ++l) m = fmaxf(m, partial[l][threadIdx.x]);
    const float scale = fp8_scale(m, kFp8MinAmaxSmall);
    scales[threadIdx.x] = scale;
    const int col = c0 + threadIdx.x;
    if (col < a.channels) {
      const int per_half = a.channels / a.halves, h = col / per_half;
      a.scale[((int64_t)h * a.groups + g) * per_half + col % per_half] = scale;
    }
  }
  __syncthreads();

  // Pass 2: quantise and transpose, kGroupRows rows at a time.
  constexpr int kLoads = kGroupRows * kColVecs / kRowThreads;
  constexpr int kStores = kGroupCols * kGroupRows / 16 / kRowThreads;
  for (int64_t r0 = start; r0 < end; r0 += kGroupRows) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int id = threadIdx.x + i * kRowThreads;
      const int rl = id / kColVecs, v = id % kColVecs;
      const int64_t r = r0 + rl;
      if (r >= end || c0 + 8 * v >= a.channels) continue;
      float f[8];
      load_row8(a, r, c0 + 8 * v, f);
      const int at = tile_offset<kGroupPitch>(8 * v, rl);  // channel 8v + k's byte at at + k * kGroupPitch
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        tile[at + k * kGroupPitch] =
            __nv_cvt_float_to_fp8(f[k] / scales[8 * v + k], __NV_SATFINITE, __NV_E4M3);
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kStores; ++i) {
      const int id = threadIdx.x + i * kRowThreads;
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
  group_columns_kernel<<<grid, kRowThreads, 0, stream>>>(a);
  MOE_COMM_CHECK_LAUNCH("fp8_group_columns");
}

}  // namespace moe_comm
