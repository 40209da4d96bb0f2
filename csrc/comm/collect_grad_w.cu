// Collect: the routing-weight gradients of combine's backward travel home along the routes.
// Each rank stored its vector for every recv slot at the slot's forwarder (layout/expand.cu,
// backward); a forwarder adds the node's vectors of each net slot and puts them home a chunk at
// a time; the token's rank adds the rest (layout/finalize.cu, gather_grad_w) once this kernel
// saw everything arrive.
//
// One cooperative launch of `num_blocks` blocks:
//   network forwarders (the first `network_blocks` blocks, only on several nodes): per chunk of
//              net slots, wait for each slot's vectors, add them, put the chunk home;
//   waiters (the rest): the vectors for this rank's own tokens from every rank of the node,
//              then every chunk that comes home.
#include <cooperative_groups.h>

#include "comm/comm.h"
#include "comm/protocol.cuh"

namespace cg = cooperative_groups;

namespace moe_comm {

__global__ void __launch_bounds__(kCommThreads, 1) collect_grad_w_kernel(const Buffers* __restrict__ buffers, const CollectArgs a) {
  const Buffers& b = *buffers;
  __shared__ RailPlan plan;
  __shared__ ChunkList net_items;
  __shared__ ArrivalList arrivals;
  cg::grid_group grid = cg::this_grid();
  const Topology t = b.topo;
  const Capacity cap = b.cap;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int G = t.local_size;
  const uint32_t tag = b.calls[kCollectGradW] + 1;
  const Peer& self = b.peer[t.local];

  begin_call(b, kCollectGradW, tag, kKernelCollectGradW, false, true);
  if (threadIdx.x == 0) {
    fill_rail_plan(plan, a.rail_counts, t, cap);
    net_items.build(plan.net_count, t.nodes);
    arrivals.build(plan, t, cap, 1);  // one flag per own-token slot
  }
  grid.sync();

  const int network_blocks = t.nodes > 1 ? a.network_blocks : 0;
  if ((int)blockIdx.x < network_blocks) {
    send_home(b, plan, net_items, blockIdx.x * kCommWarps + warp, network_blocks * kCommWarps,
              reinterpret_cast<const uint8_t*>(b.net_grad_w), reinterpret_cast<uint8_t*>(b.home_grad_w),
              kMaxTopK * sizeof(float), b.home_grad_w_sig, tag, [&](int s) {
                float sum = 0.f;  // lane k: pick k
                for_each_part(a.net_route, s, G, lane, [&](int h, int ih) {
                  const int64_t slot = (int64_t)h * cap.fwd_slots + ih;
                  if (h != t.local && !wait_equal<uint32_t>(self.grad_w_flags + slot, tag, b.wait, kKernelCollectGradW,
                                                            kPhaseGradW, t.rank_of(t.node, h))) {
                    return;
                  }
                  if (lane < kMaxTopK) sum += self.fwd_grad_w[slot * kMaxTopK + lane];
                });
                if (lane < kMaxTopK) b.net_grad_w[(int64_t)s * kMaxTopK + lane] = sum;
              });
  } else {
    const int waiters = (gridDim.x - network_blocks) * kCommThreads;
    arrivals.wait(b, self.grad_w_flags, cap.fwd_slots, b.home_grad_w_sig, tag, kKernelCollectGradW, kPhaseGradW,
                  kPhaseHomeGradW, (blockIdx.x - network_blocks) * kCommThreads + threadIdx.x, waiters);
  }

  grid.sync();
  if (blockIdx.x == 0 && threadIdx.x == 0) b.calls[kCollectGradW] = tag;
}

void launch_collect_grad_w(const Buffers& b, const CollectArgs& a, int num_blocks, cudaStream_t stream) {
  const Buffers* device = b.on_device;
  void* params[] = {&device, const_cast<CollectArgs*>(&a)};
  launch_cooperative(reinterpret_cast<const void*>(collect_grad_w_kernel), num_blocks, b.sm_count, 0, params, stream,
                     "collect_grad_w");
}

}  // namespace moe_comm
