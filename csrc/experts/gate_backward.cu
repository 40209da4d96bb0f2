// The gate's backward, fused with the quantisation of its result. For h = silu(h1) * h3 and
// dh = dL/dh (the dgrad GEMM's bf16 output), in fp32:
//   dh1 = dh * h3 * s * (1 + h1 * (1 - s)),  s = sigmoid(h1)
//   dh3 = dh * silu(h1)
// dh13 = [dh1 | dh3] is quantised with one scale per row (the next dgrad GEMM's left operand,
// times its expert's W1|W3 row scales where given: experts.h) and also stored in bf16 times the
// row's input scale (where given: the experts' input rows' e4m3 scale, which the weight gradient
// then needs not apply to the rows), with h in bf16: the weight gradients' operands, whose
// (expert, channel) amax the same pass takes ([h | dh1 | dh3]). One read of h13 and dh per row;
// the next row's are in flight while the block reduces and stores this one (without that, 1.24 ms
// at the one-GPU recipe's layer, 1.57 TB/s: run 44).
#include <cuda_bf16.h>

#include "common/launch.h"
#include "experts/rows.cuh"

namespace moe_comm {

// Resident threads an SM keeps at least (128 registers a thread): the next row's three loads took
// 140 unbounded, three blocks of 128 an SM; at four, 2-3% faster than without them (runs 56-57).
constexpr int kGateBackwardThreadsPerSm = kThreadsPerSm / 4;

template <int kThreads>
__global__ void __launch_bounds__(kThreads, kGateBackwardThreadsPerSm / kThreads) gate_backward_kernel(const GateBackwardArgs a) {
  __shared__ float scratch[2 * kThreads / kWarpSize];
  BlockMax<kThreads> block_max{scratch};
  extern __shared__ float4 walk_s[];
  int64_t first, last;
  block_rows(rows_used(a.offsets, a.groups), first, last);
  ExpertWalk walk(a.offsets, a.channel_scale, 2 * a.inter, a.col_amax, 3 * a.inter, walk_s);
  const int vecs = a.inter / 8;
  // h1, h3 and dh of the next row are loaded while the block reduces and stores this one (rows.cuh).
  const uint4* h13 = static_cast<const uint4*>(a.h13);
  const uint4* dh = static_cast<const uint4*>(a.grad_h);
  RowPrefetch<kThreads, 3> rows{vecs};
  rows.fetch(first < last, {h13 + first * 2 * vecs, h13 + first * 2 * vecs + vecs, dh + first * vecs});
  for (int64_t row = first; row < last; ++row) {
    const VecSplit channel_scale = walk.enter(row);
    const float row_scale = a.row_scale ? a.row_scale[row] : 1.f;
    uint4 in[3][kRowVecs];  // h1, h3, dh
    const int64_t next = row + 1;
    rows.take(in, next < last, {h13 + next * 2 * vecs, h13 + next * 2 * vecs + vecs, dh + next * vecs});
    uint4* out_dh1 = static_cast<uint4*>(a.grad_h13) + row * 2 * vecs;
    uint4* out_dh3 = out_dh1 + vecs;
    uint4* out_h = static_cast<uint4*>(a.h) + row * vecs;
    float d1[kRowVecs][8], d3[kRowVecs][8];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kRowVecs; ++i) {
      const int v = threadIdx.x + i * kThreads;
      if (v < vecs) {
        float gate[8], up[8], grad[8], h[8];
        bf16x8_to_floats(in[0][i], gate);
        bf16x8_to_floats(in[1][i], up);
        bf16x8_to_floats(in[2][i], grad);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float s = sigmoid(gate[e]);
          const float act = gate[e] * s;
          d1[i][e] = grad[e] * up[e] * s * (1.f + gate[e] * (1.f - s));
          d3[i][e] = grad[e] * act;
          h[e] = act * up[e];
        }
        float w1[8], w3[8];  // what the weight gradients take: dh13 times the input row's scale
#pragma unroll
        for (int e = 0; e < 8; ++e) w1[e] = d1[i][e] * row_scale, w3[e] = d3[i][e] * row_scale;
        out_dh1[v] = floats_to_bf16x8(w1);
        out_dh3[v] = floats_to_bf16x8(w3);
        out_h[v] = floats_to_bf16x8(h);
        walk.take8(h, v);
        walk.take8(w1, vecs + v);
        walk.take8(w3, 2 * vecs + v);
        scale8(d1[i], channel_scale, v);
        scale8(d3[i], channel_scale, vecs + v);
        amax = fmaxf(amax, fmaxf(amax8(d1[i]), amax8(d3[i])));
      }
    }
    const float scale = fp8_scale(block_max.of(amax), kFp8MinAmaxSmall);
    const float inv_scale = fp8_inverse_scale(scale);
    uint2* q1 = reinterpret_cast<uint2*>(a.q + row * 2 * a.inter);
    uint2* q3 = q1 + vecs;
#pragma unroll
    for (int i = 0; i < kRowVecs; ++i) {
      const int v = threadIdx.x + i * kThreads;
      if (v < vecs) {
        q1[v] = fp8_quantise_floats8(d1[i], inv_scale);
        q3[v] = fp8_quantise_floats8(d3[i], inv_scale);
      }
    }
    if (threadIdx.x == 0) a.scale[row] = scale;
  }
  walk.finish();
}

void launch_gate_backward(const GateBackwardArgs& a, int64_t rows, int sm_count, cudaStream_t stream) {
  const size_t smem = ExpertWalk::smem_bytes(a.channel_scale, 2 * a.inter, a.col_amax, 3 * a.inter);  // <= 160 KiB
  with_row_threads<kRowVecs>(a.inter / 8, [&](auto threads) {
    constexpr int kThreads = decltype(threads)::value;
    const int blocks = walk_blocks(gate_backward_kernel<kThreads>, kThreads, smem, rows, sm_count);
    gate_backward_kernel<kThreads><<<blocks, kThreads, smem, stream>>>(a);
  });
  MOE_COMM_CHECK_LAUNCH("fp8_gate_backward");
}

}  // namespace moe_comm
