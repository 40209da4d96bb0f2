// Bodies of the FP8 experts' ops (torch.ops.moe_comm.fp8_*): argument checks, outputs, launch.
// They need no NVSHMEM state: the GEMMs between them are torch._scaled_grouped_mm.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>

#include "common/launch.h"
#include "experts/experts.h"

namespace moe_comm {
namespace {

void check_experts(bool ok, const std::string& what) { TORCH_CHECK(ok, "moe_comm fp8 experts: ", what); }

int sm_count(const at::Tensor& t) {
  int count = 0;
  MOE_COMM_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, t.get_device()));
  return count;
}

void check_rows(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t max_channels) {
  check_experts(t.is_cuda() && t.dim() == 2 && t.is_contiguous() && t.scalar_type() == dtype,
        std::string(name) + " must be a contiguous CUDA " + c10::toString(dtype) + " [rows, channels]");
  check_experts(t.size(1) % 16 == 0 && t.size(1) <= max_channels,
        std::string(name) + " has " + std::to_string(t.size(1)) + " channels: a multiple of 16, at most " +
            std::to_string(max_channels));
}

// offsets: the grouped GEMM's `offs` (int32 cumulative segment ends), on the rows' device.
int check_offsets(const at::Tensor& offsets, const at::Tensor& rows) {
  check_experts(offsets.is_cuda() && offsets.dim() == 1 && offsets.numel() >= 1 && offsets.is_contiguous() &&
            offsets.scalar_type() == at::kInt && offsets.get_device() == rows.get_device(),
        "offsets must be a non-empty contiguous int32 CUDA vector on the rows' device");
  return (int)offsets.numel();
}

at::TensorOptions e4m3(const at::Tensor& like) { return like.options().dtype(at::kFloat8_e4m3fn); }
at::TensorOptions f32(const at::Tensor& like) { return like.options().dtype(at::kFloat); }

