// Expand: the arrived rows, laid out expert-major for TorchTitan's grouped GEMM.
//
// A local kernel over the whole GPU, launched once the dispatch-like communication kernel saw
// every row arrive. Each warp takes one recv slot (or a part of one, for small calls); its row
// is in fwd_rows (delivered by another forwarder of the node), in net_slots (arrived over the
// network, this rank its own forwarder) or in this rank's own rows.
//
// Forward (dispatch): a pick's row is its expert's segment start + its run's offset + its
// position in the run (receive_layout.cu); the warp copies the row there with streaming stores
// (or dequantises it from e4m3 when the wire was FP8), and every segment's alignment padding is
// zeroed. For the FP8 experts ([moe_comm] expert_dtype = "fp8") the rows stay e4m3 with one fp32
// scale per row: from an FP8 wire (the sender quantised the row with one scale) they are copied
// as they came, no dequantise-requantise; from a bf16 wire the warp quantises the row here, once,
// for every expert it goes to, exactly as the sender would have. Warp copies measured faster than bulk (TMA) copies through shared memory at both
// sizes, in one run: 165.7 against 212.0 us at the DeepSeek-V3 shape, 24.9 against 29.7 at 128
// tokens (results/h200x1, run 7). Rows past the capacity are not placed; the host raises, and
// the counts stay clamped so the grouped GEMM stays in bounds.
// Backward (of combine), for out[t] = sum_k w[t,k] * y[row(t,k)]:
//   grad_y[row(t,k)] = w[t,k] * grad_out[t], the segments' padding zero (grad_out dequantised
//                      from e4m3 when combine's backward travelled in FP8)
//   grad_w[t,k]      = <grad_out[t], y[row(t,k)]>, stored at the slot's forwarder (directly
//                      when that is this rank, through NVLink with a flag otherwise), from where
//                      comm/collect_grad_w.cu takes it home.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>

#include "common/copy.cuh"
#include "common/launch.h"
#include "common/wait.cuh"
#include "layout/layout.h"
#include "layout/slots.cuh"

