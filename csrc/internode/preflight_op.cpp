// Body of the preflight op: symmetric probe buffers (nvshmem_malloc is collective: every rank of
// the group calls this op together), the kernel, the times. The buffers are kept for the life
// of the process and no NVSHMEM barrier follows the kernel: both nvshmem_free and the barrier
// wait without a bound for every peer, and the preflight exists to report the peer that never
// comes (NVSHMEM's teardown at exit frees them when every rank agrees it is safe).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <nvshmem.h>
#include <torch/library.h>

#include "internode/preflight.h"
#include "runtime/runtime.h"

namespace moe_comm {
namespace {

struct Probe {
  void* send = nullptr;
  void* recv = nullptr;
  uint64_t* sig = nullptr;
  size_t bytes = 0;
  uint32_t probes = 0;  // each pair's signal count after this process's earlier preflights
};
Probe g_probe;

at::Tensor preflight_op(int64_t bytes, int64_t iters, bool send_probes) {
  const Buffers& b = buffers();
  TORCH_CHECK(bytes >= 16 && bytes % 16 == 0 && iters >= 1, "moe_comm: preflight needs bytes >= 16, a multiple of 16, "
              "and iters >= 1");
  TORCH_CHECK(g_probe.send == nullptr || g_probe.bytes == (size_t)bytes,
              "moe_comm: every preflight of a process probes with the same bytes");
  if (g_probe.send == nullptr) {
    g_probe.send = nvshmem_malloc(bytes);
    g_probe.recv = nvshmem_malloc(bytes);
    g_probe.sig = static_cast<uint64_t*>(nvshmem_calloc(b.topo.world, sizeof(uint64_t)));
    TORCH_CHECK(g_probe.send != nullptr && g_probe.recv != nullptr && g_probe.sig != nullptr,
                "moe_comm: nvshmem_malloc of the preflight probe failed (raise NVSHMEM_SYMMETRIC_SIZE)");
    g_probe.bytes = (size_t)bytes;
  }
  const auto on_gpu = [](at::ScalarType t) { return at::TensorOptions().dtype(t).device(at::kCUDA); };
  at::Tensor received = at::zeros({b.topo.world}, on_gpu(at::kLong));
  at::Tensor pair_abort = at::zeros({b.topo.world}, on_gpu(at::kInt));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  PreflightArgs a{g_probe.send, g_probe.recv, g_probe.sig, g_probe.bytes, (int)iters,
                  g_probe.probes, send_probes, pair_abort.data_ptr<int32_t>(),
                  received.data_ptr<int64_t>()};
  g_probe.probes += (uint32_t)iters;
  launch_preflight(b, a, stream);
  return received.cpu();  // synchronises
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_comm, CompositeExplicitAutograd, m) { m.impl("preflight", &preflight_op); }

}  // namespace moe_comm
