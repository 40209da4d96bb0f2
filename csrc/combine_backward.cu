// Backward of combine: a dispatch of the output gradient along the forward's routes.
//
// For out[t] = sum_k w[t,k] * y[row(t,k)]:
//   grad_y[row(t,k)] = w[t,k] * grad_out[t]      (written where the expert lives)
//   grad_w[t,k]      = <grad_out[t], y[row(t,k)]> (computed where the expert lives, sent home)
// One cooperative launch, three roles at once:
//   senders     push grad_out rows to the slots the forward dispatch assigned (once per rank);
//   expanders   for every arrived slot: scaled copies into grad_y, dot products with the saved
//               expert outputs, and the routing-weight gradients stored back on the token's rank;
//               they also zero the alignment padding of grad_y;
//   collectors  wait for the routing-weight gradients of this rank's tokens from other ranks.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include "buffers.h"
#include "common.cuh"
#include "launch.h"

namespace cg = cooperative_groups;

namespace moe_comm {

template <typename T>
__global__ void __launch_bounds__(kThreadsPerBlock, 1)
    combine_backward_kernel(const Buffers buf, const CombineBackwardArgs a) {
  cg::grid_group grid = cg::this_grid();
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int world = buf.world, rank = buf.rank;
  const int K = a.top_k, L = a.num_experts / world;
  const uint32_t tag = buf.calls[kDispatchLikeCalls] + 1;
  const int row_stride = buf.max_row_bytes / 16;
  constexpr int kElems = Vec<T>::kElems;
  const RecvInfo info{world, L};
  const int expander_warps = kWarpsPerBlock - a.sender_warps - a.collector_warps;

  if (warp < a.sender_warps) {
    const int senders = gridDim.x * a.sender_warps;
    const int sender = blockIdx.x * a.sender_warps + warp;
    const uint4* grad_out = static_cast<const uint4*>(a.grad_out);
    for (int t = sender; t < a.num_tokens; t += senders) {
      const int my_slot = lane < world ? a.token_slot[(int64_t)t * world + lane] : -1;
      uint4* dst[kMaxRanks];
      peer_row_destinations(dst, buf.peer_rows, my_slot, world, rank, buf.max_tokens, row_stride);
      copy_row(grad_out + (int64_t)t * a.row_vecs, dst, a.row_vecs, lane);
      __threadfence_system();
      __syncwarp();
      if (lane < world && lane != rank && my_slot >= 0) {
        store_release_sys(buf.peer_slot_flag[lane] + (int64_t)rank * buf.max_tokens + my_slot, tag);
      }
    }
  } else if (warp < a.sender_warps + expander_warps) {
    const int expanders = gridDim.x * expander_warps;
    const int expander = blockIdx.x * expander_warps + (warp - a.sender_warps);
    uint4* grad_y = static_cast<uint4*>(a.grad_y);
    // Zero the alignment padding of every expert segment.
    for (int e = expander; e < L; e += expanders) {
      const int count = a.recv_info[info.count(e)];
      const int start = a.recv_info[info.seg_start(e)];
      const int pad_end = min(start + round_up(count, a.align), a.capacity);
      for (int row = start + count; row < pad_end; ++row) {
        for (int v = lane; v < a.row_vecs; v += kWarpSize) grad_y[(int64_t)row * a.row_vecs + v] = make_uint4(0, 0, 0, 0);
      }
    }
    int slot_prefix[kMaxRanks + 1];
    slot_prefix[0] = 0;
    for (int q = 0; q < world; ++q) slot_prefix[q + 1] = slot_prefix[q] + a.recv_info[info.slots_from((rank + q) % world)];
    const uint4* grad_out = static_cast<const uint4*>(a.grad_out);
    const uint4* y = static_cast<const uint4*>(a.y);
    for (int i = expander; i < slot_prefix[world]; i += expanders) {
      int q = 0;
      while (i >= slot_prefix[q + 1]) ++q;
      const int s = (rank + q) % world;
      const int j = i - slot_prefix[q];
      const int64_t slot_index = (int64_t)s * buf.max_tokens + j;
      const int token = a.slot_token[slot_index];
      const uint4* src;
      if (s == rank) {
        src = grad_out + (int64_t)token * a.row_vecs;
      } else {
        wait_flag(buf.slot_flag + slot_index, tag);
        src = reinterpret_cast<const uint4*>(buf.rows) + slot_index * row_stride;
      }
      int row = -1;
      float weight = 0.f;
      if (lane < K) {
        row = a.slot_rows[slot_index * K + lane];
        weight = a.slot_w[slot_index * K + lane];
      }
      int rows[kMaxTopK];
      float weights[kMaxTopK];
      float dots[kMaxTopK];
#pragma unroll
      for (int k = 0; k < kMaxTopK; ++k) {
        const int rk = __shfl_sync(0xffffffffu, row, k < K ? k : 0);
        weights[k] = __shfl_sync(0xffffffffu, weight, k < K ? k : 0);
        rows[k] = (k < K && rk >= 0 && rk < a.capacity) ? rk : -1;
        dots[k] = 0.f;
      }
      for (int v = lane; v < a.row_vecs; v += kWarpSize) {
        const uint4 g = src[v];
        float gf[kElems] = {};
        accumulate<T>(gf, g, 1.f);
#pragma unroll
        for (int k = 0; k < kMaxTopK; ++k) {
          if (rows[k] < 0) continue;
          grad_y[(int64_t)rows[k] * a.row_vecs + v] = pack<T>(gf, weights[k]);
          dots[k] += dot16<T>(g, __ldg(y + (int64_t)rows[k] * a.row_vecs + v));
        }
      }
      float* grad_w_home = s == rank ? nullptr : buf.peer_grad_w[s] + (int64_t)token * kMaxTopK;
#pragma unroll
      for (int k = 0; k < kMaxTopK; ++k) {
        if (rows[k] < 0) continue;  // warp-uniform
        const float dot = warp_sum(dots[k]);
        if (lane == 0) {
          if (s == rank) {
            a.grad_w[(int64_t)token * K + k] = dot;
          } else {
            grad_w_home[k] = dot;
          }
        }
      }
      if (s != rank) publish_flag(buf.peer_grad_w_flag[s] + (int64_t)rank * buf.max_tokens + token, tag, lane);
    }
  } else {
    const int collectors = gridDim.x * a.collector_warps;
    const int collector = blockIdx.x * a.collector_warps + (warp - a.sender_warps - expander_warps);
    // One lane per pick: a pick on another rank waits for that rank's flag, then copies.
    for (int base = collector * kWarpSize; base < a.num_tokens * K; base += collectors * kWarpSize) {
      const int i = base + lane;
      if (i >= a.num_tokens * K) continue;
      const int t = i / K;
      const int64_t expert = a.topk_idx[i];
      if (expert < 0 || expert >= a.num_experts) {
        a.grad_w[i] = 0.f;  // the forward flagged this pick as an error; nothing to route
        continue;
      }
      const int d = (int)(expert / L);
      if (d == rank) continue;  // written by this rank's expanders
      wait_flag(buf.grad_w_flag + (int64_t)d * buf.max_tokens + t, tag);
      a.grad_w[i] = buf.grad_w[(int64_t)t * kMaxTopK + i % K];
    }
  }

  grid.sync();
  if (blockIdx.x == 0 && threadIdx.x == 0) buf.calls[kDispatchLikeCalls] = tag;
}

void launch_combine_backward(const Buffers& buf, const CombineBackwardArgs& args, bool bf16, int num_blocks,
                             cudaStream_t stream) {
  void* params[] = {const_cast<Buffers*>(&buf), const_cast<CombineBackwardArgs*>(&args)};
  const void* fn = bf16 ? reinterpret_cast<const void*>(combine_backward_kernel<__nv_bfloat16>)
                        : reinterpret_cast<const void*>(combine_backward_kernel<float>);
  launch_cooperative(fn, num_blocks, 0, params, stream, "combine_backward");
}

}  // namespace moe_comm
