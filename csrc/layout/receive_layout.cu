// Receive layout, first pass: for every recv slot that arrived, in partition-major order, the
// pick's position among this call's rows for its local expert, counted per run of kRunLength
// slots by one warp (layout/scan.cu then offsets the runs, and expand turns positions into rows
// of the expert-major layout). Slot order is fixed by the senders' token order, so the layout,
// and the grouped GEMM's summation order with it, is the same on every replay.
#include "common/launch.h"
#include "layout/layout.h"
#include "layout/slots.cuh"

namespace moe_comm {

// One warp counts a run of kRunLength slots, one slot per lane, as the plan counts tokens: a
// lane sets its bit in the mask of every local expert its slot has a pick for, and a pick's
// position is the number of lower lanes whose bit is set there.
__global__ void __launch_bounds__(kCountThreads) receive_count_kernel(const Buffers* __restrict__ buffers,
                                                                      const ReceiveArgs a) {
  const Buffers& b = *buffers;
  extern __shared__ uint32_t masks[];
  const Topology t = b.topo;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int run = blockIdx.x * kCountWarps + warp;
  const int L = a.local_experts, K = a.top_k;
  if (run >= a.runs) return;
  uint32_t* mask = masks + warp * L;
  for (int e = lane; e < L; e += kWarpSize) mask[e] = 0;
  __syncwarp();

  const RecvSlots slots(a.recv_counts, t.local_size, b.cap.fwd_slots);
  const int f = run * kRunLength + lane;
  const bool valid = f < slots.total();
  const uint32_t bit = 1u << lane, lower = bit - 1;
  int g = 0, i = 0;
  const int64_t slot = valid ? slots.locate(f, g, i) : 0;
  const RecvMeta* m = b.peer[t.local].fwd_meta + slot;
  int local[kMaxTopK];
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {
    local[k] = -1;
    if (valid && k < K) {
      const int e = m->expert[k] - t.rank * L;
      if (e >= 0 && e < L) local[k] = e;
    }
  }
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {
    bool first = local[k] >= 0;  // a repeated pick (the plan raised) counts once
#pragma unroll
    for (int j = 0; j < k; ++j) first &= local[j] != local[k];
    if (!first) local[k] = -1;
    if (first) atomicOr(mask + local[k], bit);
  }
  __syncwarp();
  if (valid) {
#pragma unroll
    for (int k = 0; k < kMaxTopK; ++k) {
      if (k >= K) continue;
      a.slot_pos[slot * K + k] = local[k] >= 0 ? __popc(mask[local[k]] & lower) : -1;
      a.slot_expert[slot * K + k] = local[k];
      a.slot_w[slot * K + k] = local[k] >= 0 ? m->weight[k] : 0.f;
    }
    a.slot_origin[slot] = (g == t.local && m->origin >= 0) ? -(m->origin + 2) : m->token;
  }
  for (int e = lane; e < L; e += kWarpSize) a.run_counts[(int64_t)e * a.runs + run] = __popc(mask[e]);
}

void launch_receive_layout(const Buffers& b, const ReceiveArgs& a, cudaStream_t stream) {
  const size_t smem = (size_t)kCountWarps * a.local_experts * sizeof(uint32_t);
  if (smem > 48 * 1024) {
    MOE_COMM_CUDA_CHECK(
        cudaFuncSetAttribute(receive_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  }
  receive_count_kernel<<<(a.runs + kCountWarps - 1) / kCountWarps, kCountThreads, smem, stream>>>(b.on_device, a);
  MOE_COMM_CHECK_LAUNCH("receive_layout");
  launch_scan(ScanArgs{a.run_counts, a.column_totals, a.runs, a.local_experts}, stream);
}

}  // namespace moe_comm
