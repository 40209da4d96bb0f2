// Pieces every communication kernel shares: the start of a call (buffers free on both hops),
// the rail plan in shared memory, chunked work lists, and the two halves of a combine-like
// call's way home (combine's partial rows and combine backward's routing-weight gradients take
// the same route with different payloads).
#pragma once

#include <cooperative_groups.h>

#include "common/launch.h"
#include "common/rail_plan.cuh"
#include "common/vec.cuh"
#include "common/wire.h"
#include "internode/network.cuh"
#include "intranode/nvlink.cuh"

namespace moe_comm {

// Block 0 tells its peers that this rank's buffers of `kind` are free for call `tag`, then
// waits until every peer it will write into said the same (on the NVLink hop when `node_peers`,
// on the network hop when `rail_peers`). Threads 0..G-1 serve the node, 32..32+nodes-1 the rail.
// The caller grid-syncs before anyone writes into a peer.
__device__ __forceinline__ void begin_call(const Buffers& b, int kind, uint32_t tag, int kernel, bool node_peers,
                                           bool rail_peers) {
  if (blockIdx.x != 0) return;
  const int h = threadIdx.x, m = threadIdx.x - 32;
  if (node_peers && h < b.topo.local_size) announce_node_ready(b, kind, tag, h);
  if (rail_peers && m >= 0 && m < b.topo.nodes) announce_rail_ready(b, kind, tag, m);
  if (node_peers && h < b.topo.local_size) wait_node_ready(b, kind, tag, h, kernel);
  if (rail_peers && m >= 0 && m < b.topo.nodes) wait_rail_ready(b, kind, tag, m, kernel);
}

// A work list of chunks: `count[n]` slots from (or for) node n, in chunks of kChunkSlots;
// item i is chunk `chunk` of node `node`. Built by one thread in shared memory.
struct ChunkList {
  int base[kMaxNodes + 1];
  int nodes;
  __device__ __forceinline__ void build(const int* count, int n_nodes) {
    nodes = n_nodes;
    base[0] = 0;
    for (int n = 0; n < n_nodes; ++n) base[n + 1] = base[n] + (count[n] + kChunkSlots - 1) / kChunkSlots;
  }
  __device__ __forceinline__ int total() const { return base[nodes]; }
  __device__ __forceinline__ void locate(int item, int& node, int& chunk) const {
    node = 0;
    while (item >= base[node + 1]) ++node;
    chunk = item - base[node];
  }
};

// The node's ranks h that hold a part of net slot s, with the index ih of that part in h's
// partition for this rank, in local-index order: fn(h, ih) for each (the whole warp calls).
template <typename Fn>
__device__ __forceinline__ void for_each_part(const int32_t* net_route, int s, int G, int lane, Fn fn) {
  const int idx = lane < G ? net_route[(int64_t)s * G + lane] : -1;
  for (int h = 0; h < G; ++h) {
    const int ih = __shfl_sync(0xffffffffu, idx, h);
    if (ih >= 0) fn(h, ih);
  }
}

// Network forwarders of a combine-like call: the warp `worker` of `workers` takes chunks of net
// slots; add_slot(s) (the whole warp) adds up the node's parts of net slot s into its
// `slot_bytes` row of `staged`, and the chunk goes home with a signal, to its source node's
// send slots from home_off. The staging is refilled by the next call: quiet before returning.
template <typename AddSlot>
__device__ __forceinline__ void send_home(const Buffers& b, const RailPlan& plan, const ChunkList& items, int worker,
                                          int workers, const uint8_t* staged, uint8_t* home, size_t slot_bytes,
                                          uint64_t* home_sig, uint32_t tag, AddSlot add_slot) {
  for (int item = worker; item < items.total(); item += workers) {
    int n, c;
    items.locate(item, n, c);
    const int first = plan.net_off[n] + c * kChunkSlots;
    const int n_slots = min(kChunkSlots, plan.net_count[n] - c * kChunkSlots);
    for (int s = first; s < first + n_slots; ++s) add_slot(s);
    __threadfence_system();
    __syncwarp();
    put_chunk(b, home + (int64_t)(plan.home_off[n] + c * kChunkSlots) * slot_bytes, staged + (int64_t)first * slot_bytes,
              (size_t)n_slots * slot_bytes, home_sig + (int64_t)b.topo.node * b.cap.chunks + c, tag, n);
  }
  __syncwarp();
  nvshmem_quiet();
}

// What a combine-like call waits for before its finishing kernel adds a token's parts: from
// each other rank h of the node, the flags of this rank's own tokens (they lead h's partition
// for this rank: fwd_own[h] slots, a flag per `slots_per_flag` of them), then every chunk that
// comes home from each other node. Built by one thread in shared memory.
struct ArrivalList {
  int base[kMaxRanksPerNode + kMaxNodes + 1];

  __device__ __forceinline__ void build(const RailPlan& plan, const Topology& t, const Capacity& cap,
                                        int slots_per_flag) {
    base[0] = 0;
    for (int h = 0; h < kMaxRanksPerNode; ++h) {
      const int own = h < t.local_size && h != t.local ? min(plan.fwd_own[h], cap.fwd_slots) : 0;
      base[h + 1] = base[h] + (own + slots_per_flag - 1) / slots_per_flag;
    }
    for (int m = 0; m < kMaxNodes; ++m) {
      const int count = m < t.nodes && m != t.node ? plan.dest_count[m] : 0;
      base[kMaxRanksPerNode + m + 1] = base[kMaxRanksPerNode + m] + (count + kChunkSlots - 1) / kChunkSlots;
    }
  }

  // Thread `waiter` of `waiters` spins on its share: rank h's flag i at node_flags[h * node_stride + i],
  // node m's chunk c at home_sig[m * chunks + c].
  __device__ __forceinline__ void wait(const Buffers& b, const uint32_t* node_flags, int64_t node_stride,
                                       const uint64_t* home_sig, uint32_t tag, int kernel, int node_phase,
                                       int home_phase, int waiter, int waiters) const {
    const Topology& t = b.topo;
    for (int item = waiter; item < base[kMaxRanksPerNode + kMaxNodes]; item += waiters) {
      int q = 0;
      while (item >= base[q + 1]) ++q;
      const int i = item - base[q];
      if (q < kMaxRanksPerNode) {
        wait_equal<uint32_t>(node_flags + (int64_t)q * node_stride + i, tag, b.wait, kernel, node_phase,
                             t.rank_of(t.node, q));
      } else {
        const int m = q - kMaxRanksPerNode;
        wait_equal<uint64_t>(home_sig + (int64_t)m * b.cap.chunks + i, tag, b.wait, kernel, home_phase,
                             t.rank_of(m, t.local));
      }
    }
  }
};

}  // namespace moe_comm
