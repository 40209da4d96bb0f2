// The weight gradients' bf16 -> fp32 widening, where the parameters are fp32 (world 1: no FSDP
// mixed precision). torch._scaled_grouped_mm writes bf16 only, and autograd's own cast of a
// gradient to its parameter's dtype ran as a 2-byte-a-load copy kernel at about 1.9 TB/s: 1.48 ms
// for each of the three [32, 2048, 7168] gradients of a one-GPU recipe layer, 8.9 ms of its step
// (results/h200x1/README.md, run 41).
//
// A bf16 value widens exactly by moving its 16 bits to the top of a float's. Each thread loads 4
// values (8 bytes) and stores their 16 bytes, so a warp's loads and its stores are each one
// contiguous span; kWidenLoads loads a thread are in flight before the first store. The previous
// loop (8 values a load, two 16-byte stores 32 bytes apart per thread, one wave of blocks
// striding over the tensor) ran at 2.6 TB/s (run 44).
#include "common/launch.h"
#include "experts/experts.h"

namespace moe_comm {

constexpr int kWidenLoads = 4;  // 8-byte loads a thread keeps in flight

__global__ void __launch_bounds__(kWidenThreads) widen_kernel(const WidenArgs a) {
  const uint2* in = static_cast<const uint2*>(a.x);
  uint4* out = reinterpret_cast<uint4*>(a.out);
  const int64_t quads = a.n / 4;
  const int64_t first = (int64_t)blockIdx.x * kWidenThreads * kWidenLoads + threadIdx.x;
  uint2 v[kWidenLoads];
#pragma unroll
  for (int i = 0; i < kWidenLoads; ++i) {
    const int64_t q = first + (int64_t)i * kWidenThreads;
    if (q < quads) v[i] = in[q];
  }
#pragma unroll
  for (int i = 0; i < kWidenLoads; ++i) {
    const int64_t q = first + (int64_t)i * kWidenThreads;
    if (q < quads) out[q] = make_uint4(v[i].x << 16, v[i].x & 0xffff0000u, v[i].y << 16, v[i].y & 0xffff0000u);
  }
}

void launch_widen(const WidenArgs& a, cudaStream_t stream) {
  const int64_t quads = a.n / 4;
  if (quads == 0) return;
  constexpr int64_t kPerBlock = (int64_t)kWidenThreads * kWidenLoads;
  widen_kernel<<<(unsigned)((quads + kPerBlock - 1) / kPerBlock), kWidenThreads, 0, stream>>>(a);
  MOE_COMM_CHECK_LAUNCH("fp8_widen");
}

}  // namespace moe_comm
