// The weight gradients' bf16 -> fp32 widening, where the parameters are fp32 (world 1: no FSDP
// mixed precision). torch._scaled_grouped_mm writes bf16 only, and autograd's own cast of a
// gradient to its parameter's dtype ran as a 2-byte-a-load copy kernel at about 1.9 TB/s: 1.48 ms
// for each of the three [32, 2048, 7168] gradients of a one-GPU recipe layer, 8.9 ms of its step
// (results/h200x1/README.md, run 41). Here each thread moves 8 values a load: 1.08 against 1.34 ms
// for torch's cast of the same gradient (run 42; four loads in flight a thread measured the same
// in runs 43-44, so the loop stays this simple).
#include <cuda_bf16.h>

#include <algorithm>

#include "common/launch.h"
#include "experts/rows.cuh"

namespace moe_comm {

__global__ void __launch_bounds__(kWidenThreads) widen_kernel(const WidenArgs a) {
  const uint4* in = static_cast<const uint4*>(a.x);
  float4* out = reinterpret_cast<float4*>(a.out);
  const int64_t vecs = a.n / 8;
  for (int64_t v = (int64_t)blockIdx.x * kWidenThreads + threadIdx.x; v < vecs; v += (int64_t)gridDim.x * kWidenThreads) {
    float f[8];
    bf16x8_to_floats(in[v], f);
    out[2 * v] = make_float4(f[0], f[1], f[2], f[3]);
    out[2 * v + 1] = make_float4(f[4], f[5], f[6], f[7]);
  }
}

void launch_widen(const WidenArgs& a, int sm_count, cudaStream_t stream) {
  const int64_t vecs = a.n / 8;
  if (vecs == 0) return;
  const int64_t most = (int64_t)sm_count * (kThreadsPerSm / kWidenThreads);  // one wave, grid-stride
  const int blocks = (int)std::min<int64_t>(most, (vecs + kWidenThreads - 1) / kWidenThreads);
  widen_kernel<<<blocks, kWidenThreads, 0, stream>>>(a);
  MOE_COMM_CHECK_LAUNCH("fp8_widen");
}

}  // namespace moe_comm
