// Weights for the dgrad GEMMs: [experts, rows, cols] transposed to [experts, cols, rows] e4m3,
// with one scale per column of the original (an output channel of dgrad), taken from the
// column amax the forward's pass (weights.cu) recorded. FP8 tensor cores take both operands
// K-major, so dgrad's right operand must be this transposed copy; one pass over the parameters,
// in the backward (the forward's copy is not kept: under FSDP the weights are gathered again).
//
// A block transposes a tile of kTileRows x kTileCols through shared memory: loads along the
// columns, stores along the rows, 16 bytes a thread each way (the tile swizzled: tile_offset).
#include <cuda_bf16.h>

#include "common/launch.h"
#include "experts/rows.cuh"

namespace moe_comm {

constexpr int kTileRows = 128;   // of the original: the transposed copy's row length per tile
constexpr int kTileCols = 64;
constexpr int kTilePitch = kTileRows + 16;  // bytes per transposed row in shared memory
static_assert(kTileRows == kTransposeRows && kTileCols / 8 == kTransposeVecs, "tile_offset's tile");

__global__ void __launch_bounds__(kRowThreads) weights_transposed_kernel(const WeightsTransposedArgs a) {
  __shared__ __align__(16) uint8_t tile[kTileCols * kTilePitch];
  __shared__ float scales[kTileCols];
  const int e = blockIdx.z, rows = a.rows_a + a.rows_b;
  const int n0 = blockIdx.y * kTileRows, c0 = blockIdx.x * kTileCols;
  if (threadIdx.x < kTileCols) {
    const int c = c0 + threadIdx.x;
    const float scale = c < a.cols ? fp8_scale(a.col_amax[(int64_t)e * a.cols + c], kFp8MinAmaxSmall) : 1.f;
    scales[threadIdx.x] = scale;
    if (blockIdx.y == 0 && c < a.cols) a.scale[(int64_t)e * a.cols + c] = scale;
  }
  __syncthreads();
  constexpr int kLoads = kTileRows * kTileCols / 8 / kRowThreads;
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int id = threadIdx.x + i * kRowThreads;
    const int r = id / (kTileCols / 8), cv = id % (kTileCols / 8);
    const int n = n0 + r, c = c0 + 8 * cv;
    if (n >= rows || c >= a.cols) continue;
    const bool in_a = n < a.rows_a;
    const int64_t base =
        in_a ? ((int64_t)e * a.rows_a + n) * a.cols : ((int64_t)e * a.rows_b + n - a.rows_a) * a.cols;
    float f[8];
    load8(in_a ? a.a : a.b, a.fp32, base + c, f);
    const int at = tile_offset<kTilePitch>(8 * cv, r);  // channel 8cv + k's byte at at + k * kTilePitch
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(f[k] / scales[8 * cv + k], __NV_SATFINITE, __NV_E4M3);
      tile[at + k * kTilePitch] = q;
    }
  }
  __syncthreads();
  constexpr int kStores = kTileCols * kTileRows / 16 / kRowThreads;
#pragma unroll
  for (int i = 0; i < kStores; ++i) {
    const int id = threadIdx.x + i * kRowThreads;
    const int cl = id / (kTileRows / 16), seg = id % (kTileRows / 16);
    const int c = c0 + cl, n = n0 + 16 * seg;
    if (c >= a.cols || n >= rows) continue;
    uint8_t* out = a.q + ((int64_t)e * a.cols + c) * rows + n;
    const uint8_t* from = tile + tile_offset<kTilePitch>(cl, 16 * seg);
    if (n + 16 <= rows) {
      *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(from);
    } else {
      for (int k = 0; k < rows - n; ++k) out[k] = from[k];
    }
  }
}

void launch_weights_transposed(const WeightsTransposedArgs& a, cudaStream_t stream) {
  const int rows = a.rows_a + a.rows_b;
  if (a.experts == 0 || rows == 0 || a.cols == 0) return;
  const dim3 grid((a.cols + kTileCols - 1) / kTileCols, (rows + kTileRows - 1) / kTileRows, a.experts);
  weights_transposed_kernel<<<grid, kRowThreads, 0, stream>>>(a);
  MOE_COMM_CHECK_LAUNCH("fp8_weights_transposed");
}

}  // namespace moe_comm
