// Body of the emulated_link op (internode/emulated_link.cu): the current stream, argument checks.
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>

#include "common/limits.h"
#include "internode/emulated_link.h"

namespace moe_comm {
namespace {

void emulated_link_op(int64_t num_sms, int64_t hold_ns) {
  TORCH_CHECK(num_sms >= 1, "moe_comm: the emulated link needs num_sms >= 1, got ", num_sms);
  TORCH_CHECK(hold_ns >= 0 && hold_ns <= (int64_t)kMaxEmulatedHoldUs * 1000, "moe_comm: the emulated link holds 0..",
              kMaxEmulatedHoldUs, " us per call, asked for ", hold_ns, " ns");
  launch_emulated_link((int)num_sms, hold_ns, c10::cuda::getCurrentCUDAStream());
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_comm, CompositeExplicitAutograd, m) { m.impl("emulated_link", &emulated_link_op); }

}  // namespace moe_comm
