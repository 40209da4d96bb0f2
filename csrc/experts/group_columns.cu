// The transposes the FP8 GEMMs need, FP8 tensor cores taking both operands K-major:
// - the weight gradients' operands: dW = A^T B over each expert's rows is a 2D x 2D grouped GEMM
//   that contracts over the rows (tokens), so x [rows, channels] is transposed to [channels,
//   row_stride]. bf16 x (the output gradient dy, h, dh13) is scaled per (expert, channel) over
//   the expert's rows, from the amax the kernel that wrote x took (experts.h); e4m3 x (the
//   experts' input rows) is copied byte for byte. One read of the rows: the amax pass this kernel
//   once made over them cost as much as the transpose.
// - dgrad's weights: the forward's e4m3 codes [experts, rows, cols] to [experts, cols, rows],
//   byte for byte (uniform_rows: every expert its own matrix).
//
// A block takes 64 channels of a chunk of one expert's rows (group_chunk_rows) and transposes
// them 128 rows at a time through
// shared memory: loads along the channels, 16-byte stores along the rows (the tile swizzled:
// tile_offset). The next 128 rows' loads are issued before this tile's stores, so a thread's
// loads are in flight while the block writes. Without that (one tile loaded, a barrier, stored,
// a barrier) the weight gradients' operands ran at about 1.9 TB/s and dgrad's weights at 2.5
// (run 36 and run 44).
#include <cuda_bf16.h>

#include <algorithm>

#include "common/launch.h"
#include "experts/rows.cuh"

namespace moe_comm {

constexpr int kGroupCols = 64;
constexpr int kGroupRows = 128;
constexpr int kGroupPitch = kGroupRows + 16;
constexpr int kColVecs = kGroupCols / 8;  // 8-channel vectors per row of the tile
constexpr int kTileLoads = kGroupRows * kColVecs / kTileThreads;  // a thread's loads per tile
constexpr int kTileStores = kGroupCols * kGroupRows / 16 / kTileThreads;
// Blocks an SM keeps resident: the prefetched loads take 80 registers a thread unbounded (3 blocks
// an SM); at 4, as many as the loop without the prefetch held.
constexpr int kTileBlocksPerSm = 4;
static_assert(kGroupRows == kTransposeRows && kColVecs == kTransposeVecs, "tile_offset's tile");
// Rows one block transposes at least, where an expert has them: each block restarts the loads'
// pipeline below.
constexpr int kGroupChunkRowsMin = 8 * kGroupRows;

// Rows one block transposes at most: the mean expert's rows (rounded up to whole tiles), so a
// balanced expert keeps one block per 64 channels and a hot one is split into blocks of the mean's
// size. A block once took all of its expert's rows: with skewed counts the hot expert's blocks were
// left running alone at the kernel's end (run 60: the first MoE layer of the backward took 0.92
// ms for dy where the second took 0.61; run 61, a hot expert of 8x the mean: h's columns 0.42 ->
// 0.20 ms in chunks). Dgrad's weights (uniform_rows): one chunk per expert.
static int64_t group_chunk_rows(const GroupColumnsArgs& a) {
  if (a.uniform_rows > 0) return a.uniform_rows;
  const int64_t mean = (a.row_stride + a.groups - 1) / a.groups;
  return std::max<int64_t>(kGroupChunkRowsMin, (mean + kGroupRows - 1) / kGroupRows * kGroupRows);
}

// Chunks of rows the grid covers at most: each expert's rows in chunks of chunk_rows, an expert
// without rows one empty chunk (its block still writes its scales).
static int64_t group_chunks_bound(const GroupColumnsArgs& a, int64_t chunk_rows) {
  if (a.uniform_rows > 0) return a.groups;
  return (a.row_stride + chunk_rows - 1) / chunk_rows + a.groups;
}

// Chunk `chunk` of the rows: its expert g, the expert's first row, the chunk's rows [start, end);
// false past the last chunk.
__device__ __forceinline__ bool group_chunk(const GroupColumnsArgs& a, int64_t chunk_rows, int64_t chunk, int& g,
                                            int64_t& first, int64_t& start, int64_t& end) {
  int64_t next = 0;
  for (g = 0; g < a.groups; ++g) {
    first = next;
    next = a.uniform_rows > 0 ? first + a.uniform_rows : a.offsets[g];
    const int64_t chunks = max((int64_t)1, (next - first + chunk_rows - 1) / chunk_rows);
    if (chunk < chunks) {
      start = first + chunk * chunk_rows;
      end = min(next, start + chunk_rows);
      return true;
    }
    chunk -= chunks;
  }
  return false;
}

// 8 channels of one row as loaded: 16 bytes of bf16, or 8 bytes of e4m3 in .x and .y.
__device__ __forceinline__ uint4 load_row8(const GroupColumnsArgs& a, int64_t r, int c) {
  if (a.bytes) {
    const uint2 v = *reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(a.x) + r * a.channels + c);
    return make_uint4(v.x, v.y, 0u, 0u);
  }
  return *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.x) + r * a.channels + c);
}

