// Plan: where each of this rank's tokens goes, before anything moves.
//
// Two passes around a scan (layout/scan.cu), all local:
//   count   one warp per run of kRunLength tokens: for each token, the ranks its picks live on
//           (once per rank) and the other nodes they live on (once per node); a token's position
//           for a rank or node is the number of earlier tokens of the run that go there;
//   assign  adds each run's offset, so a token's position is its index among this rank's
//           tokens for that rank (the recv slot it gets there, counted within the source) or
//           node (its send slot, pooled over nodes in node order); a token that has experts on
//           this rank gets its recv slot's metadata here (no transfer: the row stays put).
// Bad routing (an expert id out of range, a token picking one expert twice) raises an error
// word; such picks go nowhere.
#include <cuda_runtime.h>

#include "common/launch.h"
#include "common/vec.cuh"
#include "layout/layout.h"

namespace moe_comm {

// One warp counts a run of kRunLength tokens, one token per lane, with no ordered walk: each
// lane sets its bit in the mask of every column (rank, other node) its token hits, and a
// token's position in a column is the number of lower lanes whose bit is set there. Shared
// memory holds one mask per column per warp.
__global__ void __launch_bounds__(kCountThreads) plan_count_kernel(const Buffers* __restrict__ buffers,
                                                                   const PlanArgs a) {
  const Buffers& b = *buffers;
  extern __shared__ uint32_t masks[];
  const Topology t = b.topo;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int run = blockIdx.x * kCountWarps + warp;
  const int W = t.world, N = t.nodes, columns = W + N;
  const int L = a.num_experts / W, K = a.top_k;
  if (run >= a.runs) return;
  uint32_t* mask = masks + warp * columns;
  for (int c = lane; c < columns; c += kWarpSize) mask[c] = 0;
  __syncwarp();

  const int tok = run * kRunLength + lane;
  const bool valid = tok < a.num_tokens;
  const uint32_t bit = 1u << lane, lower = bit - 1;
  int expert[kMaxTopK], dest[kMaxTopK], node[kMaxTopK];
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {
    const int64_t e = (valid && k < K) ? a.topk_idx[(int64_t)tok * K + k] : -1;
    const bool in_range = e >= 0 && e < a.num_experts;
    if (valid && k < K && !in_range) b.wait.errors[kErrorExpertIndex] = 1;
    expert[k] = in_range ? (int)e : -1;
  }
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {
    bool repeat = false;  // the same expert picked twice: the first pick counts
#pragma unroll
    for (int j = 0; j < k; ++j) repeat |= expert[k] >= 0 && expert[j] == expert[k];
    if (repeat) b.wait.errors[kErrorDuplicateExpert] = 1;
    dest[k] = (expert[k] >= 0 && !repeat) ? expert[k] / L : -1;
    node[k] = dest[k] >= 0 ? dest[k] / t.local_size : -1;
  }
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {
    bool first_rank = dest[k] >= 0, first_node = dest[k] >= 0 && node[k] != t.node;
#pragma unroll
    for (int j = 0; j < k; ++j) {
      first_rank &= dest[j] != dest[k];
      first_node &= node[j] != node[k];
    }
    if (first_rank) atomicOr(mask + dest[k], bit);
    if (first_node) atomicOr(mask + W + node[k], bit);
  }
  __syncwarp();
  if (valid) {
#pragma unroll
    for (int k = 0; k < kMaxTopK; ++k) {
      if (k < K) a.pick_pos[(int64_t)tok * K + k] = dest[k] >= 0 ? __popc(mask[dest[k]] & lower) : -1;
    }
    for (int m = 0; m < N; ++m) {
      const uint32_t hit = mask[W + m];
      a.send_idx[(int64_t)tok * N + m] = (hit & bit) ? __popc(hit & lower) : -1;
    }
  }
  for (int c = lane; c < columns; c += kWarpSize) a.run_counts[(int64_t)c * a.runs + run] = __popc(mask[c]);
}

// Assign: kMaxTopK threads per token, thread k for pick k (and for rank k of the node, and for
// every kMaxTopK-th other node), so the token's loads are in flight together.
__global__ void __launch_bounds__(kLocalThreads) plan_assign_kernel(const Buffers* __restrict__ buffers,
                                                                    const PlanArgs a) {
  const Buffers& b = *buffers;
  __shared__ int send_off[kMaxNodes];
  const Topology t = b.topo;
  const int W = t.world, N = t.nodes, G = t.local_size, K = a.top_k, L = a.num_experts / W;
  if (threadIdx.x == 0) {
    int s = 0;
    for (int m = 0; m < N; ++m) {
      send_off[m] = s;
      if (m != t.node) s += a.column_totals[W + m];
    }
  }
  __syncthreads();
  const int index = blockIdx.x * blockDim.x + threadIdx.x;
  const int tok = index / kMaxTopK, k = index % kMaxTopK;
  const int lane = threadIdx.x % kWarpSize, group = lane - k;  // the token's first lane
  const bool valid = tok < a.num_tokens;
  const int run = tok / kRunLength;
  int dest = -1, pos = -1;
  if (valid && k < K) {
    const int64_t i = (int64_t)tok * K + k;
    const int local_pos = a.pick_pos[i];
    if (local_pos >= 0) {
      dest = (int)(a.topk_idx[i] / L);
      pos = local_pos + a.run_counts[(int64_t)dest * a.runs + run];
      a.pick_pos[i] = pos;
    }
  }
  // Rank k of this node: the position of the token's pick that lives there, or -1.
  int here = -1;
#pragma unroll
  for (int j = 0; j < kMaxTopK; ++j) {
    const int dj = __shfl_sync(0xffffffffu, dest, group + j);
    const int pj = __shfl_sync(0xffffffffu, pos, group + j);
    if (dj >= 0 && dj == t.rank_of(t.node, k)) here = pj;
  }
  const int self = __shfl_sync(0xffffffffu, here, group + t.local);  // this rank's own recv slot
  if (!valid) return;
  if (k < G) a.rank_pos[(int64_t)tok * G + k] = here;
  for (int m = k; m < N; m += kMaxTopK) {
    int32_t* s = a.send_idx + (int64_t)tok * N + m;
    if (*s >= 0) *s += send_off[m] + a.run_counts[(int64_t)(W + m) * a.runs + run];
  }
  // The own recv slot's metadata is written here: the row stays put.
  if (self < 0) return;
  if (self >= b.cap.fwd_slots) {
    if (k == 0) {
      b.wait.errors[kErrorSlotsBuffer] = kSlotsForwarded;
      b.wait.errors[kErrorSlotsNeeded] = a.column_totals[t.rank];
    }
    return;
  }
  RecvMeta* m = b.peer[t.local].fwd_meta + (int64_t)t.local * b.cap.fwd_slots + self;
  if (k == 0) {
    m->token = tok;
    m->origin = -1;
  }
  if (k < K) {
    m->expert[k] = (int32_t)a.topk_idx[(int64_t)tok * K + k];
    m->weight[k] = a.topk_w[(int64_t)tok * K + k];
  }
}

void launch_plan(const Buffers& b, const PlanArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) {
    MOE_COMM_CUDA_CHECK(cudaMemsetAsync(a.column_totals, 0, (b.topo.world + b.topo.nodes) * sizeof(int32_t), stream));
    return;
  }
  const int columns = b.topo.world + b.topo.nodes;
  const size_t smem = (size_t)kCountWarps * columns * sizeof(uint32_t);
  if (smem > 48 * 1024) {
    MOE_COMM_CUDA_CHECK(cudaFuncSetAttribute(plan_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  }
  plan_count_kernel<<<(a.runs + kCountWarps - 1) / kCountWarps, kCountThreads, smem, stream>>>(b.on_device, a);
  MOE_COMM_CHECK_LAUNCH("plan_count");
  launch_scan(ScanArgs{a.run_counts, a.column_totals, a.runs, columns}, stream);
  const long long threads = (long long)a.num_tokens * kMaxTopK;
  plan_assign_kernel<<<(int)((threads + kLocalThreads - 1) / kLocalThreads), kLocalThreads, 0, stream>>>(b.on_device,
                                                                                                         a);
  MOE_COMM_CHECK_LAUNCH("plan_assign");
}

}  // namespace moe_comm
