// Weights for the dgrad GEMMs: the forward's e4m3 codes (weights.cu) [experts, rows, cols]
// transposed byte for byte to [experts, cols, rows]. FP8 tensor cores take both operands K-major,
// so dgrad's right operand must be this transposed copy; its scales are the forward's row scales,
// which the backward folds into dgrad's left operand (quantise_rows.cu, gate_backward.cu), so
// this is a copy of 1 byte per weight each way instead of a second quantisation of the
// parameters (4 bytes per weight read at world 1).
//
// A block transposes a tile of kTileRows x kTileCols through shared memory: loads of 8 bytes
// along the columns, stores of 16 along the rows (the tile swizzled: tile_offset).
#include <cuda_bf16.h>

#include "common/launch.h"
#include "experts/rows.cuh"

namespace moe_comm {

constexpr int kTileRows = 128;   // of the original: the transposed copy's row length per tile
constexpr int kTileCols = 64;
constexpr int kTilePitch = kTileRows + 16;  // bytes per transposed row in shared memory
static_assert(kTileRows == kTransposeRows && kTileCols / 8 == kTransposeVecs, "tile_offset's tile");

__global__ void __launch_bounds__(kTileThreads) weights_transposed_kernel(const WeightsTransposedArgs a) {
  __shared__ __align__(16) uint8_t tile[kTileCols * kTilePitch];
  const int e = blockIdx.z;
  const int n0 = blockIdx.y * kTileRows, c0 = blockIdx.x * kTileCols;
  constexpr int kLoads = kTileRows * kTileCols / 8 / kTileThreads;
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int id = threadIdx.x + i * kTileThreads;
    const int r = id / (kTileCols / 8), cv = id % (kTileCols / 8);
    const int n = n0 + r, c = c0 + 8 * cv;
    if (n >= a.rows || c >= a.cols) continue;
    const uint2 v = *reinterpret_cast<const uint2*>(a.q + ((int64_t)e * a.rows + n) * a.cols + c);
    put8_in_tile<kTilePitch>(tile, 8 * cv, r, v);
  }
  __syncthreads();
  constexpr int kStores = kTileCols * kTileRows / 16 / kTileThreads;
#pragma unroll
  for (int i = 0; i < kStores; ++i) {
    const int id = threadIdx.x + i * kTileThreads;
    const int cl = id / (kTileRows / 16), seg = id % (kTileRows / 16);
    const int c = c0 + cl, n = n0 + 16 * seg;
    if (c >= a.cols || n >= a.rows) continue;  // rows are whole 16s (the op checks)
    *reinterpret_cast<uint4*>(a.out + ((int64_t)e * a.cols + c) * a.rows + n) =
        *reinterpret_cast<const uint4*>(tile + tile_offset<kTilePitch>(cl, 16 * seg));
  }
}

void launch_weights_transposed(const WeightsTransposedArgs& a, cudaStream_t stream) {
  if (a.experts == 0 || a.rows == 0 || a.cols == 0) return;
  const dim3 grid((a.cols + kTileCols - 1) / kTileCols, (a.rows + kTileRows - 1) / kTileRows, a.experts);
  weights_transposed_kernel<<<grid, kTileThreads, 0, stream>>>(a);
  MOE_COMM_CHECK_LAUNCH("fp8_weights_transposed");
}

}  // namespace moe_comm
