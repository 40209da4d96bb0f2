// Expand: the arrived rows, laid out expert-major for TorchTitan's grouped GEMM.
//
// A local kernel over the whole GPU, launched after a dispatch-like communication kernel has
// seen every row arrive. Each warp takes one received slot: the token's row (from the own
// rank's tokens, or from the `rows` buffer a peer filled) is copied to the row of each of its
// picks on this rank, and every expert segment's alignment padding is zeroed.
//
// Forward (dispatch): plain copies into recv_x.
// Backward (of combine), for out[t] = sum_k w[t,k] * y[row(t,k)]:
//   grad_y[row(t,k)] = w[t,k] * grad_out[t]
//   grad_w[t,k]      = <grad_out[t], y[row(t,k)]>, stored on the token's rank: directly for
//                      the own rank, through NVLink with a flag for the others (collected by
//                      collect_grad_w.cu).
#include <cuda_bf16.h>

#include "buffers.h"
#include "common.cuh"
#include "launch.h"

namespace moe_comm {

template <typename T, bool kBackward>
__global__ void __launch_bounds__(kLocalThreadsPerBlock, kLocalBlocksPerSM)
    expand_kernel(const Buffers buf, const ExpandArgs a) {
  const int lane = threadIdx.x % kWarpSize;
  const int warps = gridDim.x * kLocalWarpsPerBlock;
  const int warp = blockIdx.x * kLocalWarpsPerBlock + threadIdx.x / kWarpSize;
  const int world = buf.world, rank = buf.rank;
  const int K = a.top_k, L = a.local_experts;
  const RecvInfo info{world, L};
  const int row_stride = buf.max_row_bytes / 16;
  uint4* out = static_cast<uint4*>(a.out);

  // Alignment padding of every expert segment feeds the grouped GEMM: zero it.
  for (int e = warp; e < L; e += warps) {
    const int count = a.recv_info[info.count(e)];
    const int start = a.recv_info[info.seg_start(e)];
    const int pad_end = min(start + round_up(count, a.align), a.capacity);
    for (int row = max(start + count, 0); row < pad_end; ++row) {
      for (int v = lane; v < a.row_vecs; v += kWarpSize) out[(int64_t)row * a.row_vecs + v] = make_uint4(0, 0, 0, 0);
    }
  }

  const SlotOrder order(a.recv_info + info.slots_from(0), 1, rank, world, false);
  const uint4* own_rows = static_cast<const uint4*>(a.own_rows);
  for (int i = warp; i < order.total(); i += warps) {
    int s, j;
    order.locate(i, s, j);
    const int64_t slot_index = (int64_t)s * buf.max_tokens + j;
    const int token = a.slot_token[slot_index];
    const uint4* src = s == rank ? own_rows + (int64_t)token * a.row_vecs
                                 : reinterpret_cast<const uint4*>(buf.rows) + slot_index * row_stride;
    const SlotRows r = load_slot_rows(a.slot_rows, a.slot_w, slot_index, K, a.capacity, lane);
    if constexpr (!kBackward) {
      uint4* dst[kMaxTopK];
#pragma unroll
      for (int k = 0; k < kMaxTopK; ++k) dst[k] = r.row[k] >= 0 ? out + (int64_t)r.row[k] * a.row_vecs : nullptr;
      copy_row(src, dst, a.row_vecs, lane);
    } else {
      constexpr int kElems = Vec<T>::kElems;
      const uint4* y = static_cast<const uint4*>(a.y);
      float dots[kMaxTopK] = {};
      for (int v = lane; v < a.row_vecs; v += kWarpSize) {
        const uint4 g = src[v];
        float gf[kElems] = {};
        accumulate<T>(gf, g, 1.f);
#pragma unroll
        for (int k = 0; k < kMaxTopK; ++k) {
          if (r.row[k] < 0) continue;
          out[(int64_t)r.row[k] * a.row_vecs + v] = pack<T>(gf, r.weight[k]);
          dots[k] += dot16<T>(g, __ldg(y + (int64_t)r.row[k] * a.row_vecs + v));
        }
      }
      float* grad_w_home = s == rank ? a.grad_w + (int64_t)token * K : buf.peer_grad_w[s] + (int64_t)token * kMaxTopK;
#pragma unroll
      for (int k = 0; k < kMaxTopK; ++k) {
        if (r.row[k] < 0) continue;  // warp-uniform
        const float dot = warp_sum(dots[k]);
        if (lane == 0) grad_w_home[k] = dot;
      }
      if (s != rank) {
        // The tag of the combine_backward call that moved these rows (it bumped the counter).
        publish_flag(buf.peer_grad_w_flag[s] + (int64_t)rank * buf.max_tokens + token, buf.calls[kDispatchLikeCalls],
                     lane);
      }
    }
  }
}

void launch_expand(const Buffers& buf, const ExpandArgs& args, bool bf16, bool backward, cudaStream_t stream) {
  void* params[] = {const_cast<Buffers*>(&buf), const_cast<ExpandArgs*>(&args)};
  const void* fn;
  if (backward) {
    fn = bf16 ? reinterpret_cast<const void*>(expand_kernel<__nv_bfloat16, true>)
              : reinterpret_cast<const void*>(expand_kernel<float, true>);
  } else {
    // A forward copy moves raw bytes: one instantiation serves every dtype.
    fn = reinterpret_cast<const void*>(expand_kernel<float, false>);
  }
  launch_local(fn, params, stream, "expand");
}

}  // namespace moe_comm
