// Dispatch, the communication half: every token crosses NVLink once per rank that holds one of
// its experts, with its routing metadata; the call ends when every row meant for this rank has
// arrived. The expert-major layout for TorchTitan's grouped GEMM is a separate local kernel
// (expand.cu), so the link is driven by this kernel's small SM budget alone.
//
// A token's slot at every destination is its own index on the source rank, so rows can move
// before any prefix sum: slots from a source run 0..its token count, with holes for tokens that
// do not go there (their metadata says so). One cooperative launch of `num_blocks` blocks, no
// host synchronisation:
//   1. rows     each warp walks a contiguous run of tokens in order: it counts rows per expert
//               (ranks are exact and deterministic: token order) and pushes each token's row to
//               every other rank that holds one of its experts (the own rank's rows stay in x).
//   2. grid sync; block offsets turn per-warp counts into positions; block 0 sends each
//               destination its per-expert row counts and this rank's token count.
//   3. grid sync; then two roles run at once:
//      senders    write each token's metadata at every destination (absent where the token does
//                 not go) and release a per-slot flag;
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
  const int columns = E;  // rows per expert
  const uint32_t tag = buf.calls[kDispatchLikeCalls] + 1;
  const int row_stride = buf.max_row_bytes / 16;  // uint4 per row in the symmetric buffers
  const uint4* x = static_cast<const uint4*>(a.x);

  // ---- 1. per-warp counts in shared memory, and the rows on their way ----------------------
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
    unsigned sent = 0;  // bit d: the token goes to rank d
    for (int d = 0; d < world; ++d) sent |= (__any_sync(0xffffffffu, dest == d) ? 1u : 0u) << d;
    const int my_slot = lane < world && ((sent >> lane) & 1u) ? t : -1;  // lane d: slot at rank d
    if (lane < world) a.token_slot[(int64_t)t * world + lane] = my_slot;
    uint4* dst[kMaxRanks];
    peer_row_destinations(dst, buf.peer_rows, my_slot, world, rank, buf.max_tokens, row_stride);
    copy_row(x + (int64_t)t * a.row_vecs, dst, a.row_vecs, lane);
  }
  // This warp's rows have reached their peers before any flag of phase 3 (raised by any warp
  // after the grid syncs) can announce them.
  __threadfence_system();
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
  }
  if (blockIdx.x == 0) {
    // Row `rank` of each destination's counts: [slots sent (this rank's token count), rows for
    // each of its experts].
    for (int c = threadIdx.x; c < columns; c += blockDim.x) {
      int total = 0;
      for (int b = 0; b < (int)gridDim.x; ++b) total += buf.block_hist[(int64_t)b * (kMaxExperts + kMaxRanks) + c];
      buf.peer_counts[c / L][rank * (kMaxExperts + 1) + 1 + c % L] = total;
    }
    if (threadIdx.x < world) buf.peer_counts[threadIdx.x][rank * (kMaxExperts + 1)] = a.num_tokens;
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x < world) store_release_sys(buf.peer_counts_flag[threadIdx.x] + rank, tag);
  }
  __threadfence();
  grid.sync();

  // ---- 3. senders and receivers --------------------------------------------------------
  if (warp < a.sender_warps) {
    const int senders = gridDim.x * a.sender_warps;
    const int sender = blockIdx.x * a.sender_warps + warp;
    for (int t = sender; t < a.num_tokens; t += senders) {
      const int my_slot = lane < world ? a.token_slot[(int64_t)t * world + lane] : -1;
      int64_t expert = -1;
      int rank_in_expert = -1;
      float weight = 0.f;
      if (lane < K) {
        expert = a.topk_idx[(int64_t)t * K + lane];
        weight = a.topk_w[(int64_t)t * K + lane];
        rank_in_expert = buf.token_rank[(int64_t)t * kMaxTopK + lane];
      }
      // Metadata at every destination, the own rank included; where the token does not go,
      // only its absence.
      for (int d = 0; d < world; ++d) {
        const bool here_any = __shfl_sync(0xffffffffu, my_slot, d) >= 0;
        SlotMeta* m = buf.peer_meta[d] + (int64_t)rank * buf.max_tokens + t;
        if (lane == 0) m->token = here_any ? t : -1;
        if (here_any && lane < K) {
          const bool here = expert >= 0 && expert < E && expert / L == d;
          m->expert[lane] = here ? (int)expert : -1;
          m->rank_in_expert[lane] = here ? rank_in_expert : -1;
          m->weight[lane] = weight;
        }
      }
      __threadfence_system();
      __syncwarp();
      if (lane < world) store_release_sys(buf.peer_slot_flag[lane] + (int64_t)rank * buf.max_tokens + t, tag);
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
      const int token = m->token;  // -1: source token s:j does not come here
      if (lane < K) {
        const int expert = token >= 0 ? m->expert[lane] : -1;
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
      if (lane == 0) a.slot_token[slot_index] = token;
    }
  }

  grid.sync();
  if (blockIdx.x == 0 && threadIdx.x == 0) buf.calls[kDispatchLikeCalls] = tag;
}

size_t dispatch_smem_bytes(int num_experts, int world) {
  const size_t hist = (size_t)kWarpsPerBlock * num_experts * sizeof(int32_t);
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
