// The communication kernels: cooperative launches on the recipe's SM budget that only move rows
// and flags. Each is one protocol of two hops - the network hop between nodes (internode/) and
// the NVLink hop inside a node (intranode/) - pipelined by chunk; on one node the network hop
// is empty and the NVLink hop is the whole path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "runtime/buffers.h"

namespace moe_comm {

// Dispatch (forward: rows and metadata, with the counts exchange) and the backward of combine
// (rows along the forward's routes, from the handle).
struct DispatchArgs {
  bool backward;
  int num_tokens, top_k, wire_vecs;  // wire_vecs: 16-byte vectors of a row on the wire
  const void* own_rows;              // [num_tokens] wire rows of this rank's tokens
  const int64_t* topk_idx;           // forward: [T, K]
  const float* topk_w;               // forward: [T, K]
  const int32_t* rank_pos;           // [T, G]
  const int32_t* send_counts;        // forward: [world + nodes] the plan's column totals
  int32_t* rail_counts;              // [nodes, nodes + G]: forward writes it, backward reads it
  int32_t* net_route;                // [net_slots, G]: recv slot at each rank of the node
  int32_t* recv_counts;              // forward: [G] out
  int network_blocks;
};

// Combine (forward, and the backward of dispatch): staged partial sums back along the routes.
struct CombineArgs {
  const int32_t* rail_counts;
  const int32_t* net_route;
  const int32_t* recv_counts;
  int row_vecs, network_blocks;
};

// Routing-weight gradients (combine backward) home along the routes.
struct CollectArgs {
  const int32_t* rail_counts;
  const int32_t* net_route;
  int top_k, network_blocks;
};

void launch_dispatch(const Buffers& b, const DispatchArgs& a, int num_blocks, cudaStream_t stream);
void launch_combine(const Buffers& b, const CombineArgs& a, bool bf16, int num_blocks, cudaStream_t stream);
void launch_collect_grad_w(const Buffers& b, const CollectArgs& a, int num_blocks, cudaStream_t stream);

}  // namespace moe_comm
