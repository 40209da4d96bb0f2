// Receive layout, first pass: for every recv slot that arrived, in partition-major order, the
// pick's position among this call's rows for its local expert, counted per run of kRunLength
// slots by one warp (layout/scan.cu then offsets the runs, and expand turns positions into rows
// of the expert-major layout). Slot order is fixed by the senders' token order, so the layout,
// and the grouped GEMM's summation order with it, is the same on every replay.
#include "common/launch.h"
#include "layout/layout.h"
#include "layout/slots.cuh"

namespace moe_comm {

__global__ void __launch_bounds__(kLocalThreads) receive_count_kernel(const Buffers b, const ReceiveArgs a) {
  extern __shared__ int32_t smem[];
  const Topology t = b.topo;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int run = blockIdx.x * kLocalWarps + warp;
  const int L = a.local_experts, K = a.top_k;
  if (run >= a.runs) return;
  int32_t* hist = smem + warp * L;
  for (int e = lane; e < L; e += kWarpSize) hist[e] = 0;
  __syncwarp();

  const RecvSlots slots(a.recv_counts, t.local_size, b.cap.fwd_slots);
  const RecvMeta* metas = b.peer[t.local].fwd_meta;
  const int end = min(slots.total(), (run + 1) * kRunLength);
  for (int f = run * kRunLength; f < end; ++f) {
    int g, i;
    const int64_t slot = slots.locate(f, g, i);
    const RecvMeta* m = metas + slot;
    int local = -1 - lane;
    float weight = 0.f;
    if (lane < K) {
      const int e = m->expert[lane] - t.rank * L;
      if (e >= 0 && e < L) {
        local = e;
        weight = m->weight[lane];
      }
    }
    const unsigned same = __match_any_sync(0xffffffffu, local);
    if (local >= 0 && lane != __ffs(same) - 1) local = -1 - lane;  // a duplicate pick (the plan raised)
    if (lane < K) {
      a.slot_rows[slot * K + lane] = local >= 0 ? hist[local]++ : -1;
      a.slot_w[slot * K + lane] = local >= 0 ? weight : 0.f;
    }
    if (lane == 0) a.slot_origin[slot] = (g == t.local && m->origin >= 0) ? -(m->origin + 2) : m->token;
    __syncwarp();
  }
  for (int e = lane; e < L; e += kWarpSize) a.run_counts[(int64_t)e * a.runs + run] = hist[e];
}

void launch_receive_layout(const Buffers& b, const ReceiveArgs& a, cudaStream_t stream) {
  const size_t smem = (size_t)kLocalWarps * a.local_experts * sizeof(int32_t);
  if (smem > 48 * 1024) {
    MOE_COMM_CUDA_CHECK(
        cudaFuncSetAttribute(receive_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  }
  receive_count_kernel<<<(a.runs + kLocalWarps - 1) / kLocalWarps, kLocalThreads, smem, stream>>>(b, a);
  MOE_COMM_CHECK_LAUNCH("receive_layout");
  launch_scan(ScanArgs{a.run_counts, a.column_totals, a.runs, a.local_experts}, stream);
}

}  // namespace moe_comm
