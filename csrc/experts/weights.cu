// Weights for the forward GEMMs: [experts, rows, cols] (fp32 parameters at world 1, bf16 under
// FSDP) to e4m3 with one scale per row (a row of W1/W3 or W2 is one output channel of its GEMM),
// once per forward call, straight from the parameters. The same pass takes each column's amax,
// which the backward's transposed copy (weights_transposed.cu) scales by, so that copy needs
// one pass too.
//
// A warp quantises kRowsTogether rows side by side, with no block barrier in its loop: it reads
// them once for their amax and their columns' (a load of each row in flight at once), reduces
// each row's amax over the warp, and reads them again, now from L2, to quantise. The columns'
// amax gathers in shared memory, stored channel-in-vector major (channel k of vector v at
// k * vecs + v) so that a warp's 32 atomics land on 32 banks, and reaches col_amax with one
// atomicMax per column per block (non-negative floats order as their bits do). A block with
// one row per pass and a barrier per row left the loads of only one row in flight, which held
// the kernel at about a quarter of HBM's rate (results/h200x1/README.md, run 22).
#include <cuda_bf16.h>

#include "common/launch.h"
#include "experts/rows.cuh"

namespace moe_comm {

constexpr int kRowsTogether = 4;  // rows a warp reads side by side: the loads a lane has in flight
constexpr int kWarpGroups = 2;    // such groups per warp, one after the other
constexpr int kBlockRows = kRowThreads / kWarpSize * kRowsTogether * kWarpGroups;  // 64 rows a block
static_assert(16 % kRowsTogether == 0, "rows come in multiples of 16: a group never straddles a and b or the end");

__global__ void __launch_bounds__(kRowThreads) weights_kernel(const WeightsArgs a) {
  extern __shared__ int col_amax_s[];  // [8][vecs], the bits of non-negative floats
  const int e = blockIdx.y, rows = a.rows_a + a.rows_b, vecs = a.cols / 8;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  for (int i = threadIdx.x; i < a.cols; i += kRowThreads) col_amax_s[i] = 0;
  __syncthreads();
  for (int g = 0; g < kWarpGroups; ++g) {
    const int n0 = blockIdx.x * kBlockRows + (g * (kRowThreads / kWarpSize) + warp) * kRowsTogether;
    if (n0 >= rows) break;
    const bool in_a = n0 < a.rows_a;
    const void* src = in_a ? a.a : a.b;
    const int64_t base =
        in_a ? ((int64_t)e * a.rows_a + n0) * a.cols : ((int64_t)e * a.rows_b + n0 - a.rows_a) * a.cols;
    float amax[kRowsTogether] = {};
    for (int v = lane; v < vecs; v += kWarpSize) {
      float f[kRowsTogether][8];
#pragma unroll
      for (int r = 0; r < kRowsTogether; ++r) load8(src, a.fp32, base + (int64_t)r * a.cols + 8 * v, f[r]);
#pragma unroll
      for (int r = 0; r < kRowsTogether; ++r) amax[r] = fmaxf(amax[r], amax8(f[r]));
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        float m = 0.f;
#pragma unroll
        for (int r = 0; r < kRowsTogether; ++r) m = fmaxf(m, fabsf(f[r][c]));
        atomicMax(col_amax_s + c * vecs + v, __float_as_int(m));
      }
    }
    float scale[kRowsTogether];
#pragma unroll
    for (int r = 0; r < kRowsTogether; ++r) scale[r] = fp8_scale(warp_max(amax[r]), kFp8MinAmaxSmall);
    const int64_t row0 = (int64_t)e * rows + n0;
    for (int v = lane; v < vecs; v += kWarpSize) {
      float f[kRowsTogether][8];
#pragma unroll
      for (int r = 0; r < kRowsTogether; ++r) load8(src, a.fp32, base + (int64_t)r * a.cols + 8 * v, f[r]);
#pragma unroll
      for (int r = 0; r < kRowsTogether; ++r) {
        reinterpret_cast<uint2*>(a.q + (row0 + r) * a.cols)[v] = fp8_quantise_floats8(f[r], scale[r]);
      }
    }
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kRowsTogether; ++r) a.scale[row0 + r] = scale[r];
    }
  }
  __syncthreads();
  int* col_amax = reinterpret_cast<int*>(a.col_amax + (int64_t)e * a.cols);
  for (int i = threadIdx.x; i < a.cols; i += kRowThreads) atomicMax(col_amax + 8 * (i % vecs) + i / vecs, col_amax_s[i]);
}

void launch_weights(const WeightsArgs& a, cudaStream_t stream) {
  const int rows = a.rows_a + a.rows_b;
  if (a.experts == 0 || rows == 0) return;
  const dim3 grid((rows + kBlockRows - 1) / kBlockRows, a.experts);
  weights_kernel<<<grid, kRowThreads, a.cols * sizeof(int), stream>>>(a);
  MOE_COMM_CHECK_LAUNCH("fp8_weights");
}

}  // namespace moe_comm