// Those 8 channels' e4m3 codes: bf16 quantised by the columns' scales (their reciprocals,
// fp8_inverse_scale), or e4m3 as it is.
__device__ __forceinline__ uint2 codes8(const GroupColumnsArgs& a, uint4 raw, const float* inv_scales) {
  if (a.bytes) return make_uint2(raw.x, raw.y);
  float f[8];
  bf16x8_to_floats(raw, f);
  uint32_t word[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t packed = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(f[4 * h + k] * inv_scales[4 * h + k], __NV_SATFINITE, __NV_E4M3);
      packed |= (uint32_t)q << (8 * k);
    }
    word[h] = packed;
  }
  return make_uint2(word[0], word[1]);
}

__global__ void __launch_bounds__(kTileThreads, kTileBlocksPerSm) group_columns_kernel(const GroupColumnsArgs a,
                                                                                         const int64_t chunk_rows) {
  __shared__ __align__(16) uint8_t tile[kGroupCols * kGroupPitch];
  __shared__ float inv_scales[kGroupCols];
  const int c0 = blockIdx.x * kGroupCols;
  int g;
  int64_t first, start, end;
  if (!group_chunk(a, chunk_rows, blockIdx.y, g, first, start, end)) return;
  uint8_t* q = a.q;
  if (a.uniform_rows > 0) q += g * a.channels * a.uniform_rows - first;  // this expert's own [channels, uniform_rows]
  if (!a.bytes && threadIdx.x < kGroupCols) {
    const int col = c0 + threadIdx.x;
    const float scale = col < a.channels ? fp8_scale(a.col_amax[g * a.amax_stride + col], kFp8MinAmaxSmall) : 1.f;
    inv_scales[threadIdx.x] = fp8_inverse_scale(scale);
    if (col < a.channels && start == first) {  // the expert's first chunk writes its scales
      const int per_half = a.channels / a.halves, h = col / per_half;
      a.scale[((int64_t)h * a.groups + g) * per_half + col % per_half] = scale;
    }
  }

  // Load i of a thread: row id / kColVecs of the tile, its vector id % kColVecs.
  auto loaded = [&](int64_t r0, int i, int64_t& r, int& v) {
    const int id = threadIdx.x + i * kTileThreads;
    r = r0 + id / kColVecs, v = id % kColVecs;
    return r < end && c0 + 8 * v < a.channels;
  };
  uint4 raw[kTileLoads];
  auto fetch = [&](int64_t r0) {
#pragma unroll
    for (int i = 0; i < kTileLoads; ++i) {
      int64_t r;
      int v;
      if (loaded(r0, i, r, v)) raw[i] = load_row8(a, r, c0 + 8 * v);
    }
  };
  if (start < end) fetch(start);
  __syncthreads();  // the scales
  for (int64_t r0 = start; r0 < end; r0 += kGroupRows) {
#pragma unroll
    for (int i = 0; i < kTileLoads; ++i) {
      int64_t r;
      int v;
      if (loaded(r0, i, r, v)) put8_in_tile<kGroupPitch>(tile, 8 * v, (int)(r - r0), codes8(a, raw[i], inv_scales + 8 * v));
    }
    __syncthreads();
    if (r0 + kGroupRows < end) fetch(r0 + kGroupRows);  // in flight during this tile's stores
#pragma unroll
    for (int i = 0; i < kTileStores; ++i) {
      const int id = threadIdx.x + i * kTileThreads;
      const int cl = id / (kGroupRows / 16), seg = id % (kGroupRows / 16);
      const int col = c0 + cl;
      const int64_t r = r0 + 16 * seg;
      if (col >= a.channels || r >= end) continue;
      uint8_t* out = q + (int64_t)col * a.row_stride + r;
      const uint8_t* from = tile + tile_offset<kGroupPitch>(cl, 16 * seg);
      if (r + 16 <= end && reinterpret_cast<uintptr_t>(out) % 16 == 0) {
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
  const int64_t chunk_rows = group_chunk_rows(a);
  // x: the column tiles, so that the blocks running together read neighbouring parts of the same
  // rows (with the chunks along x, e4m3 transposes ran 20% slower: run 62).
  const dim3 grid((a.channels + kGroupCols - 1) / kGroupCols, (unsigned)group_chunks_bound(a, chunk_rows));
  group_columns_kernel<<<grid, kTileThreads, 0, stream>>>(a, chunk_rows);
  MOE_COMM_CHECK_LAUNCH("fp8_group_columns");
}

}  // namespace moe_comm
