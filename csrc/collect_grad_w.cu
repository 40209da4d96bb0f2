// Collect: the routing-weight gradients other ranks computed for this rank's tokens (expand.cu,
// backward mode, stores each slot's and raises a flag) land in grad_w.
//
// One thread per pick. A pick whose expert lives on another rank waits for that rank's flag for
// the token, then copies; picks on this rank were written by this rank's expand. Launched after
// expand on the same stream, so it only waits on other GPUs, which never wait on it.
#include "buffers.h"
#include "common.cuh"
#include "launch.h"

namespace moe_comm {

__global__ void __launch_bounds__(kLocalThreadsPerBlock)
    collect_grad_w_kernel(const Buffers buf, const CollectGradWArgs a) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (int64_t)a.num_tokens * a.top_k) return;
  const int t = (int)(i / a.top_k);
  const int64_t expert = a.topk_idx[i];
  if (expert < 0 || expert >= a.num_experts) {
    a.grad_w[i] = 0.f;  // the forward flagged this pick as an error; nothing was routed
    return;
  }
  const int d = (int)(expert / (a.num_experts / buf.world));
  if (d == buf.rank) return;
  // The tag of the combine_backward call that moved the rows (it bumped the counter).
  wait_flag(buf.grad_w_flag + (int64_t)d * buf.max_tokens + t, buf.calls[kDispatchLikeCalls]);
  a.grad_w[i] = buf.grad_w[(int64_t)t * kMaxTopK + i % a.top_k];
}

void launch_collect_grad_w(const Buffers& buf, const CollectGradWArgs& args, cudaStream_t stream) {
  const int64_t picks = (int64_t)args.num_tokens * args.top_k;
  if (picks == 0) return;
  const dim3 blocks((unsigned)((picks + kLocalThreadsPerBlock - 1) / kLocalThreadsPerBlock));
  void* params[] = {const_cast<Buffers*>(&buf), const_cast<CollectGradWArgs*>(&args)};
  MOE_COMM_CUDA_CHECK(cudaLaunchKernel(reinterpret_cast<const void*>(collect_grad_w_kernel), blocks,
                                       dim3(kLocalThreadsPerBlock), params, 0, stream));
}

}  // namespace moe_comm
