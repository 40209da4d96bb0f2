// torch.ops.moe_comm.*: every op's schema, in one place. The bodies live beside their transport
// (runtime/ops.cpp, comm/ops.cpp); autograd and the fake (meta) kernels on the Python side
// (moe_comm/kernels/ops.py).
//
// `shape` arguments carry [world, local_size, fwd_slots, net_slots] of the running buffers, so
// the fake kernels compute every output shape from their arguments alone.
#include <torch/library.h>

TORCH_LIBRARY(moe_comm, m) {
  m.def("runtime_unique_id() -> Tensor");
  m.def("runtime_symmetric_bytes(int[] shape, int tokens, int send_slots, int row_bytes) -> int");
  m.def("runtime_init(Tensor uid, int rank, int[] shape, int tokens, int send_slots, int row_bytes, "
        "float timeout_s) -> ()");
  m.def("runtime_errors(bool clear) -> int[]");
  m.def("runtime_finalize(bool together) -> ()");
  m.def("preflight(int bytes, int iters, bool send_probes) -> Tensor");
  m.def("emulated_link(int num_sms, int hold_ns) -> ()");
  m.def(
      "dispatch(Tensor x, Tensor topk_idx, Tensor topk_w, int num_experts, int capacity, int align, bool fp8, "
      "bool fp8_rows, int num_sms, int network_sms, int[] shape) -> (Tensor recv_x, Tensor tokens_per_expert, "
      "Tensor rank_pos, Tensor send_idx, Tensor rail_counts, Tensor net_route, Tensor recv_info, Tensor slot_rows, "
      "Tensor slot_w, Tensor slot_origin, Tensor recv_scale)");
  m.def(
      "combine(Tensor y, Tensor topk_w, Tensor rank_pos, Tensor send_idx, Tensor rail_counts, Tensor net_route, Tensor recv_info, "
      "Tensor slot_rows, Tensor slot_w, Tensor slot_origin, bool weighted, bool fp8_grad, int num_sms, "
      "int network_sms) -> Tensor");
  m.def(
      "combine_backward(Tensor grad_out, Tensor y, Tensor rank_pos, Tensor send_idx, Tensor rail_counts, "
      "Tensor net_route, Tensor recv_info, Tensor slot_rows, Tensor slot_w, Tensor slot_origin, bool fp8, "
      "int num_sms, int network_sms) -> (Tensor grad_y, Tensor grad_w)");
  // The FP8 experts' kernels (experts/ops.cpp). offsets: the grouped GEMM's int32 segment ends.
  m.def("fp8_quantise_rows(Tensor x, Tensor offsets, Tensor? channel_scale) -> "
        "(Tensor q, Tensor scale, Tensor col_amax)");
  m.def("fp8_gate(Tensor h13, Tensor offsets) -> (Tensor q, Tensor scale)");
  m.def("fp8_gate_backward(Tensor h13, Tensor grad_h, Tensor offsets, Tensor? channel_scale, Tensor? row_scale) -> "
        "(Tensor q, Tensor scale, Tensor grad_h13, Tensor h, Tensor col_amax)");
  m.def("fp8_weights(Tensor a, Tensor? b) -> (Tensor q, Tensor scale)");
  m.def("fp8_weights_transposed(Tensor q) -> Tensor");
  m.def("fp8_group_columns(Tensor x, Tensor col_amax, Tensor offsets, int halves) -> (Tensor q, Tensor scale)");
  m.def("fp8_transpose_rows(Tensor x, Tensor offsets) -> Tensor");
  m.def("fp8_widen(Tensor x, Tensor(a!) out) -> ()");
}
