// Bodies of the runtime ops: start-up, the error words, teardown.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

#include "runtime/runtime.h"

namespace moe_comm {
namespace {

// [world, local_size, fwd_slots, net_slots] plus the per-rank sizes -> a RuntimeShape.
RuntimeShape make_shape(int64_t rank, c10::IntArrayRef shape, int64_t tokens, int64_t send_slots, int64_t row_bytes,
                        double timeout_s) {
  TORCH_CHECK(shape.size() == 4, "moe_comm: shape is [world, local_size, fwd_slots, net_slots]");
  RuntimeShape s;
  s.rank = (int)rank;
  s.world = (int)shape[0];
  s.local_size = (int)shape[1];
  s.timeout_s = timeout_s;
  Capacity& c = s.cap;
  c.tokens = (int)tokens;
  c.fwd_slots = (int)shape[2];
  c.net_slots = (int)shape[3];
  c.send_slots = (int)send_slots;
  c.row_bytes = (int)row_bytes;
  c.chunks = (c.tokens + kChunkSlots - 1) / kChunkSlots;
  c.fwd_chunks = (c.fwd_slots + kChunkSlots - 1) / kChunkSlots;
  return s;
}

at::Tensor unique_id_op() {
  const std::vector<uint8_t> id = unique_id();
  at::Tensor out = at::empty({(int64_t)id.size()}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(out.data_ptr(), id.data(), id.size());
  return out;
}

int64_t symmetric_bytes_op(c10::IntArrayRef shape, int64_t tokens, int64_t send_slots, int64_t row_bytes) {
  return (int64_t)symmetric_bytes(make_shape(0, shape, tokens, send_slots, row_bytes, 1.0));
}

void init_op(const at::Tensor& uid, int64_t rank, c10::IntArrayRef shape, int64_t tokens, int64_t send_slots,
             int64_t row_bytes, double timeout_s) {
  TORCH_CHECK(timeout_s > 0, "moe_comm: [moe_comm] wait_timeout_s must be > 0 (a wait without a bound is a hang)");
  const at::Tensor cpu = uid.to(at::kCPU).contiguous();
  const uint8_t* p = cpu.data_ptr<uint8_t>();
  init(std::vector<uint8_t>(p, p + cpu.numel()), make_shape(rank, shape, tokens, send_slots, row_bytes, timeout_s));
}

std::vector<int64_t> errors_op(bool clear) {
  const std::vector<int32_t> e = read_errors(clear);
  return std::vector<int64_t>(e.begin(), e.end());
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_comm, CompositeExplicitAutograd, m) {
  m.impl("runtime_unique_id", &unique_id_op);
  m.impl("runtime_symmetric_bytes", &symmetric_bytes_op);
  m.impl("runtime_init", &init_op);
  m.impl("runtime_errors", &errors_op);
  m.impl("runtime_finalize", &finalize);
}

}  // namespace moe_comm