namespace moe_comm {

constexpr int kSegmentsPerThread = (kMaxExperts + kLocalThreads - 1) / kLocalThreads;

// Where a slot's row is: another forwarder's delivery, a network arrival this rank forwarded
// to itself, or this rank's own token.
__device__ __forceinline__ const uint8_t* slot_source(const Buffers& b, int g, int64_t slot, int32_t origin,
                                                      const void* own_rows, int own_row_bytes) {
  if (g != b.topo.local) return b.peer[b.topo.local].fwd_rows + slot * b.cap.row_bytes;
  if (origin < 0) return b.net_slots + (int64_t)(-origin - 2) * b.cap.net_slot_bytes() + kNetMetaBytes;
  return static_cast<const uint8_t*>(own_rows) + (int64_t)origin * own_row_bytes;
}

// Segment starts (exclusive prefix of the padded per-expert totals, then their sum) into shared
// memory; block 0 also writes tokens_per_expert, the segment info for the backward and the
// capacity error.
__device__ __forceinline__ void segment_starts(const Buffers& b, const ExpandArgs& a, int* seg_start) {
  using BlockScan = cub::BlockScan<int, kLocalThreads>;
  __shared__ typename BlockScan::TempStorage temp;
  const int L = a.local_experts;
  int padded[kSegmentsPerThread], starts[kSegmentsPerThread];
#pragma unroll
  for (int j = 0; j < kSegmentsPerThread; ++j) {
    const int e = threadIdx.x * kSegmentsPerThread + j;
    padded[j] = e < L ? round_up(a.column_totals[e], a.align) : 0;
  }
  int total = 0;
  BlockScan(temp).ExclusiveSum(padded, starts, total);
#pragma unroll
  for (int j = 0; j < kSegmentsPerThread; ++j) {
    const int e = threadIdx.x * kSegmentsPerThread + j;
    if (e < L) {
      seg_start[e] = starts[j];
      if (blockIdx.x == 0) {
        a.tokens_per_expert[e] = min(padded[j], max(0, a.capacity - starts[j]));
        a.seg_info[e] = starts[j];
        a.seg_info[L + 1 + e] = a.column_totals[e];
      }
    }
  }
  if (threadIdx.x == 0) {
    seg_start[L] = total;
    if (blockIdx.x == 0) {
      a.seg_info[L] = total;
      if (total > a.capacity) b.wait.errors[kErrorRowsNeeded] = total;
    }
  }
  __syncthreads();
}

// Alignment padding feeds the grouped GEMM: zero it, one warp per expert (segment e is rows
// seg_start[e] .. seg_start[e + 1], its first counts[e] real). In recv_x the GEMM reads it; in
// grad_y its weight gradient X^T dY does, where 0 x NaN from a reused allocation would be NaN.
// e4m3 rows get scale 1 there (`row_scale`), for the same reason.
__device__ __forceinline__ void zero_padding(void* rows, float* row_scale, const int* seg_start, const int* counts,
                                             int local_experts, int capacity, int row_vecs, int warp, int warps,
                                             int lane) {
  uint4* out = static_cast<uint4*>(rows);
  for (int e = warp; e < local_experts; e += warps) {
    const int pad_end = min(seg_start[e + 1], capacity);
    for (int row = seg_start[e] + counts[e]; row < pad_end; ++row) {
      for (int v = lane; v < row_vecs; v += kWarpSize) out[(int64_t)row * row_vecs + v] = make_uint4(0, 0, 0, 0);
      if (row_scale != nullptr && lane == 0) row_scale[row] = 1.f;
    }
  }
}

// The expert-major rows of recv slot `f` (its pick k's row index to rows[k] and pointer to
// dst[k]; -1 and null where none); the first part of the slot records them in slot_rows.
__device__ __forceinline__ void slot_destinations(const ExpandArgs& a, const int* seg_start, int64_t slot, int f,
                                                  bool record, int lane, uint4* (&dst)[kMaxTopK],
                                                  int (&rows)[kMaxTopK]) {
  const int K = a.top_k;
  int row = -1;
  if (lane < K) {
    const int pos = a.slot_pos[slot * K + lane];
    if (pos >= 0) {
      const int e = a.slot_expert[slot * K + lane];
      row = seg_start[e] + a.run_counts[(int64_t)e * a.runs + f / kRunLength] + pos;
      if (row >= a.capacity) row = -1;
    }
    if (record) a.slot_rows[slot * K + lane] = row;
  }
  uint4* out = static_cast<uint4*>(a.out);
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {
    const int rk = __shfl_sync(0xffffffffu, row, k < K ? k : 0);
    rows[k] = (k < K && rk >= 0) ? rk : -1;
    dst[k] = rows[k] >= 0 ? out + (int64_t)rk * a.out_row_vecs : nullptr;
  }
}

// One bf16 row to e4m3 with one scale (amax over the row, activation floor), stored at every
// destination; the row's scale to row_scale. The whole warp takes the whole row.
__device__ __forceinline__ void quantise_row(const uint4* src, uint4* const (&dst)[kMaxTopK],
                                             const int (&rows)[kMaxTopK], float* row_scale, int row_vecs, int lane) {
  float amax = 0.f;
  for (int v = lane; v < row_vecs; v += kWarpSize) {
    float f[8];
    bf16x8_to_floats(src[v], f);
    amax = fmaxf(amax, amax8(f));
  }
  const float scale = fp8_scale(warp_max(amax), kFp8MinAmax);
  const float inv_scale = fp8_inverse_scale(scale);
  for (int v = lane; v < row_vecs; v += kWarpSize) {
    const uint2 q = fp8_quantise8(src[v], inv_scale);
#pragma unroll
    for (int k = 0; k < kMaxTopK; ++k) {
      if (dst[k] != nullptr) __stcs(reinterpret_cast<uint2*>(dst[k]) + v, q);
    }
  }
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {
    if (rows[k] >= 0 && lane == 0) row_scale[rows[k]] = scale;
  }
}

// Forward. Rows on the wire as they are (bf16 or fp32): warp copies, kCopyUnroll loads in
// flight per lane, streaming stores (the GEMM reads the rows next, not this kernel). FP8 wire
// rows: dequantised on the way (e4m3 payload vector u holds channels 16u..16u+15, the bf16
// vectors 2u and 2u+1), or copied as e4m3 for the FP8 experts.
__global__ void __launch_bounds__(kLocalThreads, kLocalBlocksPerSM) expand_kernel(const Buffers* __restrict__ buffers,
                                                                                  const ExpandArgs a) {
  const Buffers& b = *buffers;
  __shared__ int seg_start[kMaxExperts + 1];
  const Topology t = b.topo;
  const int lane = threadIdx.x % kWarpSize;
  const int warps = gridDim.x * kLocalWarps;
  const int warp = blockIdx.x * kLocalWarps + threadIdx.x / kWarpSize;
  segment_starts(b, a, seg_start);
  zero_padding(a.out, a.fp8_rows ? a.row_scale : nullptr, seg_start, a.column_totals, a.local_experts, a.capacity,
               a.out_row_vecs, warp, warps, lane);

  const RecvSlots slots(a.recv_counts, t.local_size, b.cap.fwd_slots);
  // A bf16 row quantised here needs its whole amax first: one warp per row.
  const bool quantise = a.fp8_rows && !a.fp8;
  RowSplit split(slots.total(), warps);
  if (quantise) split.parts = 1;
  const int units = a.fp8 ? a.row_vecs / 2 : a.row_vecs;  // 16-byte vectors on the wire
  for (int item = warp; item < slots.total() * split.parts; item += warps) {
    const int f = item / split.parts, part = item % split.parts;
    int g, i;
    const int64_t slot = slots.locate(f, g, i);
    uint4* dst[kMaxTopK];
    int rows[kMaxTopK];
    slot_destinations(a, seg_start, slot, f, part == 0, lane, dst, rows);  // the first part records them
    const uint8_t* src = slot_source(b, g, slot, a.slot_origin[slot], a.own_rows, a.own_row_bytes);
    int begin, end;
    split.range(part, units, begin, end);
    if (quantise) {
      quantise_row(reinterpret_cast<const uint4*>(src), dst, rows, a.row_scale, a.row_vecs, lane);
      continue;
    }
    if (!a.fp8) {
      copy_row<kMaxTopK, kCopyUnroll, true>(reinterpret_cast<const uint4*>(src), dst, end, lane, begin);
      continue;
    }
    const uint4* payload = reinterpret_cast<const uint4*>(src);
    const float* scales = reinterpret_cast<const float*>(src + a.hidden);
    if (a.fp8_rows) {  // one scale for the row (the sender's), in every group's place
      copy_row<kMaxTopK, kCopyUnroll, true>(payload, dst, end, lane, begin);
#pragma unroll
      for (int k = 0; k < kMaxTopK; ++k) {
        if (part == 0 && rows[k] >= 0 && lane == 0) a.row_scale[rows[k]] = scales[0];
      }
      continue;
    }
    for (int u = begin + lane; u < end; u += kWarpSize) {
      uint4 lo, hi;
      fp8_dequantise16(payload[u], scales[u / (kFp8GroupChannels / 16)], lo, hi);
#pragma unroll
      for (int k = 0; k < kMaxTopK; ++k) {
        if (dst[k] == nullptr) continue;
        __stcs(dst[k] + 2 * u, lo);
        __stcs(dst[k] + 2 * u + 1, hi);
      }
    }
  }
}

// One 16-byte vector v of a slot's output gradient (its values in g): grad_y for each pick,
// and the pick's dot product with y.
template <typename T>
__device__ __forceinline__ void backward_vector(const float (&g)[Vec<T>::kElems], int v, const SlotRows& r,
                                                const uint4* y, uint4* out, int row_vecs, float (&dots)[kMaxTopK]) {
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {
    if (r.row[k] < 0) continue;
    out[(int64_t)r.row[k] * row_vecs + v] = pack<T>(g, r.weight[k]);
    float yf[Vec<T>::kElems] = {};
    accumulate<T>(yf, __ldg(y + (int64_t)r.row[k] * row_vecs + v), 1.f);
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < Vec<T>::kElems; ++e) dot += g[e] * yf[e];
    dots[k] += dot;
  }
}

