// The NVLink hop: what ranks of one node say to each other, by loads and stores through the
// peer mappings (Buffers::peer).
#pragma once

#include "common/wait.cuh"
#include "runtime/buffers.h"

namespace moe_comm {

// Thread h of the caller (h < G, h != this rank) tells rank h of the node that this rank's
// buffers of `kind` are free for call `tag`.
__device__ __forceinline__ void announce_node_ready(const Buffers& b, int kind, uint32_t tag, int h) {
  const Topology& t = b.topo;
  if (h < t.local_size && h != t.local) store_release_sys(b.peer[h].ready + kind * t.local_size + t.local, tag);
}

// Thread h waits until rank h of the node said its buffers of `kind` are free for this call.
__device__ __forceinline__ bool wait_node_ready(const Buffers& b, int kind, uint32_t tag, int h, int kernel) {
  const Topology& t = b.topo;
  if (h >= t.local_size || h == t.local) return true;
  return wait_equal<uint32_t>(b.peer[t.local].ready + kind * t.local_size + h, tag, b.wait, kernel, kPhaseReady,
                              t.rank_of(t.node, h));
}

// Thread h tells rank h of the node how many recv slots this rank delivered to it (everything
// the grid stored before its last sync, each warp having fenced, is visible first).
__device__ __forceinline__ void announce_delivered(const Buffers& b, uint32_t count, uint32_t tag, int h) {
  const Topology& t = b.topo;
  uint32_t* done = b.peer[h].fwd_done + 2 * t.local;
  done[0] = count;
  __threadfence_system();
  store_release_sys(done + 1, tag);
}

// Thread g waits for forwarder g of the node to finish delivering; returns its slot count.
__device__ __forceinline__ int wait_delivered(const Buffers& b, uint32_t tag, int g) {
  const Topology& t = b.topo;
  const uint32_t* done = b.peer[t.local].fwd_done + 2 * g;
  if (!wait_equal<uint32_t>(done + 1, tag, b.wait, kKernelDispatch, kPhaseForwarded, t.rank_of(t.node, g))) return 0;
  return (int)*(volatile const uint32_t*)done;
}

}  // namespace moe_comm
