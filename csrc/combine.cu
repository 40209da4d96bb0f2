// Combine: expert outputs go back to their token's rank, reduced with the routing weights.
//
// Each rank first reduces, per arrived slot, the rows of its own experts (fp32 accumulation),
// so a token crosses NVLink once per rank on the way back too. One cooperative launch, two
// roles at once:
//   pushers     for slots that came from another rank: weighted sum of the slot's rows, stored
//               into that rank's `partials` buffer at the token's index, then a flag;
//   finalizers  for this rank's tokens: the own rank's share straight from y (kept in fp32),
//               plus each other rank's partial once its flag is up; one store in the output
//               dtype.
// With weighted = false it is the backward of dispatch (the gradient of a copied row is the sum
// of the gradients of its copies).
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include "buffers.h"
#include "common.cuh"
#include "launch.h"

namespace cg = cooperative_groups;

namespace moe_comm {

// Rows and weights of one slot, broadcast to the whole warp (row -1: pick not here).
struct SlotRows {
  int row[kMaxTopK];
  float weight[kMaxTopK];
};

__device__ __forceinline__ SlotRows load_slot_rows(const CombineArgs& a, int64_t slot_index, int lane) {
  int row = -1;
  float weight = 0.f;
  if (lane < a.top_k) {
    row = a.slot_rows[slot_index * a.top_k + lane];
    weight = a.weighted ? a.slot_w[slot_index * a.top_k + lane] : 1.f;
  }
  SlotRows r;
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {
    const int rk = __shfl_sync(0xffffffffu, row, k < a.top_k ? k : 0);
    r.weight[k] = __shfl_sync(0xffffffffu, weight, k < a.top_k ? k : 0);
    r.row[k] = (k < a.top_k && rk >= 0 && rk < a.capacity) ? rk : -1;
  }
  return r;
}

// Picks whose loads add_slot issues before it uses the first: more loads in flight per lane,
// bounded by the 64 registers a thread has at 1024 threads per block.
constexpr int kPicksInFlight = 4;

// acc += sum over the slot's picks of weight * y[row], for the lane's vector v.
template <typename T>
__device__ __forceinline__ void add_slot(float (&acc)[Vec<T>::kElems], const SlotRows& r, const uint4* y,
                                         int row_vecs, int v) {
#pragma unroll
  for (int k0 = 0; k0 < kMaxTopK; k0 += kPicksInFlight) {
    uint4 value[kPicksInFlight];
#pragma unroll
    for (int k = 0; k < kPicksInFlight; ++k) {
      if (r.row[k0 + k] >= 0) value[k] = __ldg(y + (int64_t)r.row[k0 + k] * row_vecs + v);
    }
#pragma unroll
    for (int k = 0; k < kPicksInFlight; ++k) {
      if (r.row[k0 + k] >= 0) accumulate<T>(acc, value[k], r.weight[k0 + k]);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreadsPerBlock, 1)
    combine_kernel(const Buffers buf, const CombineArgs a) {
  cg::grid_group grid = cg::this_grid();
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int world = buf.world, rank = buf.rank;
  const uint32_t tag = buf.calls[kCombineLikeCalls] + 1;
  const int row_stride = buf.max_row_bytes / 16;
  constexpr int kElems = Vec<T>::kElems;
  const uint4* y = static_cast<const uint4*>(a.y);

  if (warp < a.pusher_warps) {
    // Slots that arrived from other ranks, in order of source rank.
    const int pushers = gridDim.x * a.pusher_warps;
    const int pusher = blockIdx.x * a.pusher_warps + warp;
    int slot_prefix[kMaxRanks + 1];
    slot_prefix[0] = 0;
#pragma unroll
    for (int q = 1; q <= kMaxRanks; ++q) {
      const int s = (rank + q) % world;
      slot_prefix[q] = slot_prefix[q - 1] + (q < world ? a.recv_info[RecvInfo{world, 0}.slots_from(s)] : 0);
    }
    const int total = slot_prefix[world - 1];
    for (int i = pusher; i < total; i += pushers) {
      int q = 0;
      while (i >= slot_prefix[q + 1]) ++q;
      const int s = (rank + q + 1) % world;
      const int j = i - slot_prefix[q];
      const int64_t slot_index = (int64_t)s * buf.max_tokens + j;
      const SlotRows r = load_slot_rows(a, slot_index, lane);
      const int token = a.slot_token[slot_index];
      uint4* dst = reinterpret_cast<uint4*>(buf.peer_partials[s]) + ((int64_t)rank * buf.max_tokens + token) * row_stride;
      for (int v = lane; v < a.row_vecs; v += kWarpSize) {
        float acc[kElems] = {};
        add_slot<T>(acc, r, y, a.row_vecs, v);
        dst[v] = pack<T>(acc, 1.f);
      }
      publish_flag(buf.peer_partial_flag[s] + (int64_t)rank * buf.max_tokens + token, tag, lane);
    }
  } else {
    const int finalizers = gridDim.x * (kWarpsPerBlock - a.pusher_warps);
    const int finalizer = blockIdx.x * (kWarpsPerBlock - a.pusher_warps) + (warp - a.pusher_warps);
    uint4* out = static_cast<uint4*>(a.out);
    for (int t = finalizer; t < a.num_tokens; t += finalizers) {
      const int my_slot = lane < world ? a.token_slot[(int64_t)t * world + lane] : -1;
      const int own_slot = __shfl_sync(0xffffffffu, my_slot, rank);
      SlotRows own;
      if (own_slot >= 0) {
        own = load_slot_rows(a, (int64_t)rank * buf.max_tokens + own_slot, lane);
      } else {
#pragma unroll
        for (int k = 0; k < kMaxTopK; ++k) own.row[k] = -1;
      }
      // Other ranks holding this token's experts; wait for each one's partial.
      uint32_t remote = 0;
      for (int d = 0; d < world; ++d) {
        const int slot = __shfl_sync(0xffffffffu, my_slot, d);
        if (d == rank || slot < 0) continue;
        wait_flag(buf.partial_flag + (int64_t)d * buf.max_tokens + t, tag);
        remote |= 1u << d;
      }
      const uint4* partials = reinterpret_cast<const uint4*>(buf.partials);
      for (int v = lane; v < a.row_vecs; v += kWarpSize) {
        float acc[kElems] = {};
        add_slot<T>(acc, own, y, a.row_vecs, v);
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
          if (remote & (1u << d)) accumulate<T>(acc, partials[((int64_t)d * buf.max_tokens + t) * row_stride + v], 1.f);
        }
        out[(int64_t)t * a.row_vecs + v] = pack<T>(acc, 1.f);
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