// channel_scale: null, or contiguous float32 [groups, channels] on the rows' device (float4 loads).
const float* check_channel_scale(const std::optional<at::Tensor>& channel_scale, const at::Tensor& rows, int groups,
                                 int64_t channels) {
  if (!channel_scale.has_value()) return nullptr;
  const at::Tensor& s = *channel_scale;
  check_experts(s.is_cuda() && s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 &&
            s.size(0) == groups && s.size(1) == channels && s.get_device() == rows.get_device() &&
            reinterpret_cast<uintptr_t>(s.data_ptr()) % 16 == 0,
        "channel_scale must be a contiguous, 16-byte aligned float32 CUDA [" + std::to_string(groups) + ", " +
            std::to_string(channels) + "] (the weights' row scales, one row per expert)");
  return s.data_ptr<float>();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantise_rows_op(const at::Tensor& x, const at::Tensor& offsets,
                                                                const std::optional<at::Tensor>& channel_scale) {
  const c10::cuda::CUDAGuard guard(x.device());
  check_rows(x, "x", at::kBFloat16, kMaxRowChannels);
  const int groups = check_offsets(offsets, x);
  const float* cs = check_channel_scale(channel_scale, x, groups, x.size(1));
  at::Tensor q = at::empty(x.sizes(), e4m3(x)), scale = at::empty({x.size(0)}, f32(x));
  at::Tensor col_amax = at::zeros({groups, x.size(1)}, f32(x));
  QuantiseRowsArgs a{x.data_ptr(), offsets.data_ptr<int32_t>(), cs, groups, (int)x.size(1),
                     static_cast<uint8_t*>(q.data_ptr()), scale.data_ptr<float>(), col_amax.data_ptr<float>()};
  launch_quantise_rows(a, x.size(0), sm_count(x), c10::cuda::getCurrentCUDAStream());
  return {q, scale, col_amax};
}

std::tuple<at::Tensor, at::Tensor> gate_op(const at::Tensor& h13, const at::Tensor& offsets) {
  const c10::cuda::CUDAGuard guard(h13.device());
  check_rows(h13, "h13", at::kBFloat16, 2 * kMaxRowChannels);
  check_experts(h13.size(1) % 32 == 0, "h13 is [h1 | h3]: its two halves must be multiples of 16 channels");
  const int groups = check_offsets(offsets, h13);
  const int64_t inter = h13.size(1) / 2;
  at::Tensor q = at::empty({h13.size(0), inter}, e4m3(h13)), scale = at::empty({h13.size(0)}, f32(h13));
  GateArgs a{h13.data_ptr(), offsets.data_ptr<int32_t>(), groups, (int)inter, static_cast<uint8_t*>(q.data_ptr()),
             scale.data_ptr<float>()};
  launch_gate(a, h13.size(0), sm_count(h13), c10::cuda::getCurrentCUDAStream());
  return {q, scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gate_backward_op(
    const at::Tensor& h13, const at::Tensor& grad_h, const at::Tensor& offsets,
    const std::optional<at::Tensor>& channel_scale, const std::optional<at::Tensor>& row_scale) {
  const c10::cuda::CUDAGuard guard(h13.device());
  check_rows(h13, "h13", at::kBFloat16, 2 * kMaxRowChannels);
  check_rows(grad_h, "grad_h", at::kBFloat16, kMaxRowChannels);
  check_experts(grad_h.size(0) == h13.size(0) && 2 * grad_h.size(1) == h13.size(1), "grad_h must be [rows, inter] for h13 [rows, 2 inter]");
  const int groups = check_offsets(offsets, h13);
  const int64_t rows = h13.size(0), inter = grad_h.size(1);
  const float* cs = check_channel_scale(channel_scale, h13, groups, h13.size(1));
  if (row_scale.has_value()) {
    check_experts(row_scale->is_cuda() && row_scale->scalar_type() == at::kFloat && row_scale->is_contiguous() &&
              row_scale->dim() == 1 && row_scale->size(0) == rows && row_scale->get_device() == h13.get_device(),
          "row_scale must be the float32 [rows] scales of the experts' e4m3 input rows");
  }
  at::Tensor q = at::empty(h13.sizes(), e4m3(h13)), scale = at::empty({rows}, f32(h13));
  at::Tensor grad_h13 = at::empty_like(h13), h = at::empty_like(grad_h);
  at::Tensor col_amax = at::zeros({groups, 3 * inter}, f32(h13));
  GateBackwardArgs a{h13.data_ptr(), grad_h.data_ptr(), offsets.data_ptr<int32_t>(), cs,
                     row_scale ? row_scale->data_ptr<float>() : nullptr, groups, (int)inter,
                     static_cast<uint8_t*>(q.data_ptr()), scale.data_ptr<float>(), grad_h13.data_ptr(), h.data_ptr(),
                     col_amax.data_ptr<float>()};
  launch_gate_backward(a, rows, sm_count(h13), c10::cuda::getCurrentCUDAStream());
  return {q, scale, grad_h13, h, col_amax};
}

// a [experts, rows_a, cols] and optional b [experts, rows_b, cols], same dtype (fp32 or bf16).
void check_weights(const at::Tensor& a, const std::optional<at::Tensor>& b) {
  check_experts(a.is_cuda() && a.dim() == 3 && a.is_contiguous() &&
            (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
        "weights must be contiguous CUDA float32 or bfloat16 [experts, rows, cols]");
  check_experts(a.size(1) % 16 == 0 && a.size(2) % 16 == 0 && a.size(2) <= kMaxRowChannels,
        "weights need rows and cols in multiples of 16, cols at most " + std::to_string(kMaxRowChannels));
  if (b.has_value()) {
    check_experts(b->is_cuda() && b->dim() == 3 && b->is_contiguous() && b->scalar_type() == a.scalar_type() &&
              b->size(0) == a.size(0) && b->size(2) == a.size(2) && b->size(1) % 16 == 0 &&
              b->get_device() == a.get_device(),
          "the second weights must match the first in dtype, experts and cols");
  }
}

std::tuple<at::Tensor, at::Tensor> weights_op(const at::Tensor& a, const std::optional<at::Tensor>& b) {
  const c10::cuda::CUDAGuard guard(a.device());
  check_weights(a, b);
  const int64_t experts = a.size(0), rows = a.size(1) + (b ? b->size(1) : 0), cols = a.size(2);
  at::Tensor q = at::empty({experts, rows, cols}, e4m3(a)), scale = at::empty({experts, rows}, f32(a));
  WeightsArgs w{a.data_ptr(), b ? b->data_ptr() : nullptr, (int)experts, (int)a.size(1), b ? (int)b->size(1) : 0,
                (int)cols, a.scalar_type() == at::kFloat, static_cast<uint8_t*>(q.data_ptr()), scale.data_ptr<float>()};
  launch_weights(w, sm_count(a), c10::cuda::getCurrentCUDAStream());
  return {q, scale};
}

// q: the e4m3 [experts, rows, cols] fp8_weights made.
at::Tensor weights_transposed_op(const at::Tensor& q) {
  const c10::cuda::CUDAGuard guard(q.device());
  check_experts(q.is_cuda() && q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kFloat8_e4m3fn &&
            q.size(1) % 16 == 0 && q.size(2) % 16 == 0,
        "q must be the contiguous e4m3 [experts, rows, cols] fp8_weights returned (rows and cols multiples of 16)");
  const int64_t experts = q.size(0), rows = q.size(1), cols = q.size(2);
  at::Tensor out = at::empty({experts, cols, rows}, e4m3(q));
  check_experts(experts * rows <= INT32_MAX, "q must have at most 2^31 - 1 rows of weights in all");
  GroupColumnsArgs a{q.data_ptr(), true, nullptr, 0, nullptr, rows, (int)experts, (int)cols, 1, rows,
                     static_cast<uint8_t*>(out.data_ptr()), nullptr};
  launch_group_columns(a, c10::cuda::getCurrentCUDAStream());
  return out;
}

// The weight gradients' operands [channels, rows rounded up to 16] for the expert-major rows x.
at::Tensor group_columns_out(const at::Tensor& x) {
  return at::empty({x.size(1), (x.size(0) + 15) / 16 * 16}, e4m3(x));
}

// col_amax: [groups, channels] float32 whose rows may be further apart (a view of the [groups,
// 3 inter] fp8_gate_backward returns), channels contiguous.
std::tuple<at::Tensor, at::Tensor> group_columns_op(const at::Tensor& x, const at::Tensor& col_amax,
                                                    const at::Tensor& offsets, int64_t halves) {
  const c10::cuda::CUDAGuard guard(x.device());
  check_experts(halves == 1 || halves == 2, "halves must be 1 or 2");
  check_rows(x, "x", at::kBFloat16, INT32_MAX);
  check_experts(x.size(1) % (16 * halves) == 0, "each half of x's channels must be a multiple of 16");
  const int groups = check_offsets(offsets, x);
  check_experts(col_amax.is_cuda() && col_amax.scalar_type() == at::kFloat && col_amax.dim() == 2 &&
            col_amax.size(0) == groups && col_amax.size(1) == x.size(1) && col_amax.stride(1) == 1 &&
            col_amax.get_device() == x.get_device(),
        "col_amax must be float32 [experts, channels] (channels contiguous): the amax its producer took");
  const int64_t channels = x.size(1);
  at::Tensor q = group_columns_out(x);
  at::Tensor scale = at::empty({halves, groups * (channels / halves)}, f32(x));
  GroupColumnsArgs a{x.data_ptr(), false, col_amax.data_ptr<float>(), col_amax.stride(0), offsets.data_ptr<int32_t>(), 0,
                     groups, (int)channels, (int)halves, q.size(1), static_cast<uint8_t*>(q.data_ptr()),
                     scale.data_ptr<float>()};
  launch_group_columns(a, c10::cuda::getCurrentCUDAStream());
  return {q, scale};
}

at::Tensor transpose_rows_op(const at::Tensor& x, const at::Tensor& offsets) {
  const c10::cuda::CUDAGuard guard(x.device());
  check_rows(x, "x", at::kFloat8_e4m3fn, INT32_MAX);
  const int groups = check_offsets(offsets, x);
  at::Tensor q = group_columns_out(x);
  GroupColumnsArgs a{x.data_ptr(), true, nullptr, 0, offsets.data_ptr<int32_t>(), 0, groups, (int)x.size(1), 1,
                     q.size(1), static_cast<uint8_t*>(q.data_ptr()), nullptr};
  launch_group_columns(a, c10::cuda::getCurrentCUDAStream());
  return q;
}

// x: a contiguous bf16 weight gradient -> the same values in out (float32, as many values). The
// caller allocates out: the experts' backward widens beside its next GEMM, on a stream of its own,
// into memory of the main stream's (moe_comm/fp8_experts.py).
void widen_op(const at::Tensor& x, const at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(x.device());
  check_experts(x.is_cuda() && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.numel() % 8 == 0 &&
            reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
        "x must be a contiguous, 16-byte aligned CUDA bfloat16 tensor of a multiple of 8 values");
  check_experts(out.device() == x.device() && out.is_contiguous() && out.scalar_type() == at::kFloat &&
            out.numel() == x.numel() && reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
        "out must be a contiguous, 16-byte aligned float32 tensor on x's device with x's number of values");
  WidenArgs a{x.data_ptr(), out.data_ptr<float>(), x.numel()};
  launch_widen(a, c10::cuda::getCurrentCUDAStream());
}

}  // namespace

TORCH_LIBRARY_IMPL(moe_comm, CUDA, m) {
  m.impl("fp8_quantise_rows", &quantise_rows_op);
  m.impl("fp8_gate", &gate_op);
  m.impl("fp8_gate_backward", &gate_backward_op);
  m.impl("fp8_weights", &weights_op);
  m.impl("fp8_weights_transposed", &weights_transposed_op);
  m.impl("fp8_group_columns", &group_columns_op);
  m.impl("fp8_transpose_rows", &transpose_rows_op);
  m.impl("fp8_widen", &widen_op);
}

}  // namespace moe_comm
