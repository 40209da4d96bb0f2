// Finalize: each of this rank's tokens gets its combined row, the partial sums from the ranks
// of its node (pushed here by combine, or staged here by this rank's own reduce) plus the rows
// that came home from other nodes, added in fp32 and stored once in the model dtype. A local
// kernel over the whole GPU, after the combine kernel saw every partial arrive. Tokens whose
// experts all live on this rank never left it: reduce already wrote them (stays_home).
#include <cuda_bf16.h>

#include "common/copy.cuh"
#include "common/launch.h"
#include "common/vec.cuh"
#include "layout/layout.h"
#include "layout/slots.cuh"

namespace moe_comm {

// Most partial rows one token adds up: one per rank of its node, one per other node.
constexpr int kMaxSources = kMaxRanksPerNode + kMaxTopK;

// The rows one token adds up, in a fixed order: ranks of the node by local index, then nodes.
struct TokenSources {
  const uint4* row[kMaxSources];
  int count = 0;
};

// rank_pos and send_idx of token `tok` turned into row pointers (warp-uniform). This rank's
// own tokens lead every partition it forwards, so the token's recv slot at rank h is its plan
// position there.
__device__ __forceinline__ TokenSources token_sources(const Buffers& b, const FinalizeArgs& a, int tok, int lane,
                                                      int row_stride_bytes, const uint8_t* own_rows,
                                                      const uint8_t* pushed, const uint8_t* home, int home_stride) {
  const Topology& t = b.topo;
  const int G = t.local_size, N = t.nodes;
  const int pos = lane < G ? a.rank_pos[(int64_t)tok * G + lane] : -1;
  const int send = lane < N ? a.send_idx[(int64_t)tok * N + lane] : -1;
  TokenSources s;
  for (int h = 0; h < G; ++h) {
    const int p = __shfl_sync(0xffffffffu, pos, h);
    if (p < 0 || p >= b.cap.fwd_slots) continue;  // beyond capacity: not delivered, the host raises
    const int64_t slot = (int64_t)h * b.cap.fwd_slots + p;
    const uint8_t* base = h == t.local ? own_rows : pushed;
    s.row[s.count++] = reinterpret_cast<const uint4*>(base + slot * row_stride_bytes);
  }
  for (int m = 0; m < N; ++m) {
    const int idx = __shfl_sync(0xffffffffu, send, m);
    if (idx >= 0 && s.count < kMaxSources) s.row[s.count++] = reinterpret_cast<const uint4*>(home + (int64_t)idx * home_stride);
  }
  return s;
}

template <typename T>
__global__ void __launch_bounds__(kLocalThreads, kLocalBlocksPerSM)
    finalize_kernel(const Buffers* __restrict__ buffers, const FinalizeArgs a) {
  const Buffers& b = *buffers;
  constexpr int kElems = Vec<T>::kElems;
  const int lane = threadIdx.x % kWarpSize;
  const int warps = gridDim.x * kLocalWarps;
  const Peer& me = b.peer[b.topo.local];
  uint4* out = static_cast<uint4*>(a.out);
  const RowSplit split(a.num_tokens, warps);
  for (int item = blockIdx.x * kLocalWarps + threadIdx.x / kWarpSize; item < a.num_tokens * split.parts;
       item += warps) {
    const int tok = item / split.parts;
    if (stays_home(b.topo, a.rank_pos, a.send_idx, tok, lane)) continue;
    const TokenSources s = token_sources(b, a, tok, lane, b.cap.row_bytes, me.fwd_rows, me.fwd_partials, b.home_rows,
                                         b.cap.row_bytes);
    int begin, end;
    split.range(item % split.parts, a.row_vecs, begin, end);
    for (int v = begin + lane; v < end; v += kWarpSize) {
      float acc[kElems] = {};
      int q = 0;
      for (; q + 1 < s.count; q += 2) {  // two sources' loads in flight together
        const uint4 first = s.row[q][v], second = s.row[q + 1][v];
        accumulate<T>(acc, first, 1.f);
        accumulate<T>(acc, second, 1.f);
      }
      if (q < s.count) accumulate<T>(acc, s.row[q][v], 1.f);
      out[(int64_t)tok * a.row_vecs + v] = pack<T>(acc, 1.f);
    }
  }
}

void launch_finalize(const Buffers& b, const FinalizeArgs& a, bool bf16, cudaStream_t stream) {
  const int blocks = warp_blocks((long long)a.num_tokens * kMaxRowParts, b.sm_count);
  if (blocks == 0) return;
  if (bf16) {
    finalize_kernel<__nv_bfloat16><<<blocks, kLocalThreads, 0, stream>>>(b.on_device, a);
  } else {
    finalize_kernel<float><<<blocks, kLocalThreads, 0, stream>>>(b.on_device, a);
  }
  MOE_COMM_CHECK_LAUNCH("finalize");
}

// The routing-weight gradients of this rank's tokens: every rank's vector for the token (zero
// for the picks it does not hold) added up, from the node's ranks and from the other nodes.
__global__ void __launch_bounds__(kLocalThreads) gather_grad_w_kernel(const Buffers* __restrict__ buffers, const FinalizeArgs a) {
  const Buffers& b = *buffers;
  const int lane = threadIdx.x % kWarpSize;
  const int warps = gridDim.x * kLocalWarps;
  const Peer& me = b.peer[b.topo.local];
  const uint8_t* grads = reinterpret_cast<const uint8_t*>(me.fwd_grad_w);
  const int stride = kMaxTopK * sizeof(float);
  float* out = static_cast<float*>(a.out);
  for (int tok = blockIdx.x * kLocalWarps + threadIdx.x / kWarpSize; tok < a.num_tokens; tok += warps) {
    const TokenSources s = token_sources(b, a, tok, lane, stride, grads, grads,
                                         reinterpret_cast<const uint8_t*>(b.home_grad_w), stride);
    if (lane < a.top_k) {
      float acc = 0.f;
      for (int q = 0; q < s.count; ++q) acc += reinterpret_cast<const float*>(s.row[q])[lane];
      out[(int64_t)tok * a.top_k + lane] = acc;
    }
  }
}

void launch_gather_grad_w(const Buffers& b, const FinalizeArgs& a, cudaStream_t stream) {
  const int blocks = warp_blocks(a.num_tokens, b.sm_count);
  if (blocks == 0) return;
  gather_grad_w_kernel<<<blocks, kLocalThreads, 0, stream>>>(b.on_device, a);
  MOE_COMM_CHECK_LAUNCH("gather_grad_w");
}

}  // namespace moe_comm
