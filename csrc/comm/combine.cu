// Combine: each rank's staged partial sums (layout/reduce.cu) go back along the dispatch
// routes, and are added up on the way: over NVLink to the forwarder of the slot, which adds the
// node's partials of each net slot in fp32 and sends one row per token per node home over the
// network. The token's own rank adds the rest (layout/finalize.cu) once this kernel saw every
// partial arrive. Also the backward of dispatch (unit weights, staged the same way).
//
// One cooperative launch of `num_blocks` blocks:
//   1. begin   buffers free on both hops.
//   2. roles   network forwarders (the first `network_blocks` blocks, only on several nodes):
//              per chunk of net slots, wait for the chunks of partials that hold them, add them
//              up, stage the rows and put the chunk home with a signal;
//              pushers (the rest): push every staged slot of partition g to forwarder g of the
//              node, a flag per chunk; then wait for what this rank's tokens need: the partials
//              for them from every rank of the node, and every chunk that comes home.
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include "comm/comm.h"
#include "comm/protocol.cuh"
#include "common/copy.cuh"
#include "common/vec.cuh"

namespace cg = cooperative_groups;

namespace moe_comm {

// Loads in flight per lane while a pusher copies one partial row: with a single destination the
// registers allow twice copy_row's default.
constexpr int kPushUnroll = 2 * kCopyUnroll;

template <typename T>
__global__ void __launch_bounds__(kCommThreads, 1) combine_kernel(const Buffers* __restrict__ buffers, const CombineArgs a) {
  const Buffers& b = *buffers;
  constexpr int kElems = Vec<T>::kElems;
  __shared__ RailPlan plan;
  __shared__ ChunkList net_items;
  __shared__ ArrivalList arrivals;
  __shared__ int chunk_base[kMaxRanksPerNode + 1];  // pusher items, built once per block
  cg::grid_group grid = cg::this_grid();
  const Topology t = b.topo;
  const Capacity cap = b.cap;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int G = t.local_size;
  const uint32_t tag = b.calls[kCombineLike] + 1;
  const Peer& self = b.peer[t.local];

  begin_call(b, kCombineLike, tag, kKernelCombine, true, true);
  if (threadIdx.x == 0) {
    fill_rail_plan(plan, a.rail_counts, t, cap);
    net_items.build(plan.net_count, t.nodes);
    arrivals.build(plan, t, cap, kChunkSlots);  // one flag per chunk of partials
    // Push: partition g's staged rows to forwarder g, chunk by chunk (items: g-major).
    chunk_base[0] = 0;
    for (int g = 0; g < kMaxRanksPerNode; ++g) {
      const int count = g < G && g != t.local ? a.recv_counts[g] : 0;
      chunk_base[g + 1] = chunk_base[g] + (count + kChunkSlots - 1) / kChunkSlots;
    }
  }
  grid.sync();

  const int network_blocks = t.nodes > 1 ? a.network_blocks : 0;
  if ((int)blockIdx.x < network_blocks) {
    send_home(b, plan, net_items, blockIdx.x * kCommWarps + warp, network_blocks * kCommWarps, b.net_partials,
              b.home_rows, cap.row_bytes, b.home_sig, tag, [&](int s) {
                const uint4* rows[kMaxRanksPerNode];
                int sources = 0;
                for_each_part(a.net_route, s, G, lane, [&](int h, int ih) {
                  if (h != t.local &&
                      !wait_equal<uint32_t>(self.partial_flags + (int64_t)h * cap.fwd_chunks + ih / kChunkSlots, tag,
                                            b.wait, kKernelCombine, kPhasePartials, t.rank_of(t.node, h))) {
                    return;
                  }
                  const uint8_t* base = h == t.local ? self.fwd_rows : self.fwd_partials;
                  rows[sources++] = reinterpret_cast<const uint4*>(base + ((int64_t)h * cap.fwd_slots + ih) * cap.row_bytes);
                });
                uint4* out = reinterpret_cast<uint4*>(b.net_partials + (int64_t)s * cap.row_bytes);
                for (int v = lane; v < a.row_vecs; v += kWarpSize) {
                  float acc[kElems] = {};
                  for (int q = 0; q < sources; ++q) accumulate<T>(acc, rows[q][v], 1.f);
                  out[v] = pack<T>(acc, 1.f);
                }
              });
  } else {
    const int workers = (gridDim.x - network_blocks) * kCommWarps;
    const int worker = (blockIdx.x - network_blocks) * kCommWarps + warp;
    const int row_stride = cap.row_bytes / 16;
    for (int item = worker; item < chunk_base[kMaxRanksPerNode]; item += workers) {
      int g = 0;
      while (item >= chunk_base[g + 1]) ++g;
      const int chunk = item - chunk_base[g];
      const int first = chunk * kChunkSlots;
      const int last = min(a.recv_counts[g], first + kChunkSlots);
      for (int i = first; i < last; ++i) {
        const int64_t slot = (int64_t)g * cap.fwd_slots + i;  // at this rank, and at g's partials from it
        uint4* const dst[1] = {reinterpret_cast<uint4*>(b.peer[g].fwd_partials) +
                               ((int64_t)t.local * cap.fwd_slots + i) * row_stride};
        copy_row<1, kPushUnroll>(reinterpret_cast<const uint4*>(self.fwd_rows) + slot * row_stride, dst, a.row_vecs,
                                 lane);
      }
      publish_flag(b.peer[g].partial_flags + (int64_t)t.local * cap.fwd_chunks + chunk, tag, lane);
    }
    arrivals.wait(b, self.partial_flags, cap.fwd_chunks, b.home_sig, tag, kKernelCombine, kPhasePartials,
                  kPhaseHomePartials, worker * kWarpSize + lane, workers * kWarpSize);
  }

  grid.sync();
  if (blockIdx.x == 0 && threadIdx.x == 0) b.calls[kCombineLike] = tag;
}

void launch_combine(const Buffers& b, const CombineArgs& a, bool bf16, int num_blocks, cudaStream_t stream) {
  const Buffers* device = b.on_device;
  void* params[] = {&device, const_cast<CombineArgs*>(&a)};
  const void* fn = bf16 ? reinterpret_cast<const void*>(combine_kernel<__nv_bfloat16>)
                        : reinterpret_cast<const void*>(combine_kernel<float>);
  launch_cooperative(fn, num_blocks, b.sm_count, 0, params, stream, "combine");
}

}  // namespace moe_comm
