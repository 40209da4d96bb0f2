// Dispatch, the communication half: every token crosses NVLink once per rank that holds one of
// its experts, with its routing metadata; the call ends when every row meant for this rank has
// arrived. The expert-major layout for TorchTitan's grouped GEMM is a separate local kernel
// (expand.cu), so the link is driven by this kernel's small SM budget alone.
//
// One cooperative launch of `num_blocks` blocks, no host synchronisation:
//   1. layout   each warp walks a contiguous run of tokens in order, counting rows per expert
//               and slots per destination rank; ranks are exact and deterministic (token order).
//   2. grid sync; block offsets turn per-warp counts into positions; block 0 sends each
//               destination its per-expert row counts.
//   3. grid sync; then two roles run at once:
//      senders    push each token's row into every other destination's `rows` buffer (the own
//                 rank's rows stay in x) and its metadata to every destination, then release a
//                 per-slot flag;
//      receivers  wait for the counts of every source, compute the expert-major segments, then
//                 wait for every slot and record where its rows go (the handle expand and
//                 combine use).
// Rows that would land beyond the receive capacity are marked as not placed; an error word with
// the rows needed is raised for the host, which fails the step.
#include <cooperative_groups.h>

#include "buffers.h"
#include "common.cuh"
#include "launch.h"

namespace cg = cooperative_groups;

