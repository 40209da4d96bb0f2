// torch.ops.moe_comm.*: argument checks, output allocation, and the kernel launches.
//
// Autograd, the fake (meta) kernels and buffer policy live on the Python side
// (moe_comm/kernels/ops.py); this file only turns tensors into kernel arguments.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <sstream>

#include "runtime.h"

namespace moe_comm {
namespace {

void check(bool ok, const std::string& what) { TORCH_CHECK(ok, "moe_comm: ", what); }

void check_rows(const at::Tensor& t, const char* name, int64_t hidden) {
  check(t.is_cuda(), std::string(name) + " must be a CUDA tensor");
  check(t.dim() == 2 && t.size(1) == hidden, std::string(name) + " must be [rows, hidden]");
  check(t.is_contiguous(), std::string(name) + " must be contiguous");
  check(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat,
        std::string(name) + " must be bfloat16 or float32");
}

int row_vecs(const at::Tensor& t, const Buffers& b) {
  const int64_t row_bytes = t.size(1) * t.element_size();
  std::ostringstream msg;
  msg << "rows of " << row_bytes << " bytes do not fit the buffers' " << b.max_row_bytes
      << " bytes (hidden * element size, set when the backend started) or are not a multiple of 16 bytes";
  check(row_bytes % 16 == 0 && row_bytes <= b.max_row_bytes, msg.str());
  return (int)(row_bytes / 16);
}

void check_blocks(int64_t num_sms, const Buffers& b) {
  std::ostringstream msg;
  msg << "num_sms=" << num_sms << " is outside 1.." << b.max_blocks << " (the SM budget the buffers were sized for)";
  check(num_sms >= 1 && num_sms <= b.max_blocks, msg.str());
}

at::Tensor unique_id_op() {
  const std::vector<uint8_t> id = unique_id();
  at::Tensor out = at::empty({(int64_t)id.size()}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(out.data_ptr(), id.data(), id.size());
  return out;
}

int64_t symmetric_bytes_op(int64_t world, int64_t max_tokens, int64_t max_row_bytes) {
  return (int64_t)symmetric_bytes((int)world, (int)max_tokens, (int)max_row_bytes);
}

void init_op(const at::Tensor& uid, int64_t rank, int64_t world, int64_t max_tokens, int64_t max_row_bytes,
             int64_t max_blocks) {
  const at::Tensor cpu = uid.to(at::kCPU).contiguous();
  const uint8_t* p = cpu.data_ptr<uint8_t>();
  init(std::vector<uint8_t>(p, p + cpu.numel()), (int)rank, (int)world, (int)max_tokens, (int)max_row_bytes,
       (int)max_blocks);
}

std::vector<int64_t> errors_op(bool clear) {
  const std::vector<int32_t> e = read_errors(clear);
  return std::vector<int64_t>(e.begin(), e.end());
}

void barrier_op() { barrier(c10::cuda::getCurrentCUDAStream()); }

void finalize_op() { finalize(); }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> dispatch_op(
    const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_w, int64_t num_experts, int64_t capacity,
    int64_t align, int64_t num_sms, int64_t sender_warps) {
  const Buffers& b = buffers();
  const c10::cuda::CUDAGuard guard(x.device());
  check_rows(x, "x", x.size(1));
  const int64_t T = x.size(0), K = topk_idx.size(1);
  check(topk_idx.scalar_type() == at::kLong && topk_idx.is_cuda() && topk_idx.is_contiguous() &&
            topk_idx.dim() == 2 && topk_idx.size(0) == T,
        "topk_idx must be a contiguous int64 CUDA tensor [num_tokens, top_k]");
  check(topk_w.scalar_type() == at::kFloat && topk_w.is_cuda() && topk_w.is_contiguous() &&
            topk_w.sizes() == topk_idx.sizes(),
        "topk_w must be a contiguous float32 CUDA tensor shaped like topk_idx");
  check(K >= 1 && K <= kMaxTopK, "top_k must be in 1.." + std::to_string(kMaxTopK));
  check(T <= b.max_tokens, "this call has " + std::to_string(T) + " tokens but the buffers hold " +
                               std::to_string(b.max_tokens) + " per rank; raise [moe_comm] max_tokens_per_rank");
  check(num_experts % b.world == 0 && num_experts <= kMaxExperts,
        "num_experts must divide by the EP size and be at most " + std::to_string(kMaxExperts));
  check(align >= 1 && capacity >= 0, "align must be >= 1 and capacity >= 0");
  check(sender_warps >= 1 && sender_warps < kWarpsPerBlock, "sender_warps must be in 1..31");
  check_blocks(num_sms, b);
  const int L = (int)num_experts / b.world;
  const auto i32 = x.options().dtype(at::kInt);
  at::Tensor recv_x = at::empty({capacity, x.size(1)}, x.options());
  at::Tensor tokens_per_expert = at::empty({L}, i32);
  at::Tensor token_slot = at::empty({T, b.world}, i32);
  at::Tensor slot_rows = at::empty({b.world, b.max_tokens, K}, i32);
  at::Tensor slot_w = at::empty({b.world, b.max_tokens, K}, x.options().dtype(at::kFloat));
  at::Tensor slot_token = at::empty({b.world, b.max_tokens}, i32);
  at::Tensor recv_info = at::empty({RecvInfo{b.world, L}.size()}, i32);

  DispatchArgs a;
  a.x = x.data_ptr();
  a.topk_idx = topk_idx.data_ptr<int64_t>();
  a.topk_w = topk_w.data_ptr<float>();
  a.num_tokens = (int)T;
  a.top_k = (int)K;
  a.num_experts = (int)num_experts;
  a.align = (int)align;
  a.capacity = (int)capacity;
  a.row_vecs = row_vecs(x, b);
  a.sender_warps = (int)sender_warps;
  a.tokens_per_expert = tokens_per_expert.data_ptr<int32_t>();
  a.token_slot = token_slot.data_ptr<int32_t>();
  a.slot_rows = slot_rows.data_ptr<int32_t>();
  a.slot_w = slot_w.data_ptr<float>();
  a.slot_token = slot_token.data_ptr<int32_t>();
  a.recv_info = recv_info.data_ptr<int32_t>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  before_call(kDispatchLikeCalls, stream);
  launch_dispatch(b, a, (int)num_sms, stream);

  ExpandArgs e{};
  e.own_rows = x.data_ptr();
  e.top_k = (int)K;
  e.local_experts = L;
  e.align = (int)align;
  e.capacity = (int)capacity;
  e.row_vecs = a.row_vecs;
  e.slot_rows = a.slot_rows;
  e.slot_w = a.slot_w;
  e.slot_token = a.slot_token;
  e.recv_info = a.recv_info;
  e.out = recv_x.data_ptr();
  launch_expand(b, e, x.scalar_type() == at::kBFloat16, false, stream);
  return {recv_x, tokens_per_expert, token_slot, slot_rows, slot_w, slot_token, recv_info};
}

at::Tensor combine_op(const at::Tensor& y, const at::Tensor& topk_idx, const at::Tensor& topk_w,
                      const at::Tensor& token_slot, const at::Tensor& slot_rows, const at::Tensor& slot_w,
                      const at::Tensor& slot_token, const at::Tensor& recv_info, int64_t num_experts, int64_t align,
                      bool weighted, int64_t num_sms, int64_t pusher_warps) {
  const Buffers& b = buffers();
  const c10::cuda::CUDAGuard guard(y.device());
  check_rows(y, "y", y.size(1));
  check(token_slot.dim() == 2 && token_slot.size(1) == b.world, "token_slot does not come from this group's dispatch");
  check(slot_rows.dim() == 3 && slot_rows.size(0) == b.world && slot_rows.size(1) == b.max_tokens,
        "slot_rows does not come from this group's dispatch");
  check(pusher_warps >= 1 && pusher_warps < kWarpsPerBlock, "pusher_warps must be in 1..31");
  check_blocks(num_sms, b);
  const int64_t T = token_slot.size(0);
  check(topk_w.size(0) == T && topk_idx.size(0) == T, "topk_idx/topk_w and the dispatch handle disagree on tokens");
  (void)num_experts;
  (void)align;
  at::Tensor out = at::empty({T, y.size(1)}, y.options());

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool bf16 = y.scalar_type() == at::kBFloat16;
  before_call(kCombineLikeCalls, stream);
  ReduceArgs r{};
  r.y = y.data_ptr();
  r.top_k = (int)slot_rows.size(2);
  r.capacity = (int)y.size(0);
  r.row_vecs = row_vecs(y, b);
  r.slot_rows = slot_rows.data_ptr<int32_t>();
  r.slot_w = weighted ? slot_w.data_ptr<float>() : nullptr;
  r.recv_info = recv_info.data_ptr<int32_t>();
  launch_reduce(b, r, bf16, stream);

  CombineArgs a{};
  a.num_tokens = (int)T;
  a.row_vecs = r.row_vecs;
  a.pusher_warps = (int)pusher_warps;
  a.token_slot = token_slot.data_ptr<int32_t>();
  a.slot_token = slot_token.data_ptr<int32_t>();
  a.recv_info = r.recv_info;
  a.out = out.data_ptr();
  launch_combine(b, a, bf16, (int)num_sms, stream);
  return out;
}

std::tuple<at::Tensor, at::Tensor> combine_backward_op(
    const at::Tensor& grad_out, const at::Tensor& y, const at::Tensor& topk_idx, const at::Tensor& token_slot,
    const at::Tensor& slot_rows, const at::Tensor& slot_w, const at::Tensor& slot_token, const at::Tensor& recv_info,
    int64_t num_experts, int64_t align, int64_t num_sms, int64_t sender_warps) {
  const Buffers& b = buffers();
  const c10::cuda::CUDAGuard guard(y.device());
  check_rows(y, "y", y.size(1));
  const at::Tensor g = grad_out.contiguous();
  check_rows(g, "grad_out", y.size(1));
  check(g.scalar_type() == y.scalar_type(), "grad_out and y must share a dtype");
  check(sender_warps >= 1 && sender_warps < kWarpsPerBlock, "sender_warps must be in 1..31");
  check_blocks(num_sms, b);
  const int64_t T = token_slot.size(0), K = slot_rows.size(2);
  at::Tensor grad_y = at::empty_like(y);
  at::Tensor grad_w = at::empty({T, K}, y.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  CombineBackwardArgs a{};
  a.grad_out = g.data_ptr();
  a.num_tokens = (int)T;
  a.row_vecs = row_vecs(y, b);
  a.sender_warps = (int)sender_warps;
  a.token_slot = token_slot.data_ptr<int32_t>();
  a.recv_info = recv_info.data_ptr<int32_t>();
  before_call(kDispatchLikeCalls, stream);
  launch_combine_backward(b, a, (int)num_sms, stream);

  ExpandArgs e{};
  e.own_rows = g.data_ptr();
  e.y = y.data_ptr();
  e.top_k = (int)K;
  e.local_experts = (int)num_experts / b.world;
  e.align = (int)align;
  e.capacity = (int)y.size(0);
  e.row_vecs = a.row_vecs;
  e.slot_rows = slot_rows.data_ptr<int32_t>();
  e.slot_w = slot_w.data_ptr<float>();
  e.slot_token = slot_token.data_ptr<int32_t>();
  e.recv_info = a.recv_info;
  e.out = grad_y.data_ptr();
  e.grad_w = grad_w.data_ptr<float>();
  launch_expand(b, e, y.scalar_type() == at::kBFloat16, true, stream);

  CollectGradWArgs c{};
  c.topk_idx = topk_idx.data_ptr<int64_t>();
  c.num_tokens = (int)T;
  c.top_k = (int)K;
  c.num_experts = (int)num_experts;
  c.grad_w = e.grad_w;
  launch_collect_grad_w(b, c, stream);
  return {grad_y, grad_w};
}

}  // namespace

TORCH_LIBRARY(moe_comm, m) {
  m.def("nvshmem_unique_id() -> Tensor", &unique_id_op);
  m.def("nvshmem_symmetric_bytes(int world, int max_tokens, int max_row_bytes) -> int", &symmetric_bytes_op);
  m.def("nvshmem_init(Tensor uid, int rank, int world, int max_tokens, int max_row_bytes, int max_blocks) -> ()",
        &init_op);
  m.def("nvshmem_errors(bool clear) -> int[]", &errors_op);
  m.def("nvshmem_barrier() -> ()", &barrier_op);
  m.def("nvshmem_finalize() -> ()", &finalize_op);
  m.def(
      "dispatch(Tensor x, Tensor topk_idx, Tensor topk_w, int num_experts, int capacity, int align, int num_sms, "
      "int sender_warps) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "combine(Tensor y, Tensor topk_idx, Tensor topk_w, Tensor token_slot, Tensor slot_rows, Tensor slot_w, "
      "Tensor slot_token, Tensor recv_info, int num_experts, int align, bool weighted, int num_sms, "
      "int pusher_warps) -> Tensor");
  m.def(
      "combine_backward(Tensor grad_out, Tensor y, Tensor topk_idx, Tensor token_slot, Tensor slot_rows, "
      "Tensor slot_w, Tensor slot_token, Tensor recv_info, int num_experts, int align, int num_sms, "
      "int sender_warps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(moe_comm, CUDA, m) {
  m.impl("dispatch", &dispatch_op);
  m.impl("combine", &combine_op);
  m.impl("combine_backward", &combine_backward_op);
}

}  // namespace moe_comm
