// What travels with a row: the slot metadata formats and the chunking of the transfers.
//
// Terms used by every kernel. A rank r of an EP group of W ranks is (node r / G, local r % G)
// for G ranks per node (the real node, or [moe_comm] virtual_node_size). A token bound for
// another node crosses the network once per node, to the rank with the same local index there
// (its forwarder); the forwarder - for a token of its own node, the source itself - delivers it
// over NVLink once to each rank of the node that holds one of its experts. So:
//   a *send slot* is a (token, remote node) pair staged by the source for the network hop;
//   a *net slot*  is such a row arrived at its forwarder (pooled over the source nodes);
//   a *recv slot* is a row delivered to a rank by one forwarder of its node (partition g holds
//                 forwarder g's deliveries), or kept by the rank itself when it is its own
//                 forwarder; the expert-major layout is built from the recv slots.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/limits.h"

namespace moe_comm {

__host__ __device__ constexpr int round_up(int x, int align) { return (x + align - 1) / align * align; }

// Channels that share one fp32 scale in an FP8 row (DeepEP's and Hybrid-EP's granularity).
constexpr int kFp8GroupChannels = 128;
// Bytes of one row on the wire in FP8: the e4m3 payload, then the fp32 scales, padded to 16.
__host__ __device__ constexpr int fp8_row_bytes(int hidden) { return round_up(hidden + hidden / kFp8GroupChannels * 4, 16); }

// Slots per chunk of a network transfer (one put with one signal), and per chunk of partial
// sums a rank pushes to a forwarder (one flag): the granularity the two hops pipeline at.
constexpr int kChunkSlots = 8;

// A send/net slot: this metadata, then the row.
struct alignas(16) NetMeta {
  int32_t token;                        // index of the token on its source rank
  int32_t unused[3];
  int32_t expert[kMaxTopK];             // global expert ids of the token's picks
  float weight[kMaxTopK];               // their routing weights
  int32_t rank_pos[kMaxRanksPerNode];   // position among the source's tokens for each rank of
                                        // the destination node, -1: not delivered there
};
constexpr int kNetMetaBytes = 128;
static_assert(sizeof(NetMeta) <= kNetMetaBytes, "NetMeta grew past its wire size");

// A recv slot's metadata, written by its forwarder.
struct alignas(16) RecvMeta {
  int32_t token;             // index of the token on its source rank
  int32_t origin;            // own-forwarded slots: the net slot holding the row, -1 for this
                             // rank's own token (row in the dispatch input)
  int32_t unused[2];
  int32_t expert[kMaxTopK];  // global expert ids (the receiver keeps those it holds)
  float weight[kMaxTopK];
};
static_assert(sizeof(RecvMeta) % 16 == 0, "RecvMeta must keep rows 16-byte aligned");

}  // namespace moe_comm