// Backward. kFp8Wire: grad_out arrived as e4m3 + per-128-channel scales (bf16 model rows).
template <typename T, bool kFp8Wire>
__global__ void __launch_bounds__(kLocalThreads, kLocalBlocksPerSM)
    expand_backward_kernel(const Buffers* __restrict__ buffers, const ExpandArgs a) {
  const Buffers& b = *buffers;
  constexpr int kElems = Vec<T>::kElems;
  const Topology t = b.topo;
  const int lane = threadIdx.x % kWarpSize;
  const int warps = gridDim.x * kLocalWarps;
  const int warp = blockIdx.x * kLocalWarps + threadIdx.x / kWarpSize;
  const int K = a.top_k;
  const uint32_t collect_tag = b.calls[kCollectGradW] + 1;  // the collect call that follows
  const uint4* y = static_cast<const uint4*>(a.y);
  uint4* out = static_cast<uint4*>(a.out);
  zero_padding(a.out, nullptr, a.seg_info, a.seg_info + a.local_experts + 1, a.local_experts, a.capacity, a.row_vecs,
               warp, warps, lane);

  const RecvSlots slots(a.recv_counts, t.local_size, b.cap.fwd_slots);
  for (int f = warp; f < slots.total(); f += warps) {
    int g, i;
    const int64_t slot = slots.locate(f, g, i);
    const SlotRows r = load_slot_rows(a.slot_rows, a.slot_w, slot, K, a.capacity, lane);
    const uint8_t* src = slot_source(b, g, slot, a.slot_origin[slot], a.own_rows, a.own_row_bytes);
    float dots[kMaxTopK] = {};
    if constexpr (kFp8Wire) {
      static_assert(kElems == 8, "an FP8 wire carries bf16 rows");
      const uint4* payload = reinterpret_cast<const uint4*>(src);
      const float* scales = reinterpret_cast<const float*>(src + a.hidden);
      for (int u = lane; u < a.row_vecs / 2; u += kWarpSize) {
        const uint4 raw = payload[u];
        const float scale = scales[u / (kFp8GroupChannels / 16)];
        float gf[2][8];
        fp8x8_to_floats(make_uint2(raw.x, raw.y), gf[0]);
        fp8x8_to_floats(make_uint2(raw.z, raw.w), gf[1]);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
          for (int e = 0; e < 8; ++e) gf[h][e] *= scale;
          backward_vector<T>(gf[h], 2 * u + h, r, y, out, a.row_vecs, dots);
        }
      }
    } else {
      const uint4* rows = reinterpret_cast<const uint4*>(src);
      for (int v = lane; v < a.row_vecs; v += kWarpSize) {
        float gf[kElems] = {};
        accumulate<T>(gf, rows[v], 1.f);
        backward_vector<T>(gf, v, r, y, out, a.row_vecs, dots);
      }
    }
    // All K entries, zero for picks elsewhere: the forwarder adds up every rank's vector.
    float* home = b.peer[g].fwd_grad_w + ((int64_t)t.local * b.cap.fwd_slots + i) * kMaxTopK;
#pragma unroll
    for (int k = 0; k < kMaxTopK; ++k) {
      const float dot = r.row[k] >= 0 ? warp_sum(dots[k]) : 0.f;  // r.row is warp-uniform
      if (lane == k && k < K) home[k] = dot;
    }
    if (g != t.local) {
      publish_flag(b.peer[g].grad_w_flags + (int64_t)t.local * b.cap.fwd_slots + i, collect_tag, lane);
    }
  }
}

void launch_expand(const Buffers& b, const ExpandArgs& a, bool bf16, bool backward, cudaStream_t stream) {
  if (backward) {
    const int blocks = b.sm_count * kLocalBlocksPerSM;
    if (a.fp8) {
      expand_backward_kernel<__nv_bfloat16, true><<<blocks, kLocalThreads, 0, stream>>>(b.on_device, a);
    } else if (bf16) {
      expand_backward_kernel<__nv_bfloat16, false><<<blocks, kLocalThreads, 0, stream>>>(b.on_device, a);
    } else {
      expand_backward_kernel<float, false><<<blocks, kLocalThreads, 0, stream>>>(b.on_device, a);
    }
  } else {
    expand_kernel<<<b.sm_count * kLocalBlocksPerSM, kLocalThreads, 0, stream>>>(b.on_device, a);
  }
  MOE_COMM_CHECK_LAUNCH("expand");
}

}  // namespace moe_comm
