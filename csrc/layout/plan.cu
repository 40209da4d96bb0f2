// Plan: where each of this rank's tokens goes, before anything moves.
//
// Two passes around a scan (layout/scan.cu), all local:
//   count   one warp per run of kRunLength tokens, in token order: for each token, the ranks
//           its picks live on (once per rank) and the other nodes they live on (once per node);
//           a token's position for a rank or node is the warp's running count there;
//   assign  adds each run's offset, so a token's position is its index among this rank's
//           tokens for that rank (the recv slot it gets there, counted within the source) or
//           node (its send slot, pooled over nodes in node order).
// Bad routing (an expert id out of range, a token picking one expert twice) raises an error
// word; such picks go nowhere.
#include <cuda_runtime.h>

#include "common/launch.h"
#include "common/vec.cuh"
#include "layout/layout.h"

namespace moe_comm {

__global__ void __launch_bounds__(kLocalThreads) plan_count_kernel(const Buffers b, const PlanArgs a) {
  extern __shared__ int32_t smem[];
  const Topology t = b.topo;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int run = blockIdx.x * kLocalWarps + warp;
  const int W = t.world, N = t.nodes, columns = W + N;
  const int L = a.num_experts / W, K = a.top_k;
  int32_t* hist = smem + warp * columns;
  if (run >= a.runs) return;
  for (int c = lane; c < columns; c += kWarpSize) hist[c] = 0;
  __syncwarp();

  const int end = min(a.num_tokens, (run + 1) * kRunLength);
  for (int tok = run * kRunLength; tok < end; ++tok) {
    int expert = -1 - lane;  // distinct per lane where there is no valid pick
    if (lane < K) {
      const int64_t e = a.topk_idx[(int64_t)tok * K + lane];
      if (e >= 0 && e < a.num_experts) {
        expert = (int)e;
      } else {
        b.wait.errors[kErrorExpertIndex] = 1;
      }
    }
    const unsigned same_expert = __match_any_sync(0xffffffffu, expert);
    if (expert >= 0 && __popc(same_expert) > 1) {
      b.wait.errors[kErrorDuplicateExpert] = 1;
      if (lane != __ffs(same_expert) - 1) expert = -1 - lane;  // the first pick of it counts
    }
    const int dest = expert >= 0 ? expert / L : -1 - lane;
    const unsigned same_dest = __match_any_sync(0xffffffffu, dest);
    const int dest_leader = __ffs(same_dest) - 1;
    int pos = 0;
    if (dest >= 0 && lane == dest_leader) pos = hist[dest]++;
    pos = __shfl_sync(0xffffffffu, pos, dest_leader);
    if (lane < K) a.pick_pos[(int64_t)tok * K + lane] = dest >= 0 ? pos : -1;

    const int node = dest >= 0 ? dest / t.local_size : -1;
    const int node_key = (node >= 0 && node != t.node) ? node : -1 - lane;
    const unsigned same_node = __match_any_sync(0xffffffffu, node_key);
    if (lane < N) a.send_idx[(int64_t)tok * N + lane] = -1;
    __syncwarp();
    if (node_key >= 0 && lane == __ffs(same_node) - 1) a.send_idx[(int64_t)tok * N + node_key] = hist[W + node_key]++;
    __syncwarp();
  }
  for (int c = lane; c < columns; c += kWarpSize) a.run_counts[(int64_t)c * a.runs + run] = hist[c];
}

__global__ void __launch_bounds__(kLocalThreads) plan_assign_kernel(const Buffers b, const PlanArgs a) {
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
  const int tok = blockIdx.x * blockDim.x + threadIdx.x;
  if (tok >= a.num_tokens) return;
  const int run = tok / kRunLength;
  int32_t* rank_pos = a.rank_pos + (int64_t)tok * G;
  for (int h = 0; h < G; ++h) rank_pos[h] = -1;
  for (int k = 0; k < K; ++k) {
    const int64_t i = (int64_t)tok * K + k;
    const int local_pos = a.pick_pos[i];
    if (local_pos < 0) continue;
    const int dest = (int)(a.topk_idx[i] / L);
    const int pos = local_pos + a.run_counts[(int64_t)dest * a.runs + run];
    a.pick_pos[i] = pos;
    if (dest / G == t.node) rank_pos[dest % G] = pos;
  }
  for (int m = 0; m < N; ++m) {
    int32_t* s = a.send_idx + (int64_t)tok * N + m;
    if (*s >= 0) *s += send_off[m] + a.run_counts[(int64_t)(W + m) * a.runs + run];
  }
}

void launch_plan(const Buffers& b, const PlanArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) {
    MOE_COMM_CUDA_CHECK(cudaMemsetAsync(a.column_totals, 0, (b.topo.world + b.topo.nodes) * sizeof(int32_t), stream));
    return;
  }
  const int columns = b.topo.world + b.topo.nodes;
  const size_t smem = (size_t)kLocalWarps * columns * sizeof(int32_t);
  if (smem > 48 * 1024) {
    MOE_COMM_CUDA_CHECK(cudaFuncSetAttribute(plan_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  }
  plan_count_kernel<<<(a.runs + kLocalWarps - 1) / kLocalWarps, kLocalThreads, smem, stream>>>(b, a);
  MOE_COMM_CHECK_LAUNCH("plan_count");
  launch_scan(ScanArgs{a.run_counts, a.column_totals, a.runs, columns}, stream);
  plan_assign_kernel<<<(a.num_tokens + kLocalThreads - 1) / kLocalThreads, kLocalThreads, 0, stream>>>(b, a);
  MOE_COMM_CHECK_LAUNCH("plan_assign");
}

}  // namespace moe_comm
