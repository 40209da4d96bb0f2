// Error checking and the cooperative launch shared by the kernels' launch wrappers.
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <stdexcept>
#include <string>

#include "buffers.h"
#include "common.cuh"

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

// Cooperative launch: every block is resident at once, which the grid syncs and the
// cross-block flag waits rely on. num_blocks is the SM budget from the recipe.
inline void launch_cooperative(const void* fn, int num_blocks, size_t smem, void** params, cudaStream_t stream,
                               const char* name) {
  if (smem > 48 * 1024) {
    MOE_COMM_CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  }
  int device = 0, sms = 0, per_sm = 0;
  MOE_COMM_CUDA_CHECK(cudaGetDevice(&device));
  MOE_COMM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  MOE_COMM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kThreadsPerBlock, smem));
  if (per_sm < 1 || num_blocks > sms * per_sm) {
    std::ostringstream msg;
    msg << "moe_comm: " << name << " cannot keep " << num_blocks << " blocks resident (" << sms << " SMs, "
        << per_sm << " blocks per SM with " << smem << " bytes of shared memory); lower [moe_comm] num_sms";
    throw std::runtime_error(msg.str());
  }
  MOE_COMM_CUDA_CHECK(cudaLaunchCooperativeKernel(fn, dim3(num_blocks), dim3(kThreadsPerBlock), params, smem, stream));
  MOE_COMM_CUDA_CHECK(cudaGetLastError());
}

// Ordinary launch over the whole GPU for the local layout kernels (expand, reduce):
// memory-bound row shuffles that TorchTitan's own permute runs on every SM too. Communication
// stays in the cooperative kernels above, on the recipe's SM budget. (Grad-w collection sizes
// its own grid: one thread per pick.)
inline void launch_local(const void* fn, void** params, cudaStream_t stream, const char* name) {
  int device = 0, sms = 0;
  MOE_COMM_CUDA_CHECK(cudaGetDevice(&device));
  MOE_COMM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const cudaError_t status = cudaLaunchKernel(fn, dim3(sms * kLocalBlocksPerSM), dim3(kLocalThreadsPerBlock), params, 0,
                                              stream);
  if (status != cudaSuccess) {
    std::ostringstream msg;
    msg << "moe_comm: launching " << name << " failed: " << cudaGetErrorString(status);
    throw std::runtime_error(msg.str());
  }
}

// What each kernel reads and writes; pointers are device memory, filled in ops.cpp.
struct DispatchArgs {
  const void* x;            // [num_tokens, hidden]
  const int64_t* topk_idx;  // [num_tokens, top_k]
  const float* topk_w;      // [num_tokens, top_k]
  int num_tokens, top_k, num_experts, align, capacity, sender_warps;
  int row_vecs;                // 16-byte vectors per row
  int32_t* tokens_per_expert;  // [local_experts], padded to align
  int32_t* token_slot;         // [num_tokens, world]: slot of the token at each rank, or -1
  int32_t* slot_rows;          // [world, max_tokens, top_k]: row of each pick, or -1
  float* slot_w;               // [world, max_tokens, top_k]
  int32_t* slot_token;         // [world, max_tokens]
  int32_t* recv_info;          // RecvInfo
};

// Expert-major layout of the arrived rows (the forward's recv_x, or the backward's grad_y).
struct ExpandArgs {
  const void* own_rows;        // [num_tokens, hidden] rows of this rank's own tokens (x, or grad_out)
  const void* y;               // backward: [capacity, hidden] the forward's expert outputs
  int top_k, local_experts, align, capacity, row_vecs;
  const int32_t* slot_rows;    // [world, max_tokens, top_k]
  const float* slot_w;         // [world, max_tokens, top_k]
  const int32_t* slot_token;   // [world, max_tokens]
  const int32_t* recv_info;    // RecvInfo
  void* out;                   // [capacity, hidden] expert-major rows
  float* grad_w;               // backward: [num_tokens, top_k] this rank's own picks
};

// Per-slot weighted sums of expert outputs, staged token-major in the `rows` buffer.
struct ReduceArgs {
  const void* y;               // [capacity, hidden] expert-major rows
  int top_k, capacity, row_vecs;
  const int32_t* slot_rows;    // [world, max_tokens, top_k]
  const float* slot_w;         // [world, max_tokens, top_k], or nullptr for unweighted sums
  const int32_t* recv_info;    // RecvInfo
};

struct CombineArgs {
  int num_tokens, row_vecs, pusher_warps;
  const int32_t* token_slot;   // [num_tokens, world]
  const int32_t* slot_token;   // [world, max_tokens]
  const int32_t* recv_info;    // RecvInfo
  void* out;                   // [num_tokens, hidden]
};

struct CombineBackwardArgs {
  const void* grad_out;        // [num_tokens, hidden]
  int num_tokens, row_vecs, sender_warps;
  const int32_t* token_slot;   // [num_tokens, world]
  const int32_t* recv_info;    // RecvInfo
};

struct CollectGradWArgs {
  const int64_t* topk_idx;     // [num_tokens, top_k]
  int num_tokens, top_k, num_experts;
  float* grad_w;               // [num_tokens, top_k]
};

// Communication (cooperative, num_blocks = the recipe's SM budget).
void launch_dispatch(const Buffers& buf, const DispatchArgs& args, int num_blocks, cudaStream_t stream);
void launch_combine(const Buffers& buf, const CombineArgs& args, bool bf16, int num_blocks, cudaStream_t stream);
void launch_combine_backward(const Buffers& buf, const CombineBackwardArgs& args, int num_blocks, cudaStream_t stream);
size_t dispatch_smem_bytes(int num_experts, int world);
// Local (whole GPU).
void launch_expand(const Buffers& buf, const ExpandArgs& args, bool bf16, bool backward, cudaStream_t stream);
void launch_reduce(const Buffers& buf, const ReduceArgs& args, bool bf16, cudaStream_t stream);
void launch_collect_grad_w(const Buffers& buf, const CollectGradWArgs& args, cudaStream_t stream);

}  // namespace moe_comm
