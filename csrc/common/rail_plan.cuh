// Where every slot of a call goes, from the send counts of the rail (the ranks with this
// rank's local index, one per node). Every rank of the rail holds the same count matrix after
// dispatch's counts exchange, so each computes the same offsets with no further messages; the
// handle keeps the matrix, so the backward transfers reuse it.
//
// rail[n][m]     (m < nodes): send slots rank (n, local) stages for node m (0 for m == n)
// rail[n][nodes + h]:         recv slots rank (n, local) sends to rank (this node, h) through
//                             this rank (the message each source sends to each node differs)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/limits.h"
#include "runtime/buffers.h"

namespace moe_comm {

struct RailPlan {
  // This rank as forwarder: net slots from source node n start at net_off[n], and net_count[n]
  // of them fit (0 for this node, whose tokens stay in the source's own buffers).
  int net_off[kMaxNodes];
  int net_count[kMaxNodes];
  // This rank as forwarder: recv slots of partition (this rank -> rank h of the node) from
  // source node n start at fwd_off[h][n], source nodes in order from this node on (so this
  // rank's own tokens come first, at their plan positions: fwd_off[h][node] == 0, and the plan
  // writes their metadata at this rank itself); fwd_total[h] is the partition's size before
  // capacity and fwd_own[h] the own tokens' share of it.
  int fwd_off[kMaxRanksPerNode][kMaxNodes];
  int fwd_total[kMaxRanksPerNode];
  int fwd_own[kMaxRanksPerNode];
  // This rank as source: its send slots for node m start at send_off[m]; at node m they land
  // from dest_off[m], and dest_count[m] of them fit there.
  int send_off[kMaxNodes];
  int dest_off[kMaxNodes];
  int dest_count[kMaxNodes];
  // This rank as forwarder in combine: the rows of source node n go home to its send slots
  // from home_off[n].
  int home_off[kMaxNodes];
  // Net slots this rank holds beyond its capacity (0: none); the host raises.
  int net_overflow;
};

#if defined(__CUDACC__)

// One thread fills the plan (nodes x (nodes + G) reads); the caller syncs before using it.
__device__ __forceinline__ void fill_rail_plan(RailPlan& p, const int32_t* rail, const Topology& topo,
                                               const Capacity& cap) {
  const int N = topo.nodes, G = topo.local_size, me = topo.node, width = N + G;
  p.net_overflow = 0;
  int off = 0;
  for (int n = 0; n < N; ++n) {
    const int count = n == me ? 0 : rail[n * width + me];
    p.net_off[n] = min(off, cap.net_slots);
    p.net_count[n] = max(0, min(count, cap.net_slots - off));
    off += count;
  }
  if (off > cap.net_slots) p.net_overflow = off;
  for (int h = 0; h < G; ++h) {
    int f = 0;
    for (int q = 0; q < N; ++q) {
      const int n = (me + q) % N;
      p.fwd_off[h][n] = f;
      f += rail[n * width + N + h];
    }
    p.fwd_total[h] = f;
    p.fwd_own[h] = rail[me * width + N + h];
  }
  int s = 0;
  for (int m = 0; m < N; ++m) {
    p.send_off[m] = s;
    if (m != me) s += rail[me * width + m];
    int d = 0;  // slots of lower source nodes ahead of this rank's at node m
    for (int n = 0; n < me; ++n) d += n == m ? 0 : rail[n * width + m];
    const int count = m == me ? 0 : rail[me * width + m];
    p.dest_off[m] = d;
    p.dest_count[m] = max(0, min(count, cap.net_slots - d));
    int h = 0;  // source node m's send slots for the nodes before this one
    for (int k = 0; k < me; ++k) h += k == m ? 0 : rail[m * width + k];
    p.home_off[m] = h;
  }
}

#endif  // __CUDACC__

}  // namespace moe_comm
