// Preflight of the network hop (internode/preflight.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "runtime/buffers.h"

namespace moe_comm {

struct PreflightArgs {
  void* send;             // symmetric, `bytes`
  void* recv;             // symmetric, `bytes` (written by every sender; not read)
  uint64_t* sig;          // symmetric, [world]: pair d's count of probes received
  size_t bytes;
  int iters;              // probes per pair
  uint32_t probes_before; // probes every pair received in this process's earlier preflights
  bool send_probes;       // false: this rank never answers (to see the report name a dead pair)
  int32_t* pair_abort;    // [world], zeroed: each pair's own give-up word, so one dead peer
                          // spoils only its own pairs
  int64_t* received_ns;   // [world]: time from the kernel's start until each peer's probes all
                          // arrived; -1 where they never came (0 for this rank)
};

void launch_preflight(const Buffers& b, const PreflightArgs& a, cudaStream_t stream);

}  // namespace moe_comm