namespace moe_comm {

__global__ void __launch_bounds__(kThreadsPerBlock, 1)
    dispatch_kernel(const Buffers buf, const DispatchArgs a) {
  extern __shared__ int32_t smem[];
  cg::grid_group grid = cg::this_grid();
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  const int world = buf.world, rank = buf.rank;
  const int E = a.num_experts, K = a.top_k, L = E / world;
  const int columns = E + world;  // rows per expert, then slots per destination rank
  const uint32_t tag = buf.calls[kDispatchLikeCalls] + 1;

  // ---- 1. layout: per-warp counts, in shared memory -------------------------------------
  int32_t* warp_hist = smem;  // [kWarpsPerBlock][columns]
  int32_t* my_hist = warp_hist + warp * columns;
  for (int c = lane; c < columns; c += kWarpSize) my_hist[c] = 0;
  __syncwarp();

  const int total_warps = gridDim.x * kWarpsPerBlock;
  const int global_warp = blockIdx.x * kWarpsPerBlock + warp;
  const int chunk = (a.num_tokens + total_warps - 1) / total_warps;
  const int t_begin = min(a.num_tokens, global_warp * chunk);
  const int t_end = min(a.num_tokens, t_begin + chunk);

  for (int t = t_begin; t < t_end; ++t) {
    int expert = -1;
    if (lane < K) {
      const int64_t e = a.topk_idx[(int64_t)t * K + lane];
      if (e >= 0 && e < E) {
        expert = (int)e;
      } else {
        buf.errors[kErrorExpertIndex] = 1;
      }
    }
    // A token must pick distinct experts: then lanes never collide on one counter.
    const unsigned same_expert = __match_any_sync(0xffffffffu, expert);
    if (expert >= 0 && __popc(same_expert) > 1) {
      buf.errors[kErrorDuplicateExpert] = 1;
      expert = -1;
    }
    const int dest = expert >= 0 ? expert / L : -1;
    if (expert >= 0) buf.token_rank[(int64_t)t * kMaxTopK + lane] = my_hist[expert]++;
    for (int d = 0; d < world; ++d) {
      const bool sent = __any_sync(0xffffffffu, dest == d);
      if (lane == 0) a.token_slot[(int64_t)t * world + d] = sent ? my_hist[E + d]++ : -1;
      __syncwarp();
    }
  }
  __syncthreads();

  // Exclusive prefix over the block's warps per column; block totals to global memory.
  int32_t* block_hist = buf.block_hist + (int64_t)blockIdx.x * (kMaxExperts + kMaxRanks);
  for (int c = threadIdx.x; c < columns; c += blockDim.x) {
    int running = 0;
    for (int w = 0; w < kWarpsPerBlock; ++w) {
      const int v = warp_hist[w * columns + c];
      warp_hist[w * columns + c] = running;
      running += v;
    }
    block_hist[c] = running;
  }
  __threadfence();
  grid.sync();

  // ---- 2. positions, and the counts every destination needs ----------------------------
  for (int c = threadIdx.x; c < columns; c += blockDim.x) {
    int base = 0;
    for (int b = 0; b < (int)blockIdx.x; ++b) base += buf.block_hist[(int64_t)b * (kMaxExperts + kMaxRanks) + c];
    for (int w = 0; w < kWarpsPerBlock; ++w) warp_hist[w * columns + c] += base;
  }
  __syncthreads();
  for (int t = t_begin; t < t_end; ++t) {
    if (lane < K) {
      const int64_t e = a.topk_idx[(int64_t)t * K + lane];
      if (e >= 0 && e < E) buf.token_rank[(int64_t)t * kMaxTopK + lane] += my_hist[e];
    }
    if (lane < world) {
      int32_t* slot = a.token_slot + (int64_t)t * world + lane;
      if (*slot >= 0) *slot += my_hist[E + lane];
    }
  }
  if (blockIdx.x == 0) {
    for (int c = threadIdx.x; c < columns; c += blockDim.x) {
      int total = 0;
      for (int b = 0; b < (int)gridDim.x; ++b) total += buf.block_hist[(int64_t)b * (kMaxExperts + kMaxRanks) + c];
      // Row `rank` of the destination's counts: [slots sent, rows for each of its experts].
      if (c < E) {
        buf.peer_counts[c / L][rank * (kMaxExperts + 1) + 1 + c % L] = total;
      } else {
        buf.peer_counts[c - E][rank * (kMaxExperts + 1)] = total;
      }
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x < world) store_release_sys(buf.peer_counts_flag[threadIdx.x] + rank, tag);
  }
  __threadfence();
  grid.sync();

  // ---- 3. senders and receivers --------------------------------------------------------
  const int row_stride = buf.max_row_bytes / 16;  // uint4 per row in the symmetric buffers
  if (warp < a.sender_warps) {
    const int senders = gridDim.x * a.sender_warps;
    const int sender = blockIdx.x * a.sender_warps + warp;
    const int per_sender = (a.num_tokens + senders - 1) / senders;
    const int s_begin = min(a.num_tokens, sender * per_sender);
    const int s_end = min(a.num_tokens, s_begin + per_sender);
    const uint4* x = static_cast<const uint4*>(a.x);
    for (int t = s_begin; t < s_end; ++t) {
      int my_slot = lane < world ? a.token_slot[(int64_t)t * world + lane] : -1;
      int64_t expert = -1;
      int rank_in_expert = -1;
      float weight = 0.f;
      if (lane < K) {
        expert = a.topk_idx[(int64_t)t * K + lane];
        weight = a.topk_w[(int64_t)t * K + lane];
        rank_in_expert = buf.token_rank[(int64_t)t * kMaxTopK + lane];
      }
      // Metadata to every destination, the own rank included.
      for (int d = 0; d < world; ++d) {
        const int slot = __shfl_sync(0xffffffffu, my_slot, d);
        if (slot < 0) continue;
        SlotMeta* m = buf.peer_meta[d] + (int64_t)rank * buf.max_tokens + slot;
        if (lane == 0) m->token = t;
        if (lane < K) {
          const bool here = expert >= 0 && expert < E && expert / L == d;
          m->expert[lane] = here ? (int)expert : -1;
          m->rank_in_expert[lane] = here ? rank_in_expert : -1;
          m->weight[lane] = weight;
        }
      }
      // The row, loaded once and stored to every other destination.
      uint4* dst[kMaxRanks];
      peer_row_destinations(dst, buf.peer_rows, my_slot, world, rank, buf.max_tokens, row_stride);
      copy_row(x + (int64_t)t * a.row_vecs, dst, a.row_vecs, lane);
      __threadfence_system();
      __syncwarp();
      if (lane < world && my_slot >= 0) {
        store_release_sys(buf.peer_slot_flag[lane] + (int64_t)rank * buf.max_tokens + my_slot, tag);
      }
    }
  } else {
    const int receivers_per_block = kWarpsPerBlock - a.sender_warps;
    const int receivers = gridDim.x * receivers_per_block;
    const int receiver = blockIdx.x * receivers_per_block + (warp - a.sender_warps);
    // Shared layout of this rank's receive side, after the histograms (which are done).
    int32_t* seg_start = smem;                       // [L + 1]
    int32_t* src_prefix = seg_start + L + 1;         // [world][L]
    int32_t* slots_from = src_prefix + world * L;    // [world]
    const int first_receiver = a.sender_warps;

    if (warp == first_receiver) {
      for (int s = 0; s < world; ++s) wait_flag(buf.counts_flag + s, tag);
      int carry = 0;
      for (int base = 0; base < L; base += kWarpSize) {
        const int e = base + lane;
        int count = 0, padded = 0;
        if (e < L) {
          for (int s = 0; s < world; ++s) {
            src_prefix[s * L + e] = count;
            count += buf.counts[s * (kMaxExperts + 1) + 1 + e];
          }
          padded = round_up(count, a.align);
        }
        int scan = padded;  // inclusive warp scan
        for (int o = 1; o < kWarpSize; o *= 2) {
          const int n = __shfl_up_sync(0xffffffffu, scan, o);
          if (lane >= o) scan += n;
        }
        if (e < L) {
          seg_start[e] = carry + scan - padded;
          if (blockIdx.x == 0) {
            // Past the capacity the rows are not placed and the host raises; clamping the
            // counts keeps the grouped GEMM inside recv_x until it does.
            a.tokens_per_expert[e] = min(padded, max(0, a.capacity - (carry + scan - padded)));
            a.recv_info[RecvInfo{world, L}.seg_start(e)] = carry + scan - padded;
            a.recv_info[RecvInfo{world, L}.count(e)] = count;
          }
        }
        carry += __shfl_sync(0xffffffffu, scan, kWarpSize - 1);
      }
      if (lane < world) {
        slots_from[lane] = buf.counts[lane * (kMaxExperts + 1)];
        if (blockIdx.x == 0) a.recv_info[RecvInfo{world, L}.slots_from(lane)] = slots_from[lane];
      }
      if (lane == 0) {
        seg_start[L] = carry;
        if (blockIdx.x == 0 && carry > a.capacity) buf.errors[kErrorRowsNeeded] = carry;
      }
    }
    // Named barrier over the receiver warps of this block only (senders are not waiting).
    asm volatile("bar.sync 1, %0;" ::"r"(receivers_per_block * kWarpSize));

    const SlotOrder order(slots_from, 1, rank, world, false);
    for (int i = receiver; i < order.total(); i += receivers) {
      int s, j;
      order.locate(i, s, j);
      const int64_t slot_index = (int64_t)s * buf.max_tokens + j;
      wait_flag(buf.slot_flag + slot_index, tag);
      const SlotMeta* m = buf.meta + slot_index;
      if (lane < K) {
        const int expert = m->expert[lane];
        int row = -1;
        float weight = 0.f;
        if (expert >= 0) {
          const int e = expert - rank * L;
          row = seg_start[e] + src_prefix[s * L + e] + m->rank_in_expert[lane];
          weight = m->weight[lane];
        }
        a.slot_rows[slot_index * K + lane] = row;
        a.slot_w[slot_index * K + lane] = weight;
      }
      if (lane == 0) a.slot_token[slot_index] = m->token;
    }
  }

  grid.sync();
  if (blockIdx.x == 0 && threadIdx.x == 0) buf.calls[kDispatchLikeCalls] = tag;
}

size_t dispatch_smem_bytes(int num_experts, int world) {
  const size_t hist = (size_t)kWarpsPerBlock * (num_experts + world) * sizeof(int32_t);
  const int L = num_experts / world;
  const size_t layout = (size_t)(L + 1 + world * L + world) * sizeof(int32_t);
  return hist > layout ? hist : layout;
}

void launch_dispatch(const Buffers& buf, const DispatchArgs& args, int num_blocks, cudaStream_t stream) {
  const size_t smem = dispatch_smem_bytes(args.num_experts, buf.world);
  void* params[] = {const_cast<Buffers*>(&buf), const_cast<DispatchArgs*>(&args)};
  launch_cooperative(reinterpret_cast<const void*>(dispatch_kernel), num_blocks, smem, params, stream, "dispatch");
}

}  // namespace moe_comm
