// Reduce: each received slot's expert outputs, summed with the routing weights, staged
// token-major for the combine communication kernel.
//
// A local kernel over the whole GPU. Slot (s, j) gets sum_k w_k * y[row_k] over its picks on
// this rank, accumulated in fp32 and stored in the model dtype at `rows`[s][j]: the symmetric
// buffer that held the dispatch arrivals, free again once they were expanded, and never written
// by a peer before that peer has received this combine's results. So a token's partial crosses
// NVLink once per rank on the way back, as its row did on the way out.
// With slot_w == nullptr the weights are 1: the backward of dispatch (the gradient of a copied
// row is the sum of its copies' gradients).
#include <cuda_bf16.h>

#include "buffers.h"
#include "common.cuh"
#include "launch.h"

namespace moe_comm {

// Picks whose loads add_slot issues before it uses the first: more loads in flight per lane,
// bounded by the 64 registers a thread has at two 512-thread blocks per SM.
constexpr int kPicksInFlight = 4;

// acc += sum over the slot's picks of weight * y[row], for the lane's vector v.
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
__global__ void __launch_bounds__(kLocalThreadsPerBlock, kLocalBlocksPerSM)
    reduce_kernel(const Buffers buf, const ReduceArgs a) {
  const int lane = threadIdx.x % kWarpSize;
  const int warps = gridDim.x * kLocalWarpsPerBlock;
  const int warp = blockIdx.x * kLocalWarpsPerBlock + threadIdx.x / kWarpSize;
  const int row_stride = buf.max_row_bytes / 16;
  const RecvInfo info{buf.world, 0};
  const uint4* y = static_cast<const uint4*>(a.y);
  uint4* staged = reinterpret_cast<uint4*>(buf.rows);

  const SlotOrder order(a.recv_info + info.slots_from(0), 1, buf.rank, buf.world, false);
  for (int i = warp; i < order.total(); i += warps) {
    int s, j;
    order.locate(i, s, j);
    const int64_t slot_index = (int64_t)s * buf.max_tokens + j;
    const SlotRows r = load_slot_rows(a.slot_rows, a.slot_w, slot_index, a.top_k, a.capacity, lane);
    uint4* dst = staged + slot_index * row_stride;
    for (int v = lane; v < a.row_vecs; v += kWarpSize) {
      float acc[Vec<T>::kElems] = {};
      add_slot<T>(acc, r, y, a.row_vecs, v);
      dst[v] = pack<T>(acc, 1.f);
    }
  }
}

void launch_reduce(const Buffers& buf, const ReduceArgs& args, bool bf16, cudaStream_t stream) {
  void* params[] = {const_cast<Buffers*>(&buf), const_cast<ReduceArgs*>(&args)};
  const void* fn = bf16 ? reinterpret_cast<const void*>(reduce_kernel<__nv_bfloat16>)
                        : reinterpret_cast<const void*>(reduce_kernel<float>);
  launch_local(fn, params, stream, "reduce");
}

}  // namespace moe_comm
