// Preflight: before a large job spends its queue time, every rank puts a probe to every other
// rank with NVSHMEM's put/signal API (the network hop's own calls) and times it. One warp per
// pair: warp d of rank r sends its probes to r + d, quiets, then waits for the probes of
// r - d, all pairs at once (the all-to-all's own pattern), and reports the time until they
// arrived as the pair (r - d -> r).
//
// Pairs are independent on purpose. An earlier ring (step d waiting on r - d before step d + 1
// sent) let one silent rank hold back the probes its waiting peers owed their own receivers,
// which then blamed healthy ranks (measured on one H200 under MPS). Now every probe is sent
// before any wait, each pair's wait has its own give-up word and ends one wait_timeout_s after
// the kernel's start: a peer that never answers costs each rank one timeout, and only its own
// pairs fail. A signal counts probes (NVSHMEM_SIGNAL_ADD), since two puts' signals may land in
// either order.
#include <nvshmem.h>
#include <nvshmemx.h>

#include <stdexcept>

#include "common/launch.h"
#include "common/wait.cuh"
#include "internode/preflight.h"

namespace moe_comm {

constexpr int kPreflightWarpsPerBlock = 8;  // pairs one block probes

__global__ void preflight_kernel(const Buffers* __restrict__ buffers, const PreflightArgs a) {
  const int64_t start = global_time_ns();
  const Buffers& b = *buffers;
  const int W = b.topo.world, me = b.topo.rank;
  const int d = blockIdx.x * kPreflightWarpsPerBlock + threadIdx.x / 32 + 1;
  if (d >= W) return;
  const int to = (me + d) % W, from = (me - d + W) % W;
  if (a.send_probes) {  // every probe goes out before any wait: `to` is owed all of them
    for (int it = 0; it < a.iters; ++it) {
      nvshmemx_putmem_signal_nbi_warp(a.recv, a.send, a.bytes, a.sig + d, 1, NVSHMEM_SIGNAL_ADD, to);
    }
    __syncwarp();
    nvshmem_quiet();
  }
  WaitContext pair = b.wait;
  pair.abort = a.pair_abort + d;
  const int64_t left_ns = start + b.wait.timeout_ns - global_time_ns();
  pair.timeout_ns = left_ns > 0 ? left_ns : 0;  // past the bound: probes already here still count
  const uint64_t all_probes = (uint64_t)a.probes_before + (uint64_t)a.iters;
  const bool answered =
      wait_at_least<uint64_t>(a.sig + d, all_probes, pair, kKernelPreflight, kPhaseNetworkRows, from);
  if (threadIdx.x % 32 == 0) a.received_ns[from] = answered ? global_time_ns() - start : -1;  // -1: no time
}

void launch_preflight(const Buffers& b, const PreflightArgs& a, cudaStream_t stream) {
  const int pairs = b.topo.world - 1;
  if (pairs < 1) return;
  const int blocks = (pairs + kPreflightWarpsPerBlock - 1) / kPreflightWarpsPerBlock;
  preflight_kernel<<<blocks, kPreflightWarpsPerBlock * 32, 0, stream>>>(b.on_device, a);
  MOE_COMM_CHECK_LAUNCH("preflight");
}

}  // namespace moe_comm
