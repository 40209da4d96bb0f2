// Reduce: each recv slot's expert outputs, summed with the routing weights, staged for the
// combine communication kernel. A token of this rank whose experts all live here never left:
// its sum is its output row, stored there at once (finalize skips it).
//
// A local kernel over the whole GPU. Slot (g, i) gets sum_k w_k * y[row_k] over its picks on
// this rank, accumulated in fp32 and stored in the model dtype at fwd_rows[g][i]: the buffer
// that held the dispatch arrivals, free again once they were expanded. So a token's partial sum
// goes back along its route once per rank, as its row came. With slot_w == nullptr the weights
// are 1: the backward of dispatch (a copied row's gradient is the sum of its copies').
#include <cuda_bf16.h>

#include "common/copy.cuh"
#include "common/launch.h"
#include "common/vec.cuh"
#include "layout/layout.h"
#include "layout/slots.cuh"

namespace moe_comm {

// Picks whose loads add_slot issues before it uses the first: more loads in flight per lane,
// bounded by the 64 registers a thread has at two 512-thread blocks per SM.
constexpr int kPicksInFlight = 4;

template <typename T>
__device__ __forceinline__ void add_slot(float (&acc)[Vec<T>::kElems], const SlotRows& r, const uint4* y,
                                         int row_vecs, int v) {
#pragma unroll
  for (int k0 = 0; k0 < kMaxTopK; k0 += kPicksInFlight) {
    uint4 value[kPicksInFlight];
#pragma unroll
    for (int k = 0; k < kPicksInFlight; ++k) {
      if (r.row[k0 + k] >= 0) value[k] = __ldg(y + (int64_t)r.row[k0 + k] * row_vecs + v);
    }
#pragma unroll
    for (int k = 0; k < kPicksInFlight; ++k) {
      if (r.row[k0 + k] >= 0) accumulate<T>(acc, value[k], r.weight[k0 + k]);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kLocalThreads, kLocalBlocksPerSM) reduce_kernel(const Buffers* __restrict__ buffers, const ReduceArgs a) {
  const Buffers& b = *buffers;
  const int lane = threadIdx.x % kWarpSize;
  const int warps = gridDim.x * kLocalWarps;
  const int warp = blockIdx.x * kLocalWarps + threadIdx.x / kWarpSize;
  const uint4* y = static_cast<const uint4*>(a.y);
  uint4* staged = reinterpret_cast<uint4*>(b.peer[b.topo.local].fwd_rows);
  const int row_stride = b.cap.row_bytes / 16;

  const RecvSlots slots(a.recv_counts, b.topo.local_size, b.cap.fwd_slots);
  const RowSplit split(slots.total(), warps);
  for (int item = warp; item < slots.total() * split.parts; item += warps) {
    int g, i;
    const int64_t slot = slots.locate(item / split.parts, g, i);
    int begin, end;
    split.range(item % split.parts, a.row_vecs, begin, end);
    const SlotRows r = load_slot_rows(a.slot_rows, a.slot_w, slot, a.top_k, a.capacity, lane);
    const int token = g == b.topo.local ? a.slot_origin[slot] : -1;  // this rank's own token, or -1
    uint4* dst = (token >= 0 && stays_home(b.topo, a.rank_pos, a.send_idx, token, lane))
                     ? static_cast<uint4*>(a.out) + (int64_t)token * a.row_vecs
                     : staged + slot * row_stride;
    for (int v = begin + lane; v < end; v += kWarpSize) {
      float acc[Vec<T>::kElems] = {};
      add_slot<T>(acc, r, y, a.row_vecs, v);
      dst[v] = pack<T>(acc, 1.f);
    }
  }
}

void launch_reduce(const Buffers& b, const ReduceArgs& a, bool bf16, cudaStream_t stream) {
  const int blocks = b.sm_count * kLocalBlocksPerSM;
  if (bf16) {
    reduce_kernel<__nv_bfloat16><<<blocks, kLocalThreads, 0, stream>>>(b.on_device, a);
  } else {
    reduce_kernel<float><<<blocks, kLocalThreads, 0, stream>>>(b.on_device, a);
  }
  MOE_COMM_CHECK_LAUNCH("reduce");
}

}  // namespace moe_comm
