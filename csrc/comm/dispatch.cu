// Dispatch: every token crosses the network once per other node it goes to, and NVLink once
// per rank of a node that holds one of its experts; the call ends when every row meant for
// this rank has arrived. The expert-major layout is built afterwards by local kernels.
// The same kernel, with `backward`, moves combine's output gradient along the forward's routes.
//
// One cooperative launch of `num_blocks` blocks, no host synchronisation:
//   1. begin   buffers free on both hops (protocol.cuh); forward: each rank sends its counts
//              (send slots per node, recv slots per rank of the destination node) to every rank
//              of its rail, and every rank computes the same offsets from them (RailPlan).
//   2. roles   network senders (the first `network_blocks` blocks, only on several nodes): put
//              this rank's send slots (layout/pack.cu) to their forwarders, a chunk per put
//              with a signal;
//              forwarders (the rest): for this rank's own tokens, and for each chunk of net slots
//              once its signal is up, store the row and (forward) the slot's metadata into every
//              rank of the node that holds one of the token's experts, at its recv slot.
//   3. end     each forwarder tells each rank of the node how many slots it delivered (after a
//              grid sync: everything stored before it is visible first), and waits for the same
//              from every forwarder of the node.
// Slots beyond a buffer's capacity are not sent, identically on both sides of each hop, so no
// wait is left hanging; an error word names the buffer and the host fails the step.
#include <cooperative_groups.h>

#include "comm/comm.h"
#include "comm/protocol.cuh"
#include "common/copy.cuh"

namespace cg = cooperative_groups;

