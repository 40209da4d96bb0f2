// The network hop: what ranks of different nodes say to each other, with NVSHMEM's device
// put/signal API only (never nvshmem_ptr), so the same code runs over InfiniBand (IBGDA or
// IBRC) between hosts and over P2P between ranks of one host or one GPU (virtual nodes).
// Peers on the network are the rail: the ranks with this rank's local index on other nodes.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include "common/wait.cuh"
#include "runtime/buffers.h"

namespace moe_comm {

// Thread m of the caller (m < nodes, m != this node) tells rail peer m that this rank's buffers
// of `kind` are free for call `tag`.
__device__ __forceinline__ void announce_rail_ready(const Buffers& b, int kind, uint32_t tag, int m) {
  const Topology& t = b.topo;
  if (m < t.nodes && m != t.node) {
    nvshmemx_signal_op(b.rail_ready + kind * t.nodes + t.node, tag, NVSHMEM_SIGNAL_SET, t.rank_of(m, t.local));
  }
}

// Thread m waits until rail peer m said its buffers of `kind` are free for this call.
__device__ __forceinline__ bool wait_rail_ready(const Buffers& b, int kind, uint32_t tag, int m, int kernel) {
  const Topology& t = b.topo;
  if (m >= t.nodes || m == t.node) return true;
  return wait_equal<uint64_t>(b.rail_ready + kind * t.nodes + m, tag, b.wait, kernel, kPhaseReady,
                              t.rank_of(m, t.local));
}

// Thread m sends this rank's counts message to rail peer m (itself included): the send slots
// per node, then the recv slots for each rank of node m. send_counts: [world] recv slots per
// destination rank, then [nodes] send slots per node (the plan kernel's totals).
__device__ __forceinline__ void send_rail_counts(const Buffers& b, const int32_t* send_counts, uint32_t tag, int m) {
  const Topology& t = b.topo;
  const int N = t.nodes, G = t.local_size, width = N + G;
  if (m >= N) return;
  int32_t* msg = b.rail_send + m * width;
  for (int k = 0; k < N; ++k) msg[k] = k == t.node ? 0 : send_counts[t.world + k];
  for (int h = 0; h < G; ++h) msg[N + h] = send_counts[t.rank_of(m, h)];
  int32_t* dst = b.rail_counts + t.node * width;
  if (m == t.node) {
    for (int k = 0; k < width; ++k) dst[k] = msg[k];
    __threadfence();
    *(volatile uint64_t*)(b.rail_counts_sig + t.node) = tag;
  } else {
    // Blocking: the staging row is rewritten by the next call.
    nvshmem_putmem_signal(dst, msg, width * sizeof(int32_t), b.rail_counts_sig + t.node, tag, NVSHMEM_SIGNAL_SET,
                          t.rank_of(m, t.local));
  }
}

// Thread n waits for rail peer n's counts message.
__device__ __forceinline__ bool wait_rail_counts(const Buffers& b, uint32_t tag, int n) {
  const Topology& t = b.topo;
  if (n >= t.nodes) return true;
  return wait_equal<uint64_t>(b.rail_counts_sig + n, tag, b.wait, kKernelDispatch, kPhaseCounts,
                              t.rank_of(n, t.local));
}

// The warp puts `bytes` from this rank's symmetric `src` to `dst` on rail peer (node m), then
// sets the peer's signal word `sig` (this rank's copy's address) to `tag` once the data is there.
__device__ __forceinline__ void put_chunk(const Buffers& b, void* dst, const void* src, size_t bytes, uint64_t* sig,
                                          uint32_t tag, int m) {
  const Topology& t = b.topo;
  nvshmemx_putmem_signal_nbi_warp(dst, src, bytes, sig, tag, NVSHMEM_SIGNAL_SET, t.rank_of(m, t.local));
}

}  // namespace moe_comm
