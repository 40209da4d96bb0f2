// What the FP8 experts' row kernels share: the row loop, the block's amax, loads of 8 channels.
#pragma once

#include <cuda_bf16.h>

#include "common/vec.cuh"
#include "experts/experts.h"

namespace moe_comm {

#if defined(__CUDACC__)

// Rows the GEMM reads: those before the last expert's segment end.
__device__ __forceinline__ int64_t rows_used(const int32_t* offsets, int groups) { return offsets[groups - 1]; }

// The rows [first, last) a block of a row kernel takes: a contiguous share of the rows used, so
// that a block walks each expert's rows in order (ExpertWalk) and reuses what it keeps per expert.
__device__ __forceinline__ void block_rows(int64_t rows, int64_t& first, int64_t& last) {
  const int64_t per = (rows + gridDim.x - 1) / gridDim.x;
  first = min(rows, (int64_t)blockIdx.x * per);
  last = min(rows, first + per);
}

// The expert of each row as a block walks its rows in increasing order (rows below offsets[groups - 1]).
struct GroupCursor {
  const int32_t* offsets;
  int group = 0;
  int64_t end;
  __device__ __forceinline__ explicit GroupCursor(const int32_t* o) : offsets(o), end(o[0]) {}
  __device__ __forceinline__ int at(int64_t row) {
    while (row >= end) end = offsets[++group];
    return group;
  }
};

// A row kernel's walk over its rows, expert by expert, with what it keeps per expert in shared
// memory: the channel scales folded into the rows (where given; [groups, channels] in global
// memory), loaded when the walk enters an expert, and the columns' amax of the bf16 rows the
// kernel writes for the weight gradients (where asked), merged into col_amax ([groups,
// amax_channels], zeroed by the caller; non-negative floats order as their bits do) when it
// leaves it: the amax of the fp32 values rounded to bf16, which is the amax of the rounded
// values (rounding is monotonic). Each thread updates only its own channels, so the shared
// arrays need no atomics. The amax taken here spares the weight gradients' operands a pass over
// the rows (group_columns.cu: 1.31 -> 0.91 ms at the flagship rank's rows, run 36), but the walk
// over contiguous rows made the two kernels that take it slower than one row per block in turn
// (the gate's backward 0.43 -> 0.71 ms with the scales read from global memory, run 35, 0.91 with
// the amax, run 36; dy's 0.43 -> 0.48): a net loss of 0.1 ms there, not understood yet
// (results/h200x1/README.md, thirteenth session).
struct ExpertWalk {
  GroupCursor experts;
  const float* scale_src;  // null: nothing to fold; else [groups, scale_channels]
  int scale_channels;
  float4* scales_s;        // [scale_channels / 4]
  float* col_amax;         // null: no columns' amax; else [groups, amax_channels]
  int amax_channels;
  float* col_amax_s;       // [amax_channels]
  int current = -1;

  // Shared memory: the scales (if any), then the columns' amax (if any).
  static size_t smem_bytes(const float* scales, int scale_channels, const float* amax, int amax_channels) {
    return ((scales ? scale_channels : 0) + (amax ? amax_channels : 0)) * sizeof(float);
  }
  __device__ __forceinline__ ExpertWalk(const int32_t* offsets, const float* scales, int scale_c, float* amax,
                                        int amax_c, float4* smem)
      : experts(offsets), scale_src(scales), scale_channels(scale_c), scales_s(smem), col_amax(amax),
        amax_channels(amax_c), col_amax_s(reinterpret_cast<float*>(smem) + (scales ? scale_c : 0)) {
    if (col_amax != nullptr) {
      for (int i = threadIdx.x; i < amax_channels; i += blockDim.x) col_amax_s[i] = 0.f;
    }
  }
  // Enter row's expert (every thread of the block, the same row): the scales to fold, or null.
  __device__ __forceinline__ const float* enter(int64_t row) {
    const int g = experts.at(row);
    if (g != current && (scale_src != nullptr || col_amax != nullptr)) {
      __syncthreads();  // the previous expert's readers and writers are done
      merge();
      if (scale_src != nullptr) {
        const float4* from = reinterpret_cast<const float4*>(scale_src + (int64_t)g * scale_channels);
        for (int i = threadIdx.x; i < scale_channels / 4; i += blockDim.x) scales_s[i] = from[i];
      }
      __syncthreads();
    }
    current = g;
    return scale_src != nullptr ? reinterpret_cast<const float*>(scales_s) : nullptr;
  }
  // |f| into the columns' amax of channels c..c+8 (this thread's own).
  __device__ __forceinline__ void take8(const float (&f)[8], int c) {
    if (col_amax == nullptr) return;
    float4* m = reinterpret_cast<float4*>(col_amax_s + c);
    float4 lo = m[0], hi = m[1];
    lo.x = fmaxf(lo.x, fabsf(f[0])), lo.y = fmaxf(lo.y, fabsf(f[1]));
    lo.z = fmaxf(lo.z, fabsf(f[2])), lo.w = fmaxf(lo.w, fabsf(f[3]));
    hi.x = fmaxf(hi.x, fabsf(f[4])), hi.y = fmaxf(hi.y, fabsf(f[5]));
    hi.z = fmaxf(hi.z, fabsf(f[6])), hi.w = fmaxf(hi.w, fabsf(f[7]));
    m[0] = lo, m[1] = hi;
  }
  // After the block's last row.
  __device__ __forceinline__ void finish() {
    __syncthreads();
    merge();
  }

 private:
  // The current expert's columns' amax into col_amax, and zeroed for the next (between barriers).
  __device__ __forceinline__ void merge() {
    if (col_amax == nullptr || current < 0) return;
    int* out = reinterpret_cast<int*>(col_amax + (int64_t)current * amax_channels);
    for (int i = threadIdx.x; i < amax_channels; i += blockDim.x) {
      const float m = __bfloat162float(__float2bfloat16(col_amax_s[i]));
      if (m > 0.f) atomicMax(out + i, __float_as_int(m));
      col_amax_s[i] = 0.f;
    }
  }
};

// f *= scales[c..c+8) (a no-op for null: no scale to fold).
__device__ __forceinline__ void scale8(float (&f)[8], const float* channel_scale, int64_t at) {
  if (channel_scale == nullptr) return;
  const float4* p = reinterpret_cast<const float4*>(channel_scale + at);
  const float4 lo = p[0], hi = p[1];
  f[0] *= lo.x, f[1] *= lo.y, f[2] *= lo.z, f[3] *= lo.w;
  f[4] *= hi.x, f[5] *= hi.y, f[6] *= hi.z, f[7] *= hi.w;
}

// Max of v over the block of kThreads, on every thread. `scratch`: kThreads / 32 floats of shared
// memory, free again when this returns (the first barrier keeps a previous call's readers ahead).
template <int kThreads = kRowThreads>
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float m = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / kWarpSize; ++w) m = fmaxf(m, scratch[w]);
  return m;
}

// Grid of a row kernel: a block per row, at most as many as fit on the GPU at once (blocks of
// kRowThreads: eight per SM).
inline int row_blocks(int64_t rows, int sm_count, int blocks_per_sm = 8) {
  const int64_t most = (int64_t)sm_count * blocks_per_sm;
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
