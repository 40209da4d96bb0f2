// Walking a rank's recv slots: partition g (forwarder g of the node) holds recv_counts[g]
// slots at g * fwd_slots; the local kernels visit them in one flat, partition-major order.
#pragma once

#include <cstdint>

#include "common/limits.h"
#include "common/vec.cuh"
#include "runtime/buffers.h"

namespace moe_comm {

struct RecvSlots {
  int prefix[kMaxRanksPerNode + 1];
  int partitions, fwd_slots;

  __device__ __forceinline__ RecvSlots(const int32_t* recv_counts, int G, int fwd_slots_)
      : partitions(G), fwd_slots(fwd_slots_) {
    prefix[0] = 0;
#pragma unroll
    for (int g = 0; g < kMaxRanksPerNode; ++g) prefix[g + 1] = prefix[g] + (g < G ? recv_counts[g] : 0);
  }
  __device__ __forceinline__ int total() const { return prefix[kMaxRanksPerNode]; }
  // The f-th slot (f < total()): its partition, its index there, and its slot index.
  __device__ __forceinline__ int64_t locate(int f, int& g, int& i) const {
    g = 0;
    while (f >= prefix[g + 1]) ++g;
    i = f - prefix[g];
    return (int64_t)g * fwd_slots + i;
  }
};

// The expert-major rows and routing weights of one slot's picks, broadcast to the whole warp
// (row -1: the pick is not on this rank, or its row fell beyond the receive capacity).
struct SlotRows {
  int row[kMaxTopK];
  float weight[kMaxTopK];
};

// slot_w == nullptr: every weight is 1 (the backward of dispatch sums the copies' gradients).
__device__ __forceinline__ SlotRows load_slot_rows(const int32_t* slot_rows, const float* slot_w, int64_t slot,
                                                   int top_k, int capacity, int lane) {
  int row = -1;
  float weight = 1.f;
  if (lane < top_k) {
    row = slot_rows[slot * top_k + lane];
    if (slot_w != nullptr) weight = slot_w[slot * top_k + lane];
  }
  SlotRows r;
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {
    const int rk = __shfl_sync(0xffffffffu, row, k < top_k ? k : 0);
    r.weight[k] = __shfl_sync(0xffffffffu, weight, k < top_k ? k : 0);
    r.row[k] = (k < top_k && rk >= 0 && rk < capacity) ? rk : -1;
  }
  return r;
}

// True when every pick of this rank's token `tok` lives on this rank: it never left, so reduce
// finishes it and finalize skips it (warp-uniform; lanes read rank_pos and send_idx).
__device__ __forceinline__ bool stays_home(const Topology& t, const int32_t* rank_pos, const int32_t* send_idx,
                                           int64_t tok, int lane) {
  const int pos = lane < t.local_size ? rank_pos[tok * t.local_size + lane] : -1;
  const int send = lane < t.nodes ? send_idx[tok * t.nodes + lane] : -1;
  const bool here = __shfl_sync(0xffffffffu, pos, t.local) >= 0;
  const bool elsewhere = __ballot_sync(0xffffffffu, (lane != t.local && pos >= 0) || send >= 0) != 0;
  return here && !elsewhere;
}

}  // namespace moe_comm
