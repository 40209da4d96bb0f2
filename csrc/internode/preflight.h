// Preflight of the network hop (internode/preflight.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "runtime/buffers.h"

namespace moe_comm {

struct PreflightArgs {
  void* send;           // symmetric, `bytes`
  void* recv;           // symmetric, `bytes` (written by every sender in turn; not read)
  uint64_t* sig;        // symmetric, [world]: step d's signal
  size_t bytes;
  int iters;
  uint32_t base_tag;    // signals of this preflight are base_tag + 1 ...
  int64_t* elapsed_ns;  // [world]: time of the step that sent to each peer (0 for this rank)
};

void launch_preflight(const Buffers& b, const PreflightArgs& a, cudaStream_t stream);

}  // namespace moe_comm
