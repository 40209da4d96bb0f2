// The emulated network link: a call at EP 1 moves no byte over a network, so to measure how
// much of a network's time the overlap hides on one GPU, each dispatch and combine also runs
// this kernel for as long as its bytes would take on the link. It occupies the SMs the real
// communication kernels would: `num_sms` blocks of kCommThreads, launched cooperatively (all
// resident at once), each asking for all of an SM's shared memory so nothing else shares its SM,
// while thread 0 of each block watches %globaltimer. The wait is the hold itself, bounded by
// kMaxEmulatedHoldUs.
#include "common/launch.h"
#include "common/limits.h"
#include "common/wait.cuh"
#include "internode/emulated_link.h"

namespace moe_comm {

constexpr int64_t kMaxEmulatedHoldNs = (int64_t)kMaxEmulatedHoldUs * 1000;
constexpr unsigned kHoldPollNs = 500;  // between two reads of the timer

__global__ void __launch_bounds__(kCommThreads, 1) emulated_link_kernel(int64_t hold_ns) {
  extern __shared__ uint8_t held[];  // never touched: it keeps other blocks off this SM
  if (threadIdx.x == 0) {
    const int64_t start = global_time_ns();
    const int64_t until = start + (hold_ns < kMaxEmulatedHoldNs ? hold_ns : kMaxEmulatedHoldNs);
    while (global_time_ns() < until) __nanosleep(kHoldPollNs);
  }
  __syncthreads();
  (void)held;
}

void launch_emulated_link(int num_sms, int64_t hold_ns, cudaStream_t stream) {
  if (hold_ns <= 0) return;
  int device = 0, sm_count = 0, smem = 0;
  MOE_COMM_CUDA_CHECK(cudaGetDevice(&device));
  MOE_COMM_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  MOE_COMM_CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  void* params[] = {&hold_ns};
  launch_cooperative(reinterpret_cast<const void*>(emulated_link_kernel), num_sms, sm_count, (size_t)smem, params,
                     stream, "the emulated link");
}

}  // namespace moe_comm
