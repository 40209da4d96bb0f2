// Body of the preflight op: symmetric probe buffers for the call (nvshmem_malloc is
// collective: every rank of the group calls this op together), the kernel, the times.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <nvshmem.h>
#include <torch/library.h>

#include "internode/preflight.h"
#include "runtime/runtime.h"

namespace moe_comm {
namespace {

uint32_t g_preflight_calls = 0;

at::Tensor preflight_op(int64_t bytes, int64_t iters) {
  const Buffers& b = buffers();
  TORCH_CHECK(bytes >= 16 && bytes % 16 == 0 && iters >= 1, "moe_comm: preflight needs bytes >= 16, a multiple of 16, "
              "and iters >= 1");
  void* send = nvshmem_malloc(bytes);
  void* recv = nvshmem_malloc(bytes);
  auto* sig = static_cast<uint64_t*>(nvshmem_calloc(b.topo.world, sizeof(uint64_t)));
  TORCH_CHECK(send != nullptr && recv != nullptr && sig != nullptr,
              "moe_comm: nvshmem_malloc of the preflight probe failed (raise NVSHMEM_SYMMETRIC_SIZE)");
  at::Tensor elapsed = at::zeros({b.topo.world}, at::TensorOptions().dtype(at::kLong).device(at::kCUDA));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  PreflightArgs a{send, recv, sig, (size_t)bytes, (int)iters, g_preflight_calls * (uint32_t)iters,
                  elapsed.data_ptr<int64_t>()};
  ++g_preflight_calls;
  launch_preflight(b, a, stream);
  at::Tensor out = elapsed.cpu();  // synchronises
  nvshmem_barrier_all();
  nvshmem_free(sig);
  nvshmem_free(recv);
  nvshmem_free(send);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_comm, CompositeExplicitAutograd, m) { m.impl("preflight", &preflight_op); }

}  // namespace moe_comm
