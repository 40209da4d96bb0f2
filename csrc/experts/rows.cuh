// What the FP8 experts' row kernels share: the row loop, the block's amax, loads of 8 channels.
#pragma once

#include <cuda_bf16.h>

#include <type_traits>

#include "common/launch.h"
#include "common/vec.cuh"
#include "experts/experts.h"

namespace moe_comm {

#if defined(__CUDACC__)

// Rows the GEMM reads: those before the last expert's segment end.
__device__ __forceinline__ int64_t rows_used(const int32_t* offsets, int groups) { return offsets[groups - 1]; }

// The rows [first, last) a block of a row kernel takes: a contiguous share of the rows used, so
// that a block walks each expert's rows in order (ExpertWalk) and reuses what it keeps per expert.
// The grid is one wave of resident blocks (walk_blocks), so every share runs at once.
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

// A per-channel float array in shared memory, laid out for the row kernels' access: thread t
// handles the 8 channels of vector v = t + i * threads, so the array keeps channels 8v..8v+3 at
// float4 v and 8v+4..8v+7 at float4 vecs + v. A warp's 16-byte loads then fall on consecutive
// float4s (one wavefront per quarter-warp); stored channel by channel, a thread's two float4s
// sit 32 bytes apart from its neighbour's and every load took two.
struct VecSplit {
  float4* base;
  int vecs;
  __device__ __forceinline__ float4& lo(int v) const { return base[v]; }
  __device__ __forceinline__ float4& hi(int v) const { return base[vecs + v]; }
  // Where channel c lives, as a float index.
  __device__ __forceinline__ int at(int c) const { return ((c % 8) / 4 * vecs + c / 8) * 4 + c % 4; }
};

// A row kernel's walk over its rows, expert by expert, with what it keeps per expert in shared
// memory: the channel scales folded into the rows (where given; [groups, channels] in global
// memory), loaded when the walk enters an expert, and the columns' amax of the bf16 rows the
// kernel writes for the weight gradients (where asked), merged into col_amax ([groups,
// amax_channels], zeroed by the caller; non-negative floats order as their bits do) when it
// leaves it: the amax of the fp32 values rounded to bf16, which is the amax of the rounded
// values (rounding is monotonic). Each thread updates only its own channels, so the shared
// arrays need no atomics. The amax taken here spares the weight gradients' operands a pass over
// the rows (group_columns.cu: 1.31 -> 0.91 ms at the flagship rank's rows, run 36). Read straight
// from global memory per row instead, the scales cost more than the rows (fp32 against bf16) and
// the rows' stream evicted them from L1.
struct ExpertWalk {
  GroupCursor experts;
  const float* scale_src;  // null: nothing to fold; else [groups, scale_channels]
  VecSplit scales_s;       // scale_channels
  float* col_amax;         // null: no columns' amax; else [groups, amax_channels]
  int amax_channels;
  VecSplit col_amax_s;     // amax_channels
  int current = -1;

