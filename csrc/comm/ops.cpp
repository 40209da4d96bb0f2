// Bodies of dispatch, combine and combine_backward: argument checks, output allocation, and the
// chain of kernels each one is (local layout kernels around one communication kernel).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <sstream>
#include <string>

#include "comm/comm.h"
#include "common/vec.cuh"
#include "layout/layout.h"
#include "runtime/runtime.h"

namespace moe_comm {
namespace {

void check(bool ok, const std::string& what) { TORCH_CHECK(ok, "moe_comm: ", what); }

void check_rows(const at::Tensor& t, const char* name) {
  check(t.is_cuda() && t.dim() == 2 && t.is_contiguous(), std::string(name) + " must be a contiguous CUDA [rows, hidden]");
  check(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, std::string(name) + " must be bfloat16 or float32");
}

// 16-byte vectors of one row of t, checked against the buffers' row slots.
int row_vecs(const at::Tensor& t, const Buffers& b) {
  const int64_t bytes = t.size(1) * t.element_size();
  std::ostringstream msg;
  msg << "rows of " << bytes << " bytes do not fit the buffers' " << b.cap.row_bytes
      << "-byte slots (hidden x element size, set when the backend started) or are not a multiple of 16 bytes";
  check(bytes % 16 == 0 && bytes <= b.cap.row_bytes, msg.str());
  return (int)(bytes / 16);
}

// The budget split: num_sms blocks, network_sms of them for the network hop (several nodes).
void check_budget(int64_t num_sms, int64_t network_sms, const Buffers& b) {
  std::ostringstream msg;
  msg << "num_sms=" << num_sms << " must be in 1.." << b.sm_count << " (this GPU's SMs)";
  check(num_sms >= 1 && num_sms <= b.sm_count, msg.str());
  if (b.topo.nodes > 1) {
    check(network_sms >= 1 && network_sms < num_sms,
          "network_sms=" + std::to_string(network_sms) + " must leave at least one of num_sms=" +
              std::to_string(num_sms) + " SMs to the NVLink hop");
  }
}

void check_shape(c10::IntArrayRef shape, const Buffers& b) {
  check(shape.size() == 4 && shape[0] == b.topo.world && shape[1] == b.topo.local_size &&
            shape[2] == b.cap.fwd_slots && shape[3] == b.cap.net_slots,
        "the op's shape does not match the running buffers (a stale handle or a second runtime)");
}

at::Tensor i32(c10::IntArrayRef size, const at::Tensor& like) { return at::empty(size, like.options().dtype(at::kInt)); }

// The handle's pieces, by name.
struct Handle {
  at::Tensor rank_pos, send_idx, rail_counts, net_route, recv_info, slot_rows, slot_w, slot_origin;
};

void check_handle(const Handle& h, const Buffers& b) {
  const Topology& t = b.topo;
  check(h.rank_pos.dim() == 2 && h.rank_pos.size(1) == t.local_size && h.send_idx.size(1) == t.nodes &&
            h.rail_counts.numel() == t.nodes * (t.nodes + t.local_size) && h.net_route.size(0) == b.cap.net_slots &&
            h.recv_info.numel() > t.local_size && (h.recv_info.numel() - t.local_size - 1) % 2 == 0 &&
            h.slot_rows.size(0) == (int64_t)t.local_size * b.cap.fwd_slots,
        "the dispatch handle does not come from this group's dispatch");
}

// FP8 rows need bf16 model rows whose FP8 wire row fits a slot.
void check_fp8_rows(const at::Tensor& x, const Buffers& b, const char* what) {
  const int64_t hidden = x.size(1);
  check(x.scalar_type() == at::kBFloat16 && hidden % kFp8GroupChannels == 0 &&
            fp8_row_bytes((int)hidden) <= b.cap.row_bytes,
        std::string(what) + " needs bfloat16 rows with hidden divisible by 128");
}

// fp8: the wire carries e4m3 rows (sender-quantised). fp8_rows: the experts take e4m3 rows
// with one fp32 scale per row (recv_scale), quantised once: with one scale for the whole row
// by the sender on an FP8 wire, by expand on a bf16 one.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor, at::Tensor>
dispatch_op(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_w, int64_t num_experts,
            int64_t capacity, int64_t align, bool fp8, bool fp8_rows, int64_t num_sms, int64_t network_sms,
            c10::IntArrayRef shape) {
  const Buffers& b = buffers();
  const Topology& t = b.topo;
  const c10::cuda::CUDAGuard guard(x.device());
  check_rows(x, "x");
  check_shape(shape, b);
  const int64_t T = x.size(0), K = topk_idx.size(1), hidden = x.size(1);
  check(topk_idx.scalar_type() == at::kLong && topk_idx.is_cuda() && topk_idx.is_contiguous() && topk_idx.dim() == 2 &&
            topk_idx.size(0) == T,
        "topk_idx must be a contiguous int64 CUDA tensor [num_tokens, top_k]");
  check(topk_w.scalar_type() == at::kFloat && topk_w.is_cuda() && topk_w.is_contiguous() && topk_w.sizes() == topk_idx.sizes(),
        "topk_w must be a contiguous float32 CUDA tensor shaped like topk_idx");
  check(K >= 1 && K <= kMaxTopK, "top_k must be in 1.." + std::to_string(kMaxTopK));
  check(T <= b.cap.tokens, "this call has " + std::to_string(T) + " tokens but the buffers hold " +
                               std::to_string(b.cap.tokens) + " per rank; raise [moe_comm] max_tokens_per_rank");
  check(num_experts % t.world == 0 && num_experts <= kMaxExperts,
        "num_experts must divide by the EP size and be at most " + std::to_string(kMaxExperts));
  check(align >= 1 && capacity >= 0, "align must be >= 1 and capacity >= 0");
  if (fp8) check_fp8_rows(x, b, "dispatch_dtype = \"fp8\"");
  check(!fp8_rows || (x.scalar_type() == at::kBFloat16 && hidden % 16 == 0),
        "expert_dtype = \"fp8\" needs bfloat16 rows with hidden divisible by 16");
  check_budget(num_sms, network_sms, b);
  const int vecs = row_vecs(x, b);
  const int G = t.local_size, N = t.nodes, L = (int)num_experts / t.world;
  const int64_t slots = (int64_t)G * b.cap.fwd_slots;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  // Plan.
  const int runs = (int)((T + kRunLength - 1) / kRunLength);
  at::Tensor plan_counts = i32({(t.world + N) * std::max(runs, 1)}, x);
  at::Tensor send_counts = i32({t.world + N}, x);
  at::Tensor pick_pos = i32({T, K}, x);
  Handle h;
  h.rank_pos = i32({T, G}, x);
  h.send_idx = i32({T, N}, x);
  PlanArgs p{topk_idx.data_ptr<int64_t>(), topk_w.data_ptr<float>(), (int)T, (int)K, (int)num_experts, runs, plan_counts.data_ptr<int32_t>(),
             send_counts.data_ptr<int32_t>(), pick_pos.data_ptr<int32_t>(), h.rank_pos.data_ptr<int32_t>(),
             h.send_idx.data_ptr<int32_t>()};
  launch_plan(b, p, stream);

  // Pack: send slots (several nodes) and the FP8 own rows.
  at::Tensor own_fp8;
  if (fp8) own_fp8 = at::empty({T, fp8_row_bytes((int)hidden)}, x.options().dtype(at::kByte));
  if (N > 1 || fp8) {
    PackArgs k{x.data_ptr(), topk_idx.data_ptr<int64_t>(), topk_w.data_ptr<float>(), pick_pos.data_ptr<int32_t>(),
               h.send_idx.data_ptr<int32_t>(), (int)T, (int)K, (int)num_experts, (int)hidden, vecs, true, fp8,
               fp8_rows, kFp8MinAmax, fp8 ? own_fp8.data_ptr<uint8_t>() : nullptr};
    launch_pack(b, k, stream);
  }

  // Communication.
  h.rail_counts = i32({N, N + G}, x);
  h.net_route = i32({b.cap.net_slots, G}, x);
  h.recv_info = i32({G + 2 * L + 1}, x);  // slots per forwarder, then expand's segment info
  DispatchArgs d{};
  d.backward = false;
  d.num_tokens = (int)T;
  d.top_k = (int)K;
  d.wire_vecs = fp8 ? fp8_row_bytes((int)hidden) / 16 : vecs;
  d.own_rows = fp8 ? own_fp8.data_ptr() : x.data_ptr();
  d.topk_idx = topk_idx.data_ptr<int64_t>();
  d.topk_w = topk_w.data_ptr<float>();
  d.rank_pos = h.rank_pos.data_ptr<int32_t>();
  d.send_counts = send_counts.data_ptr<int32_t>();
  d.rail_counts = h.rail_counts.data_ptr<int32_t>();
  d.net_route = h.net_route.data_ptr<int32_t>();
  d.recv_counts = h.recv_info.data_ptr<int32_t>();
  d.network_blocks = (int)network_sms;
  launch_dispatch(b, d, (int)num_sms, stream);

  // Expert-major layout.
  const int recv_runs = (int)((slots + kRunLength - 1) / kRunLength);
  at::Tensor layout_counts = i32({(int64_t)L * recv_runs}, x);
  at::Tensor expert_totals = i32({L}, x);
  at::Tensor slot_pos = i32({slots, K}, x), slot_expert = i32({slots, K}, x);
  h.slot_rows = i32({slots, K}, x);
  h.slot_w = at::empty({slots, K}, x.options().dtype(at::kFloat));
  h.slot_origin = i32({slots}, x);
  ReceiveArgs r{d.recv_counts, (int)K, L, recv_runs, layout_counts.data_ptr<int32_t>(), expert_totals.data_ptr<int32_t>(),
                slot_pos.data_ptr<int32_t>(), slot_expert.data_ptr<int32_t>(), h.slot_w.data_ptr<float>(),
                h.slot_origin.data_ptr<int32_t>()};
  launch_receive_layout(b, r, stream);

  at::Tensor recv_x = at::empty({capacity, hidden}, fp8_rows ? x.options().dtype(at::kFloat8_e4m3fn) : x.options());
  at::Tensor recv_scale = at::empty({fp8_rows ? capacity : 0}, x.options().dtype(at::kFloat));
  at::Tensor tokens_per_expert = i32({L}, x);
  ExpandArgs e{};
  e.recv_counts = d.recv_counts;
  e.run_counts = r.run_counts;
  e.column_totals = r.column_totals;
  e.top_k = (int)K;
  e.local_experts = L;
  e.runs = recv_runs;
  e.align = (int)align;
  e.capacity = (int)capacity;
  e.hidden = (int)hidden;
  e.fp8 = fp8;
  e.fp8_rows = fp8_rows;
  e.own_rows = d.own_rows;
  e.own_row_bytes = d.wire_vecs * 16;
  e.slot_pos = r.slot_pos;
  e.slot_expert = r.slot_expert;
  e.slot_rows = h.slot_rows.data_ptr<int32_t>();
  e.slot_w = r.slot_w;
  e.slot_origin = r.slot_origin;
  e.tokens_per_expert = tokens_per_expert.data_ptr<int32_t>();
  e.seg_info = d.recv_counts + G;
  e.out = recv_x.data_ptr();
  e.row_scale = fp8_rows ? recv_scale.data_ptr<float>() : nullptr;
  e.row_vecs = vecs;
  e.out_row_vecs = fp8_rows ? (int)(hidden / 16) : vecs;
  launch_expand(b, e, x.scalar_type() == at::kBFloat16, false, stream);
  return {recv_x, tokens_per_expert, h.rank_pos, h.send_idx, h.rail_counts, h.net_route, h.recv_info,
          h.slot_rows, h.slot_w, h.slot_origin, recv_scale};
}

at::Tensor combine_op(const at::Tensor& y, const at::Tensor& topk_w, const at::Tensor& rank_pos, const at::Tensor& send_idx,
                      const at::Tensor& rail_counts, const at::Tensor& net_route, const at::Tensor& recv_info,
                      const at::Tensor& slot_rows, const at::Tensor& slot_w, const at::Tensor& slot_origin,
                      bool weighted, bool fp8_grad, int64_t num_sms, int64_t network_sms) {
  (void)fp8_grad;  // how this op's backward sends the output gradient (moe_comm/kernels/ops.py)
  const Buffers& b = buffers();
  const c10::cuda::CUDAGuard guard(y.device());
  check_rows(y, "y");
  const Handle h{rank_pos, send_idx, rail_counts, net_route, recv_info, slot_rows, slot_w, slot_origin};
  check_handle(h, b);
  check_budget(num_sms, network_sms, b);
  const int vecs = row_vecs(y, b);
  const int64_t T = rank_pos.size(0), K = slot_rows.size(1);
  // topk_w only ties the router's weights to this op for autograd: the weights themselves
  // travelled with the rows (slot_w).
  check(topk_w.dim() == 2 && topk_w.size(0) == T && topk_w.size(1) == K, "topk_w and the dispatch handle disagree");
  const bool bf16 = y.scalar_type() == at::kBFloat16;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor out = at::empty({T, y.size(1)}, y.options());

  ReduceArgs r{y.data_ptr(), recv_info.data_ptr<int32_t>(), slot_rows.data_ptr<int32_t>(),
               weighted ? slot_w.data_ptr<float>() : nullptr, slot_origin.data_ptr<int32_t>(),
               rank_pos.data_ptr<int32_t>(), send_idx.data_ptr<int32_t>(), (int)K, (int)y.size(0), vecs,
               out.data_ptr()};
  launch_reduce(b, r, bf16, stream);
  CombineArgs c{rail_counts.data_ptr<int32_t>(), net_route.data_ptr<int32_t>(), recv_info.data_ptr<int32_t>(), vecs,
                (int)network_sms};
  launch_combine(b, c, bf16, (int)num_sms, stream);
  FinalizeArgs f{rank_pos.data_ptr<int32_t>(), send_idx.data_ptr<int32_t>(), (int)T, (int)K, vecs, out.data_ptr()};
  launch_finalize(b, f, bf16, stream);
  return out;
}

// fp8: the output gradient travels as e4m3 with one fp32 scale per 128 channels (quantised here,
// at world 1 too), dequantised by expand.
std::tuple<at::Tensor, at::Tensor> combine_backward_op(const at::Tensor& grad_out, const at::Tensor& y,
                                                       const at::Tensor& rank_pos, const at::Tensor& send_idx,
                                                       const at::Tensor& rail_counts, const at::Tensor& net_route,
                                                       const at::Tensor& recv_info, const at::Tensor& slot_rows,
                                                       const at::Tensor& slot_w, const at::Tensor& slot_origin,
                                                       bool fp8, int64_t num_sms, int64_t network_sms) {
  const Buffers& b = buffers();
  const Topology& t = b.topo;
  const c10::cuda::CUDAGuard guard(y.device());
  check_rows(y, "y");
  const at::Tensor g = grad_out.contiguous();
  check_rows(g, "grad_out");
  check(g.scalar_type() == y.scalar_type() && g.size(1) == y.size(1), "grad_out and y must share a dtype and hidden");
  const Handle h{rank_pos, send_idx, rail_counts, net_route, recv_info, slot_rows, slot_w, slot_origin};
  check_handle(h, b);
  check_budget(num_sms, network_sms, b);
  const int vecs = row_vecs(y, b);
  const int64_t T = rank_pos.size(0), K = slot_rows.size(1);
  check(g.size(0) == T, "grad_out has another token count than the forward");
  if (fp8) check_fp8_rows(g, b, "combine_grad_dtype = \"fp8\"");
  const bool bf16 = y.scalar_type() == at::kBFloat16;
  const int64_t hidden = g.size(1);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  at::Tensor own_fp8;
  if (fp8) own_fp8 = at::empty({T, fp8_row_bytes((int)hidden)}, g.options().dtype(at::kByte));
  if (t.nodes > 1 || fp8) {
    PackArgs k{g.data_ptr(), nullptr, nullptr, nullptr, send_idx.data_ptr<int32_t>(), (int)T, (int)K, 0,
               (int)hidden, vecs, false, fp8, false, kFp8MinAmaxSmall, fp8 ? own_fp8.data_ptr<uint8_t>() : nullptr};
    launch_pack(b, k, stream);
  }
  DispatchArgs d{};
  d.backward = true;
  d.num_tokens = (int)T;
  d.top_k = (int)K;
  d.wire_vecs = fp8 ? fp8_row_bytes((int)hidden) / 16 : vecs;
  d.own_rows = fp8 ? own_fp8.data_ptr() : g.data_ptr();
  d.rank_pos = rank_pos.data_ptr<int32_t>();
  d.rail_counts = const_cast<int32_t*>(rail_counts.data_ptr<int32_t>());
  d.net_route = const_cast<int32_t*>(net_route.data_ptr<int32_t>());
  d.network_blocks = (int)network_sms;
  launch_dispatch(b, d, (int)num_sms, stream);

  at::Tensor grad_y = at::empty_like(y);
  at::Tensor grad_w = at::empty({T, K}, y.options().dtype(at::kFloat));
  ExpandArgs e{};
  e.recv_counts = recv_info.data_ptr<int32_t>();
  e.seg_info = recv_info.data_ptr<int32_t>() + t.local_size;
  e.local_experts = (int)(recv_info.numel() - t.local_size - 1) / 2;
  e.top_k = (int)K;
  e.capacity = (int)y.size(0);
  e.hidden = (int)hidden;
  e.fp8 = fp8;
  e.own_rows = d.own_rows;
  e.own_row_bytes = d.wire_vecs * 16;
  e.y = y.data_ptr();
  e.slot_rows = const_cast<int32_t*>(slot_rows.data_ptr<int32_t>());
  e.slot_w = slot_w.data_ptr<float>();
  e.slot_origin = slot_origin.data_ptr<int32_t>();
  e.out = grad_y.data_ptr();
  e.row_vecs = vecs;
  e.out_row_vecs = vecs;
  launch_expand(b, e, bf16, true, stream);
  CollectArgs c{rail_counts.data_ptr<int32_t>(), net_route.data_ptr<int32_t>(), (int)K, (int)network_sms};
  launch_collect_grad_w(b, c, (int)num_sms, stream);
  FinalizeArgs f{rank_pos.data_ptr<int32_t>(), send_idx.data_ptr<int32_t>(), (int)T, (int)K, vecs, grad_w.data_ptr()};
  launch_gather_grad_w(b, f, stream);
  return {grad_y, grad_w};
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_comm, CUDA, m) {
  m.impl("dispatch", &dispatch_op);
  m.impl("combine", &combine_op);
  m.impl("combine_backward", &combine_backward_op);
}

}  // namespace moe_comm
