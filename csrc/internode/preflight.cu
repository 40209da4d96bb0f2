// Preflight: before a large job spends its queue time, every rank puts a probe to every other
// rank with NVSHMEM's put/signal API (the network hop's own calls) and times it. Step d pairs
// rank r with r + d (sending) and r - d (receiving), so all pairs are exercised in W - 1 steps
// with every rank busy in both directions; the receiver reports the step as the pair
// (r - d -> r). Waits are bounded like every other wait, each step with its own give-up word: a
// peer that never answers costs one timeout on each rank it should have reached, its pairs
// report no time, and every other pair is still measured.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <stdexcept>

#include "common/launch.h"
#include "common/wait.cuh"
#include "internode/preflight.h"

namespace moe_comm {

__global__ void preflight_kernel(const Buffers* __restrict__ buffers, const PreflightArgs a) {
  const Buffers& b = *buffers;
  const int W = b.topo.world, me = b.topo.rank;
  for (int d = 1; d < W; ++d) {
    const int to = (me + d) % W, from = (me - d + W) % W;
    WaitContext step = b.wait;
    step.abort = a.step_abort + d;
    const int64_t start = global_time_ns();
    bool answered = true;
    for (int it = 0; it < a.iters; ++it) {
      const uint32_t tag = a.base_tag + it + 1;
      // Every probe goes out even once `from` has failed this rank: `to` is owed all of them.
      if (a.send_probes) {
        nvshmemx_putmem_signal_nbi_warp(a.recv, a.send, a.bytes, a.sig + d, tag, NVSHMEM_SIGNAL_SET, to);
      }
      // `from` waits only on its own sender, so it may already have sent its next probe.
      if (answered) {
        answered = wait_at_least<uint64_t>(a.sig + d, tag, step, kKernelPreflight, kPhaseNetworkRows, from);
      }
    }
    __syncwarp();
    nvshmem_quiet();
    if (threadIdx.x == 0) a.received_ns[from] = answered ? global_time_ns() - start : -1;  // -1: no time to report
  }
}

void launch_preflight(const Buffers& b, const PreflightArgs& a, cudaStream_t stream) {
  preflight_kernel<<<1, 32, 0, stream>>>(b.on_device, a);
  MOE_COMM_CHECK_LAUNCH("preflight");
}

}  // namespace moe_comm
