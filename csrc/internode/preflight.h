// Preflight of the network hop (internode/preflight.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "runtime/buffers.h"

namespace moe_comm {

struct PreflightArgs {
  void* send;            // symmetric, `bytes`
  void* recv;            // symmetric, `bytes` (written by every sender in turn; not read)
  uint64_t* sig;         // symmetric, [world]: step d's signal
  size_t bytes;
  int iters;
  uint32_t base_tag;     // signals of this preflight are base_tag + 1 ...
  bool send_probes;      // false: this rank never answers (to see the report name a dead pair)
  int32_t* step_abort;   // [world], zeroed: each step's own give-up word, so one dead peer
                         // spoils only its own pair, never the steps after it
  int64_t* received_ns;  // [world]: time of the step that received from each peer; -1 where
                         // that peer's probe never came (0 for this rank)
};

void launch_preflight(const Buffers& b, const PreflightArgs& a, cudaStream_t stream);

}  // namespace moe_comm