  // Shared memory: the scales (if any), then the columns' amax (if any).
  static size_t smem_bytes(const float* scales, int scale_channels, const float* amax, int amax_channels) {
    return ((scales ? scale_channels : 0) + (amax ? amax_channels : 0)) * sizeof(float);
  }
  __device__ __forceinline__ ExpertWalk(const int32_t* offsets, const float* scales, int scale_c, float* amax,
                                        int amax_c, float4* smem)
      : experts(offsets), scale_src(scales), scales_s{smem, scale_c / 8}, col_amax(amax), amax_channels(amax_c),
        col_amax_s{smem + (scales ? scale_c / 4 : 0), amax_c / 8} {
    if (col_amax != nullptr) {
      for (int i = threadIdx.x; i < amax_channels / 4; i += blockDim.x) col_amax_s.base[i] = float4{0.f, 0.f, 0.f, 0.f};
    }
  }
  // Enter row's expert (every thread of the block, the same row): the scales to fold (base null:
  // none). By value: a pointer to a member kept the whole walk in local memory (88 bytes of stack
  // frame in quantise_rows and gate_backward, read in the row loop), where by value it lives in
  // registers (ptxas -v: no stack frame).
  __device__ __forceinline__ VecSplit enter(int64_t row) {
    const int g = experts.at(row);
    if (g != current && (scale_src != nullptr || col_amax != nullptr)) {
      __syncthreads();  // the previous expert's readers and writers are done
      merge();
      if (scale_src != nullptr) {
        const float4* from = reinterpret_cast<const float4*>(scale_src + (int64_t)g * scales_s.vecs * 8);
        for (int i = threadIdx.x; i < scales_s.vecs * 2; i += blockDim.x) {
          (i % 2 ? scales_s.hi(i / 2) : scales_s.lo(i / 2)) = from[i];
        }
      }
      __syncthreads();
    }
    current = g;
    return scale_src != nullptr ? scales_s : VecSplit{nullptr, 0};
  }
  // |f| into the columns' amax of vector v (channels 8v..8v+8 of the amax array: this thread's own).
  __device__ __forceinline__ void take8(const float (&f)[8], int v) {
    if (col_amax == nullptr) return;
    float4 lo = col_amax_s.lo(v), hi = col_amax_s.hi(v);
    lo.x = fmaxf(lo.x, fabsf(f[0])), lo.y = fmaxf(lo.y, fabsf(f[1]));
    lo.z = fmaxf(lo.z, fabsf(f[2])), lo.w = fmaxf(lo.w, fabsf(f[3]));
    hi.x = fmaxf(hi.x, fabsf(f[4])), hi.y = fmaxf(hi.y, fabsf(f[5]));
    hi.z = fmaxf(hi.z, fabsf(f[6])), hi.w = fmaxf(hi.w, fabsf(f[7]));
    col_amax_s.lo(v) = lo, col_amax_s.hi(v) = hi;
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
    float* kept = reinterpret_cast<float*>(col_amax_s.base);
    for (int c = threadIdx.x; c < amax_channels; c += blockDim.x) {
      const int i = col_amax_s.at(c);
      const float m = __bfloat162float(__float2bfloat16(kept[i]));
      if (m > 0.f) atomicMax(out + c, __float_as_int(m));
      kept[i] = 0.f;
    }
  }
};

// f *= the scales of vector v (a no-op where base is null: no scale to fold).
__device__ __forceinline__ void scale8(float (&f)[8], const VecSplit& channel_scale, int v) {
  if (channel_scale.base == nullptr) return;
  const float4 lo = channel_scale.lo(v), hi = channel_scale.hi(v);
  f[0] *= lo.x, f[1] *= lo.y, f[2] *= lo.z, f[3] *= lo.w;
  f[4] *= hi.x, f[5] *= hi.y, f[6] *= hi.z, f[7] *= hi.w;
}

// Max over the block of kThreads, on every thread, once a row: `of(v)` with every thread's v.
// One barrier a call: the calls alternate between two halves of `scratch` (2 * kThreads / 32
// floats of shared memory), so a call's writes never meet the previous call's reads, and a thread
// writes a half again only two calls on, after the barrier of the call between, which no thread
// passes before it has read this call's half. (With one half, a barrier before the writes kept
// the previous call's readers ahead: two barriers a row.)
template <int kThreads>
struct BlockMax {
  float* scratch;
  int half = 0;
  __device__ __forceinline__ float of(float v) {
    const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
    float* mine = scratch + half * (kThreads / kWarpSize);
    half ^= 1;
    v = warp_max(v);
    if (lane == 0) mine[warp] = v;
    __syncthreads();
    float m = 0.f;
#pragma unroll
    for (int w = 0; w < kThreads / kWarpSize; ++w) m = fmaxf(m, mine[w]);
    return m;
  }
};

// The most threads an SM holds (Hopper): resident blocks of a row kernel are bounded by it.
constexpr int kThreadsPerSm = 2048;

// Calls launch(std::integral_constant<int, kThreads>{}) with the smallest block of 64, 128, 256
// or 512 threads that holds a row of `vecs` 8-channel vectors at kVecs a thread (experts.h says
// which kernel holds how many). Small blocks for narrow rows put more rows' loads in flight per SM:
// a thread keeps kVecs vectors of each operand in registers however many the row fills, so a
// 2048-channel row in a block of 256 threads at 4 vectors left three quarters of those registers
// idle and, at 153 registers a thread, one such block per SM (the gate's backward: 0.91 ms at the
// flagship rank's rows, run 36; 0.67 in blocks of 64, run 39).
template <int kVecs, typename Launch>
void with_row_threads(int vecs, Launch&& launch) {
  constexpr int kLargest = kMaxRowChannels / 8 / kVecs;  // the block that holds the widest row
  static_assert(kLargest == 256 || kLargest == 512, "blocks of 64 threads up to kLargest");
  if (vecs <= 64 * kVecs) {
    launch(std::integral_constant<int, 64>{});
  } else if (vecs <= 128 * kVecs) {
    launch(std::integral_constant<int, 128>{});
  } else if (kLargest == 256 || vecs <= 256 * kVecs) {
    launch(std::integral_constant<int, 256>{});
  } else {
    launch(std::integral_constant<int, kLargest>{});
  }
}

// Grid of a row kernel that takes rows in turn (row = blockIdx.x, += gridDim.x): at most as many
// blocks of kThreads as the SMs hold threads.
template <int kThreads>
int row_blocks(int64_t rows, int sm_count) {
  const int64_t most = (int64_t)sm_count * (kThreadsPerSm / kThreads);
  return (int)(rows < most ? (rows > 0 ? rows : 1) : most);
}

// Grid of a row kernel that walks contiguous shares (block_rows): one wave of the blocks the GPU
// holds at once with this kernel's registers and shared memory, at most one per row. More blocks
// than fit would run in waves, each block's share in turn.
template <typename Kernel>
int walk_blocks(Kernel kernel, int threads, size_t smem, int64_t rows, int sm_count) {
  if (smem > 48 * 1024) {
    MOE_COMM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  }
  int per_sm = 0;
  MOE_COMM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  const int64_t wave = (int64_t)sm_count * (per_sm > 0 ? per_sm : 1);
  return (int)(rows < wave ? (rows > 0 ? rows : 1) : wave);
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

// Row r's 8 bytes of channels ch..ch+8 (in channel order: v.x's low byte first) into a transpose
// tile, each at its channel's tile_offset.
template <int kPitch>
__device__ __forceinline__ void put8_in_tile(uint8_t* tile, int ch, int r, uint2 v) {
  const int at = tile_offset<kPitch>(ch, r);  // channel ch + k's byte at at + k * kPitch
#pragma unroll
  for (int k = 0; k < 8; ++k) tile[at + k * kPitch] = (uint8_t)(((k < 4 ? v.x : v.y) >> (8 * (k % 4))) & 0xff);
}

// A row kernel's loads of the next row, issued before the block reduces and stores the current
// one, so that a thread's loads are in flight through the barrier of BlockMax: kOperands
// arrays of the row, kRowVecs 8-channel vectors each (vector v = threadIdx.x + i * kThreads of
// those below vecs). Rows one after the other: fetch the first, then take each row while
// fetching the next.
template <int kThreads, int kOperands>
struct RowPrefetch {
  int vecs;
  uint4 next[kOperands][kRowVecs];

  __device__ __forceinline__ void fetch(bool any, const uint4* const (&from)[kOperands]) {
    if (!any) return;
#pragma unroll
    for (int o = 0; o < kOperands; ++o) {
#pragma unroll
      for (int i = 0; i < kRowVecs; ++i) {
        const int v = threadIdx.x + i * kThreads;
        if (v < vecs) next[o][i] = from[o][v];
      }
    }
  }
  // The row fetched last into `row`; the loads of `from` (where any) start before this returns.
  __device__ __forceinline__ void take(uint4 (&row)[kOperands][kRowVecs], bool any,
                                       const uint4* const (&from)[kOperands]) {
#pragma unroll
    for (int o = 0; o < kOperands; ++o) {
#pragma unroll
      for (int i = 0; i < kRowVecs; ++i) row[o][i] = next[o][i];
    }
    fetch(any, from);
  }
};

// The gate's sigmoid from the hardware's exp2 and reciprocal (__expf, __fdividef: a few ulp of
// fp32), not expf and a correctly rounded division (about twenty instructions with a branch to a
// slow path, a value): its result is rounded to bf16 or e4m3 (2^-8, 2^-3 relative), and the gate
// already only agrees with torch's to rounding (moe_comm/kernels/fp8_reference.py). Large |x|
// saturate as they should: exp(-x) = inf gives 0, and __fdividef of 1 by more than 2^126 is 0.
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }

#endif  // __CUDACC__

}  // namespace moe_comm
