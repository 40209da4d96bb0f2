// Pieces every communication kernel shares: the start of a call (buffers free on both hops),
// the rail plan in shared memory, and chunked work lists.
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

}  // namespace moe_comm
