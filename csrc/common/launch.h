// Error checking and the two launch shapes every kernel uses.
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace moe_comm {

#define MOE_COMM_CUDA_CHECK(expr)                                                                 \
  do {                                                                                            \
    const cudaError_t status_ = (expr);                                                           \
    if (status_ != cudaSuccess) {                                                                 \
      std::ostringstream msg_;                                                                    \
      msg_ << "moe_comm: " #expr " failed: " << cudaGetErrorString(status_) << " (" << __FILE__   \
           << ":" << __LINE__ << ")";                                                             \
      throw std::runtime_error(msg_.str());                                                       \
    }                                                                                             \
  } while (0)

// Communication kernels: one block of kCommThreads per SM of the recipe's budget.
constexpr int kCommThreads = 1024;
constexpr int kCommWarps = kCommThreads / 32;
// Local layout kernels: two blocks of kLocalThreads per SM keep 64 registers a thread.
constexpr int kLocalThreads = 512;
constexpr int kLocalBlocksPerSM = 2;
constexpr int kLocalWarps = kLocalThreads / 32;

// Cooperative launch: every block is resident at once, which the grid syncs and the
// cross-block waits rely on. num_blocks is the SM budget from the recipe. `sm_count` is the
// GPU's, read once at start-up.
inline void launch_cooperative(const void* fn, int num_blocks, int sm_count, size_t smem, void** params,
                               cudaStream_t stream, const char* name) {
  if (smem > 48 * 1024) {
    MOE_COMM_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  }
  int per_sm = 0;
  MOE_COMM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kCommThreads, smem));
  if (per_sm < 1 || num_blocks > sm_count * per_sm) {
    std::ostringstream msg;
    msg << "moe_comm: " << name << " cannot keep " << num_blocks << " blocks resident (" << sm_count << " SMs, "
        << per_sm << " blocks per SM with " << smem << " bytes of shared memory); lower [moe_comm] num_sms";
    throw std::runtime_error(msg.str());
  }
  MOE_COMM_CUDA_CHECK(cudaLaunchCooperativeKernel(fn, dim3(num_blocks), dim3(kCommThreads), params, smem, stream));
}

// After a <<<>>> launch of a local kernel (they never wait on another GPU).
#define MOE_COMM_CHECK_LAUNCH(name)                                                               \
  do {                                                                                            \
    const cudaError_t status_ = cudaGetLastError();                                               \
    if (status_ != cudaSuccess) {                                                                 \
      throw std::runtime_error(std::string("moe_comm: launching ") + (name) +                    \
                               " failed: " + cudaGetErrorString(status_));                       \
    }                                                                                             \
  } while (0)

// Blocks for a local kernel that gives one warp to each of `items`, at most the whole GPU.
inline int warp_blocks(long long items, int sm_count) {
  const long long blocks = (items + kLocalWarps - 1) / kLocalWarps;
  const long long whole_gpu = (long long)sm_count * kLocalBlocksPerSM;
  return (int)(blocks < whole_gpu ? blocks : whole_gpu);
}

}  // namespace moe_comm
