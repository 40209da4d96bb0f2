// The buffers one process shares with its expert-parallel peers, sized once from the recipe.
//
// Symmetric buffers live on the NVSHMEM heap (same offsets on every rank). Ranks of one node
// reach each other's copies through the NVLink mappings nvshmem_ptr returned at start-up (the
// `peer` table); ranks of other nodes only through NVSHMEM puts and signals (the network hop).
// Every MoE layer, forward and backward, reuses the same buffers: each communication kernel
// starts by telling the peers that write into it that its buffers are free for this call (the
// `ready` words, one per call kind), and a rank writes into a peer only once it has seen that.
// So calls of any kind may follow each other in any order, inside a CUDA graph too, with no
// host-side barrier.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/limits.h"
#include "common/wait.cuh"
#include "common/wire.h"

namespace moe_comm {

// Call kinds: each has its own call counter (the flag tag) and ready words.
constexpr int kDispatchLike = 0;  // dispatch, combine's backward
constexpr int kCombineLike = 1;   // combine, dispatch's backward
constexpr int kCollectGradW = 2;  // combine backward's routing-weight gradients going home
constexpr int kCallKinds = 3;

struct Topology {
  int rank = 0, world = 1;       // in the EP group (= NVSHMEM PE and PE count)
  int node = 0, nodes = 1;       // this rank's node and the nodes of the group
  int local = 0, local_size = 1; // index within the node, ranks per node (G)
  __host__ __device__ int rank_of(int n, int l) const { return n * local_size + l; }
};

struct Capacity {
  int tokens = 0;      // most tokens one rank dispatches per call (T)
  int fwd_slots = 0;   // most recv slots one forwarder delivers to one rank per call
  int net_slots = 0;   // most net slots one rank receives per call, all source nodes together
  int send_slots = 0;  // most send slots one rank stages per call: T x min(top_k, nodes - 1)
  int row_bytes = 0;   // bytes of a row slot: hidden x the widest element size, multiple of 16
  int chunks = 0;      // most network chunks between two ranks per call: ceil(T / kChunkSlots)
  int fwd_chunks = 0;  // ceil(fwd_slots / kChunkSlots)
  __host__ __device__ int net_slot_bytes() const { return kNetMetaBytes + row_bytes; }
};

// One rank of this node's buffers, as mapped into this process (peer[local] is this rank's).
struct Peer {
  uint8_t* fwd_rows = nullptr;        // [G][fwd_slots][row_bytes]: recv slots by forwarder;
                                      //   combine stages each slot's partial sum here (reduce)
  RecvMeta* fwd_meta = nullptr;       // [G][fwd_slots]
  uint32_t* fwd_done = nullptr;       // [G][2]: {slots delivered, tag} by each forwarder
  uint8_t* fwd_partials = nullptr;    // [G][fwd_slots][row_bytes]: partial sums each rank of the
                                      //   node pushes back, at its recv slot index
  uint32_t* partial_flags = nullptr;  // [G][fwd_chunks]
  float* fwd_grad_w = nullptr;        // [G][fwd_slots][kMaxTopK] routing-weight gradients
  uint32_t* grad_w_flags = nullptr;   // [G][fwd_slots]
  uint32_t* ready = nullptr;          // [kCallKinds][G] from each rank of the node
};

struct Buffers {
  Topology topo;
  Capacity cap;
  WaitContext wait;
  int sm_count = 0;  // of this GPU: the grid of the local layout kernels

  Peer peer[kMaxRanksPerNode];

  // Symmetric, reached from other nodes by puts and signals (this rank's copies).
  uint8_t* net_slots = nullptr;      // [net_slots][net_slot_bytes] arrivals over the network
  uint8_t* net_partials = nullptr;   // [net_slots][row_bytes] combined rows staged to go home
  float* net_grad_w = nullptr;       // [net_slots][kMaxTopK] gradients staged to go home
  uint8_t* send_slots = nullptr;     // [send_slots][net_slot_bytes] staged for the network
  uint8_t* home_rows = nullptr;      // [send_slots][row_bytes] combined rows come home here
  float* home_grad_w = nullptr;      // [send_slots][kMaxTopK]
  int32_t* rail_counts = nullptr;    // [nodes][nodes + G] send counts of each rank of the rail
  int32_t* rail_send = nullptr;      // [nodes][nodes + G] this rank's counts, staged per node
  uint64_t* rail_counts_sig = nullptr;  // [nodes]
  uint64_t* rail_ready = nullptr;       // [kCallKinds][nodes]
  uint64_t* net_sig = nullptr;          // [nodes][chunks] net chunks arrived, by source node
  uint64_t* home_sig = nullptr;         // [nodes][chunks] combined chunks home, by node
  uint64_t* home_grad_w_sig = nullptr;  // [nodes][chunks]

  // Local to this GPU.
  // This struct's copy in device memory, which the kernels take: indexing `peer` by a runtime
  // rank in a kernel's parameter space would copy the whole struct to every thread's stack.
  const Buffers* on_device = nullptr;
  uint32_t* calls = nullptr;      // [kCallKinds] calls so far of each kind (flag tags)
  uint32_t* delivered = nullptr;  // [G] recv slots this rank delivered as forwarder this call
};

}  // namespace moe_comm