namespace moe_comm {

__global__ void __launch_bounds__(kCommThreads, 1) dispatch_kernel(const Buffers* __restrict__ buffers, const DispatchArgs a) {
  const Buffers& b = *buffers;
  __shared__ RailPlan plan;
  __shared__ ChunkList items;
  __shared__ int item_count[kMaxNodes];
  cg::grid_group grid = cg::this_grid();
  const Topology t = b.topo;
  const Capacity cap = b.cap;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int N = t.nodes, G = t.local_size, K = a.top_k;
  const uint32_t tag = b.calls[kDispatchLike] + 1;
  const int slot_bytes = cap.net_slot_bytes();

  // ---- 1. begin ----------------------------------------------------------------------------
  if (blockIdx.x == 0 && threadIdx.x < G) b.delivered[threadIdx.x] = 0;
  begin_call(b, kDispatchLike, tag, kKernelDispatch, true, true);
  if (!a.backward && blockIdx.x == 0 && threadIdx.x >= 32 && threadIdx.x - 32 < N) {
    send_rail_counts(b, a.send_counts, tag, threadIdx.x - 32);
  }
  grid.sync();
  if (threadIdx.x == 0) {
    if (!a.backward) {
      for (int n = 0; n < N; ++n) wait_rail_counts(b, tag, n);
    }
    fill_rail_plan(plan, a.backward ? a.rail_counts : b.rail_counts, t, cap);
    for (int n = 0; n < N; ++n) item_count[n] = plan.net_count[n];
    // This rank's own tokens, in chunks of kChunkSlots tokens, for the other ranks of the node
    // (their slots at this rank itself were written by the plan).
    item_count[t.node] = G > 1 ? a.num_tokens : 0;
    items.build(item_count, N);
    if (blockIdx.x == 0 && plan.net_overflow > 0) {
      b.wait.errors[kErrorSlotsBuffer] = kSlotsNetwork;
      b.wait.errors[kErrorSlotsNeeded] = plan.net_overflow;
    }
  }
  __syncthreads();
  if (!a.backward && blockIdx.x == 0) {
    for (int i = threadIdx.x; i < N * (N + G); i += blockDim.x) a.rail_counts[i] = b.rail_counts[i];
  }

  // ---- 2. roles ----------------------------------------------------------------------------
  const int network_blocks = N > 1 ? a.network_blocks : 0;
  if ((int)blockIdx.x < network_blocks) {
    const int senders = network_blocks * kCommWarps;
    const int sender = blockIdx.x * kCommWarps + warp;
    for (int m = 0; m < N; ++m) {
      if (m == t.node) continue;
      const int count = plan.dest_count[m];
      for (int c = sender; c * kChunkSlots < count; c += senders) {
        const int n_slots = min(kChunkSlots, count - c * kChunkSlots);
        put_chunk(b, b.net_slots + (int64_t)(plan.dest_off[m] + c * kChunkSlots) * slot_bytes,
                  b.send_slots + (int64_t)(plan.send_off[m] + c * kChunkSlots) * slot_bytes,
                  (size_t)n_slots * slot_bytes, b.net_sig + (int64_t)t.node * cap.chunks + c, tag, m);
      }
    }
    __syncwarp();
    nvshmem_quiet();  // the send slots are restaged by the next call
  } else {
    const int forwarders = (gridDim.x - network_blocks) * kCommWarps;
    const int forwarder = (blockIdx.x - network_blocks) * kCommWarps + warp;
    const Peer& self = b.peer[t.local];
    int delivered = 0;  // lane h: recv slots this warp delivered to rank h of the node
    for (int item = forwarder; item < items.total(); item += forwarders) {
      int n, c;
      items.locate(item, n, c);
      const bool own = n == t.node;
      if (!own && !wait_equal<uint64_t>(b.net_sig + (int64_t)n * cap.chunks + c, tag, b.wait, kKernelDispatch,
                                        kPhaseNetworkRows, t.rank_of(n, t.local))) {
        continue;
      }
      const int first = c * kChunkSlots;
      const int n_slots = min(kChunkSlots, (own ? a.num_tokens : plan.net_count[n]) - first);
      for (int j = first; j < first + n_slots; ++j) {
        const int64_t s = own ? -1 : plan.net_off[n] + j;  // the net slot
        const uint8_t* net = own ? nullptr : b.net_slots + s * slot_bytes;
        const NetMeta* meta = reinterpret_cast<const NetMeta*>(net);
        // This slot's recv slot at each rank of the node (lane h), -1: not delivered there.
        int idx = -1;
        if (lane < G) {
          if (a.backward && !own) {
            idx = a.net_route[s * G + lane];
          } else if (!(own && lane == t.local)) {
            const int pos = own ? a.rank_pos[(int64_t)j * G + lane] : meta->rank_pos[lane];
            idx = pos >= 0 ? plan.fwd_off[lane][n] + pos : -1;
            if (idx >= cap.fwd_slots) {
              b.wait.errors[kErrorSlotsBuffer] = kSlotsForwarded;
              b.wait.errors[kErrorSlotsNeeded] = plan.fwd_total[lane];
              idx = -1;
            }
          }
          if (!a.backward && !own) a.net_route[s * G + lane] = idx;
        }
        if (__ballot_sync(0xffffffffu, idx >= 0) == 0) continue;
        delivered += idx >= 0;

        uint4* dst[kMaxRanksPerNode];
#pragma unroll
        for (int h = 0; h < kMaxRanksPerNode; ++h) {
          const int ih = __shfl_sync(0xffffffffu, idx, h < G ? h : 0);
          dst[h] = (h < G && h != t.local && ih >= 0)
                       ? reinterpret_cast<uint4*>(b.peer[h].fwd_rows + ((int64_t)t.local * cap.fwd_slots + ih) * cap.row_bytes)
                       : nullptr;
        }
        const uint4* src = own ? static_cast<const uint4*>(a.own_rows) + (int64_t)j * a.wire_vecs
                               : reinterpret_cast<const uint4*>(net + kNetMetaBytes);
        // A slot kept by this rank alone stays where it is (expand reads it there).
        if (__ballot_sync(0xffffffffu, lane < G && lane != t.local && idx >= 0) != 0) {
          copy_row(src, dst, a.wire_vecs, lane);
        }

        if (a.backward) continue;
        int expert = 0;
        float weight = 0.f;
        if (lane < K) {
          expert = own ? (int)a.topk_idx[(int64_t)j * K + lane] : meta->expert[lane];
          weight = own ? a.topk_w[(int64_t)j * K + lane] : meta->weight[lane];
        }
        const int token = own ? j : meta->token;
        for (int h = 0; h < G; ++h) {
          const int ih = __shfl_sync(0xffffffffu, idx, h);
          if (ih < 0) continue;
          RecvMeta* m = b.peer[h].fwd_meta + (int64_t)t.local * cap.fwd_slots + ih;
          if (lane == 0) {
            m->token = token;
            m->origin = (h == t.local && !own) ? (int32_t)s : -1;
          }
          if (lane < K) {
            m->expert[lane] = expert;
            m->weight[lane] = weight;
          }
        }
      }
    }
    __threadfence_system();  // this warp's stores before the delivery counts (step 3)
    if (lane < G && delivered > 0) atomicAdd(b.delivered + lane, (uint32_t)delivered);
    (void)self;
  }

  // ---- 3. end ------------------------------------------------------------------------------
  grid.sync();
  if (blockIdx.x == 0) {
    const int h = threadIdx.x;
    if (h < G) {
      const uint32_t count = *(volatile uint32_t*)(b.delivered + h);
      if (h != t.local) {
        announce_delivered(b, count, tag, h);
      } else if (!a.backward) {  // and the own tokens' slots here, from the plan
        a.recv_counts[h] = (int32_t)count + min(a.send_counts[t.rank], cap.fwd_slots);
      }
    }
    if (h < G && h != t.local) {
      const int count = wait_delivered(b, tag, h);
      if (!a.backward) a.recv_counts[h] = count;
    }
    __syncthreads();
    if (threadIdx.x == 0) b.calls[kDispatchLike] = tag;
  }
}

void launch_dispatch(const Buffers& b, const DispatchArgs& a, int num_blocks, cudaStream_t stream) {
  const Buffers* device = b.on_device;
  void* params[] = {&device, const_cast<DispatchArgs*>(&a)};
  launch_cooperative(reinterpret_cast<const void*>(dispatch_kernel), num_blocks, b.sm_count, 0, params, stream,
                     "dispatch");
}

}  // namespace moe_comm
