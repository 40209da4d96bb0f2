// The local kernels: the routing plan of a rank's own tokens, the staging of rows for the
// network, and the expert-major layout of what arrived (and its mirror in combine). They run
// over the whole GPU with ordinary launches and never wait on another GPU, so the recipe's SM
// budget is left to the communication kernels (comm/), which only move rows.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "runtime/buffers.h"

namespace moe_comm {

// Tokens (plan) or recv slots (receive layout) one warp counts in order: positions within a
// run come from the warp's own counters, runs are then offset by an exclusive scan.
constexpr int kRunLength = 32;
// Blocks of the counting passes are small (two warps), so a few hundred runs spread over
// every SM instead of a few.
constexpr int kCountThreads = 64;
constexpr int kCountWarps = kCountThreads / 32;

// Plan: where each of this rank's tokens goes. Columns: [world] destination ranks (once per
// rank a token hits), then [nodes] destination nodes (once per other node it hits).
struct PlanArgs {
  const int64_t* topk_idx;  // [T, K]
  const float* topk_w;      // [T, K]
  int num_tokens, top_k, num_experts, runs;
  int32_t* run_counts;      // [columns][runs]: per run, then scanned in place
  int32_t* column_totals;   // [columns]
  int32_t* pick_pos;        // [T, K]: the token's position among this rank's tokens for the
                            //   pick's rank (the same for picks on one rank)
  int32_t* rank_pos;        // [T, G]: that position for each rank of this node, -1: not sent
  int32_t* send_idx;        // [T, nodes]: the token's send slot for each other node, -1: none
  // The recv slots of this rank's own tokens at this rank itself lead its own partition at
  // their plan positions (common/rail_plan.cuh), so assign writes their metadata directly.
};

// Scan: run_counts[c][r] -> exclusive prefix over r, and column_totals[c].
struct ScanArgs {
  int32_t* run_counts;
  int32_t* column_totals;
  int runs, columns;
};

// Pack: the send slots of the network hop, and in FP8 the quantised own rows.
struct PackArgs {
  const void* x;             // [T, hidden] model dtype
  const int64_t* topk_idx;   // forward: [T, K]
  const float* topk_w;       // forward: [T, K]
  const int32_t* pick_pos;   // forward: [T, K]
  const int32_t* send_idx;   // [T, nodes]
  int num_tokens, top_k, num_experts, hidden, row_vecs;  // row_vecs: of x
  bool meta;                 // forward: write NetMeta (the backward only moves rows)
  bool fp8;                  // quantise rows to e4m3 + fp32 scales (bf16 rows)
  bool row_scale;            // fp8: one scale for the whole row, written to every group
  float min_amax;            // fp8: smallest amax a scale is taken for (common/vec.cuh)
  uint8_t* own_fp8;          // fp8: [T, fp8_row_bytes(hidden)]
};

// Receive layout, first pass: expert counts per run of recv slots (partition-major order).
struct ReceiveArgs {
  const int32_t* recv_counts;  // [G] recv slots per partition
  int top_k, local_experts, runs;
  int32_t* run_counts;         // [local_experts][runs]
  int32_t* column_totals;      // [local_experts]
  int32_t* slot_pos;           // [G * fwd_slots, K]: position within the run, -1: not here
  int32_t* slot_expert;        // [G * fwd_slots, K]: local expert of the pick
  float* slot_w;               // [G * fwd_slots, K]
  int32_t* slot_origin;        // [G * fwd_slots]: own-forwarded slots: own token t (>= 0), or
                               //   -(net slot + 2)
};

// Expand: the expert-major rows the grouped GEMM takes. Forward: slot_rows become rows of
// recv_x (positions + run offsets + expert segment starts) and the rows are copied there
// (dequantised from FP8 when the wire was FP8; or, for the FP8 experts, as e4m3 rows with one
// fp32 scale per row: kept as they came from an FP8 wire, quantised here from a bf16 one).
// Backward (of combine): grad_y rows are w * grad_out (dequantised when the wire was FP8) and
// the routing-weight gradients <grad_out, y> go to the slot's forwarder.
struct ExpandArgs {
  const int32_t* recv_counts;   // [G]
  const int32_t* run_counts;    // forward: scanned [local_experts][runs]
  const int32_t* column_totals; // forward: [local_experts] true counts
  int top_k, local_experts, runs, align, capacity, hidden;
  bool fp8;                     // the wire rows are e4m3 + fp32 scales per 128 channels
  bool fp8_rows;                // forward: out is e4m3 rows + row_scale (the FP8 experts' input)
  const void* own_rows;         // this rank's own rows: forward x (or its FP8 copy), backward grad_out
  int own_row_bytes;
  const void* y;                // backward: [capacity, hidden] the forward's expert outputs
  const int32_t* slot_pos;      // forward: receive layout's positions
  const int32_t* slot_expert;   // forward: receive layout's local experts
  int32_t* slot_rows;           // [G * fwd_slots, K]: forward writes, backward reads
  const float* slot_w;
  const int32_t* slot_origin;
  int32_t* tokens_per_expert;   // forward: [local_experts], padded, clamped to capacity
  int32_t* seg_info;            // [2 * local_experts + 1] segment starts and their end, then true counts:
                                // forward writes, backward reads
  void* out;                    // [capacity, hidden] recv_x, or grad_y
  float* row_scale;             // fp8_rows: [capacity] the scale of each row of out
  int row_vecs;                 // model dtype row in 16-byte vectors
  int out_row_vecs;             // a row of out in 16-byte vectors (row_vecs, or hidden / 16 for e4m3)
};

// Reduce: each recv slot's expert outputs, summed with the routing weights (1 when slot_w is
// null: the backward of dispatch), staged in fwd_rows for the combine kernel - or, for a token
// of this rank whose experts all live here, stored as its output row straight away.
struct ReduceArgs {
  const void* y;
  const int32_t* recv_counts;
  const int32_t* slot_rows;
  const float* slot_w;
  const int32_t* slot_origin;
  const int32_t* rank_pos;  // [T, G]
  const int32_t* send_idx;  // [T, nodes]
  int top_k, capacity, row_vecs;
  void* out;                // [T, hidden]
};

// Finalize: a token's partial sums from the ranks of its node and from the other nodes, added
// in fp32. Rows (combine) or routing-weight gradients (combine backward).
struct FinalizeArgs {
  const int32_t* rank_pos;     // [T, G]
  const int32_t* send_idx;     // [T, nodes]
  int num_tokens, top_k, row_vecs;
  void* out;                   // [T, hidden] or [T, K] fp32
};

void launch_plan(const Buffers& b, const PlanArgs& a, cudaStream_t stream);
void launch_pack(const Buffers& b, const PackArgs& a, cudaStream_t stream);
void launch_receive_layout(const Buffers& b, const ReceiveArgs& a, cudaStream_t stream);
void launch_expand(const Buffers& b, const ExpandArgs& a, bool bf16, bool backward, cudaStream_t stream);
void launch_reduce(const Buffers& b, const ReduceArgs& a, bool bf16, cudaStream_t stream);
void launch_finalize(const Buffers& b, const FinalizeArgs& a, bool bf16, cudaStream_t stream);
void launch_gather_grad_w(const Buffers& b, const FinalizeArgs& a, cudaStream_t stream);
// Used by launch_plan and launch_receive_layout.
void launch_scan(const ScanArgs& a, cudaStream_t stream);

}  // namespace moe_comm
