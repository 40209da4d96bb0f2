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
  __shared__ int base[kMaxRanksPerNode + kMaxNodes + 1];  // waiter items, built once per block
  cg::grid_group grid = cg::this_grid();
  const Topology t = b.topo;
  const Capacity cap = b.cap;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int N = t.nodes, G = t.local_size;
  const uint32_t tag = b.calls[kCollectGradW] + 1;
  const Peer& self = b.peer[t.local];

  begin_call(b, kCollectGradW, tag, kKernelCollectGradW, false, true);
  if (threadIdx.x == 0) {
    fill_rail_plan(plan, a.rail_counts, t, cap);
    net_items.build(plan.net_count, N);
    // Waiter items: each own-token slot at each rank h of the node (one flag each; own tokens
    // lead each partition), then the chunks coming home from each other node.
    base[0] = 0;
    for (int h = 0; h < kMaxRanksPerNode; ++h) {
      const int count = h < G && h != t.local ? min(plan.fwd_own[h], cap.fwd_slots) : 0;
      base[h + 1] = base[h] + count;
    }
    for (int m = 0; m < kMaxNodes; ++m) {
      const int count = m < N && m != t.node ? plan.dest_count[m] : 0;
      base[kMaxRanksPerNode + m + 1] = base[kMaxRanksPerNode + m] + (count + kChunkSlots - 1) / kChunkSlots;
    }
  }
  grid.sync();

  const int network_blocks = N > 1 ? a.network_blocks : 0;
  if ((int)blockIdx.x < network_blocks) {
    const int workers = network_blocks * kCommWarps;
    for (int item = blockIdx.x * kCommWarps + warp; item < net_items.total(); item += workers) {
      int n, c;
      net_items.locate(item, n, c);
      const int first = plan.net_off[n] + c * kChunkSlots;
      const int n_slots = min(kChunkSlots, plan.net_count[n] - c * kChunkSlots);
      for (int s = first; s < first + n_slots; ++s) {
        const int idx = lane < G ? a.net_route[(int64_t)s * G + lane] : -1;
        float sum = 0.f;  // lane k: pick k
        for (int h = 0; h < G; ++h) {
          const int ih = __shfl_sync(0xffffffffu, idx, h);
          if (ih < 0) continue;
          const int64_t slot = (int64_t)h * cap.fwd_slots + ih;
          if (h != t.local && !wait_equal<uint32_t>(self.grad_w_flags + slot, tag, b.wait, kKernelCollectGradW,
                                                    kPhaseGradW, t.rank_of(t.node, h))) {
            continue;
          }
          if (lane < kMaxTopK) sum += self.fwd_grad_w[slot * kMaxTopK + lane];
        }
        if (lane < kMaxTopK) b.net_grad_w[(int64_t)s * kMaxTopK + lane] = sum;
      }
      __threadfence_system();
      __syncwarp();
      put_chunk(b, b.home_grad_w + (int64_t)(plan.home_off[n] + c * kChunkSlots) * kMaxTopK,
                b.net_grad_w + (int64_t)first * kMaxTopK, (size_t)n_slots * kMaxTopK * sizeof(float),
                b.home_grad_w_sig + (int64_t)t.node * cap.chunks + c, tag, n);
    }
    __syncwarp();
    nvshmem_quiet();
  } else {
    const int workers = (gridDim.x - network_blocks) * kCommWarps;
    const int worker = (blockIdx.x - network_blocks) * kCommWarps + warp;
    const int total = base[kMaxRanksPerNode + kMaxNodes];
    for (int item = worker * kWarpSize + lane; item < total; item += workers * kWarpSize) {
      int q = 0;
      while (item >= base[q + 1]) ++q;
      const int c = item - base[q];
      if (q < kMaxRanksPerNode) {
        wait_equal<uint32_t>(self.grad_w_flags + (int64_t)q * cap.fwd_slots + c, tag, b.wait,
                             kKernelCollectGradW, kPhaseGradW, t.rank_of(t.node, q));
      } else {
        const int m = q - kMaxRanksPerNode;
        wait_equal<uint64_t>(b.home_grad_w_sig + (int64_t)m * cap.chunks + c, tag, b.wait, kKernelCollectGradW,
                             kPhaseHomeGradW, t.rank_of(m, t.local));
      }
    }
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
