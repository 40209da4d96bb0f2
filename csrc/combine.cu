// Combine, the communication half: each rank's staged partial sums (reduce.cu) go back to
// their tokens' ranks and are added up there.
//
// One cooperative launch of `num_blocks` blocks, two roles at once:
//   pushers     for slots that came from another rank: copy the staged partial into that
//               rank's `partials` buffer at the token's index, then release a flag;
//   finalizers  for this rank's tokens: the own rank's staged partial plus each other rank's
//               partial once its flag is up, accumulated in fp32; one store in the output
//               dtype.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include "buffers.h"
#include "common.cuh"
#include "launch.h"

namespace cg = cooperative_groups;

namespace moe_comm {

// Loads in flight per lane while a pusher copies one partial row to its peer: with a single
// destination the registers allow twice copy_row's default.
constexpr int kPushUnroll = 2 * kCopyUnroll;

template <typename T>
__global__ void __launch_bounds__(kThreadsPerBlock, 1)
    combine_kernel(const Buffers buf, const CombineArgs a) {
  cg::grid_group grid = cg::this_grid();
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int world = buf.world, rank = buf.rank;
  const uint32_t tag = buf.calls[kCombineLikeCalls] + 1;
  const int row_stride = buf.max_row_bytes / 16;
  const uint4* staged = reinterpret_cast<const uint4*>(buf.rows);

  if (warp < a.pusher_warps) {
    const int pushers = gridDim.x * a.pusher_warps;
    const int pusher = blockIdx.x * a.pusher_warps + warp;
    const SlotOrder order(a.recv_info + RecvInfo{world, 0}.slots_from(0), 1, rank, world, true);
    for (int i = pusher; i < order.total(); i += pushers) {
      int s, j;
      order.locate(i, s, j);
      const int64_t slot_index = (int64_t)s * buf.max_tokens + j;
      const int token = a.slot_token[slot_index];
      uint4* const dst[1] = {reinterpret_cast<uint4*>(buf.peer_partials[s]) +
                             ((int64_t)rank * buf.max_tokens + token) * row_stride};
      copy_row<1, kPushUnroll>(staged + slot_index * row_stride, dst, a.row_vecs, lane);
      publish_flag(buf.peer_partial_flag[s] + (int64_t)rank * buf.max_tokens + token, tag, lane);
    }
  } else {
    constexpr int kElems = Vec<T>::kElems;
    const int finalizers = gridDim.x * (kWarpsPerBlock - a.pusher_warps);
    const int finalizer = blockIdx.x * (kWarpsPerBlock - a.pusher_warps) + (warp - a.pusher_warps);
    const uint4* partials = reinterpret_cast<const uint4*>(buf.partials);
    uint4* out = static_cast<uint4*>(a.out);
    for (int t = finalizer; t < a.num_tokens; t += finalizers) {
      const int my_slot = lane < world ? a.token_slot[(int64_t)t * world + lane] : -1;
      // Every rank holding one of this token's experts contributes one partial row: the own
      // rank's is staged here, the others' arrive in `partials` (wait for each one's flag).
      const int own_slot = __shfl_sync(0xffffffffu, my_slot, rank);
      const uint4* own = own_slot >= 0 ? staged + ((int64_t)rank * buf.max_tokens + own_slot) * row_stride : nullptr;
      uint32_t remote = 0;
      for (int d = 0; d < world; ++d) {
        const int slot = __shfl_sync(0xffffffffu, my_slot, d);
        if (d == rank || slot < 0) continue;
        wait_flag(buf.partial_flag + (int64_t)d * buf.max_tokens + t, tag);
        remote |= 1u << d;
      }
      // The first source's and the second's loads are in flight together (kCopyUnroll vectors
      // per lane each): one row at a time leaves the finalizers bound by memory latency.
      const uint4* rows[kMaxRanks];
      int sources = 0;
      if (own != nullptr) rows[sources++] = own;
      for (int d = 0; d < world; ++d) {
        if (remote & (1u << d)) rows[sources++] = partials + ((int64_t)d * buf.max_tokens + t) * row_stride;
      }
      for (int v0 = lane; v0 < a.row_vecs; v0 += kCopyUnroll * kWarpSize) {
        uint4 first[kCopyUnroll], second[kCopyUnroll];
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          const int v = min(v0 + u * kWarpSize, a.row_vecs - 1);
          if (sources > 0) first[u] = rows[0][v];
          if (sources > 1) second[u] = rows[1][v];
        }
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          const int v = v0 + u * kWarpSize;
          float acc[kElems] = {};
          if (sources > 0) accumulate<T>(acc, first[u], 1.f);
          if (sources > 1) accumulate<T>(acc, second[u], 1.f);
          for (int q = 2; q < sources; ++q) accumulate<T>(acc, rows[q][min(v, a.row_vecs - 1)], 1.f);
          if (v < a.row_vecs) out[(int64_t)t * a.row_vecs + v] = pack<T>(acc, 1.f);
        }
      }
    }
  }

  grid.sync();
  if (blockIdx.x == 0 && threadIdx.x == 0) buf.calls[kCombineLikeCalls] = tag;
}

void launch_combine(const Buffers& buf, const CombineArgs& args, bool bf16, int num_blocks, cudaStream_t stream) {
  void* params[] = {const_cast<Buffers*>(&buf), const_cast<CombineArgs*>(&args)};
  const void* fn = bf16 ? reinterpret_cast<const void*>(combine_kernel<__nv_bfloat16>)
                        : reinterpret_cast<const void*>(combine_kernel<float>);
  launch_cooperative(fn, num_blocks, 0, params, stream, "combine");
}

}  // namespace moe_comm
