// An emulated network link for one GPU (internode/emulated_link.cu): what a benchmark sets with
// MOE_COMM_EMULATED_LINK (moe_comm/kernels/emulated_link.py), never a recipe.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe_comm {

// Holds `num_sms` SMs (one block each, resident together, as the communication kernels are) on
// `stream` for `hold_ns` nanoseconds: the time a transfer's bytes would take on the link.
void launch_emulated_link(int num_sms, int64_t hold_ns, cudaStream_t stream);

}  // namespace moe_comm
