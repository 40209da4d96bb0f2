// The buffers one process shares with its expert-parallel peers, sized once from the recipe.
//
// Symmetric buffers live on the NVSHMEM heap (same offsets on every rank); kernels reach a
// peer's copy through the NVLink mapping nvshmem_ptr returned at start-up (peer_* arrays).
// Every buffer is reused by every MoE layer and by forward and backward: a kernel only writes
// into a peer's buffer after that peer finished reading it, because dispatch-like calls
// (dispatch, combine backward) and combine-like calls (combine, dispatch backward) alternate,
// and the Python side inserts a barrier when they do not.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace moe_comm {

struct Buffers {
  int rank = 0;
  int world = 1;
  int max_tokens = 0;     // most tokens one rank dispatches per call
  int max_row_bytes = 0;  // hidden * element size, rounded to 16 bytes
  int max_blocks = 0;     // SM budget the scratch was sized for

  // Symmetric. Indexing [source rank][slot or token].
  uint8_t* rows = nullptr;          // [world][max_tokens][max_row_bytes] dispatch-like arrivals;
                                    // combine stages its per-slot partial sums here (reduce.cu)
  SlotMeta* meta = nullptr;         // [world][max_tokens]
  uint32_t* slot_flag = nullptr;    // [world][max_tokens]
  int32_t* counts = nullptr;        // [world][kMaxExperts + 1]: slots sent, then rows per local expert
  uint32_t* counts_flag = nullptr;  // [world]
  uint8_t* partials = nullptr;      // [world][max_tokens][max_row_bytes] combine-like arrivals
  uint32_t* partial_flag = nullptr; // [world][max_tokens]
  float* grad_w = nullptr;          // [max_tokens][kMaxTopK] routing-weight gradients coming home
  uint32_t* grad_w_flag = nullptr;  // [world][max_tokens]

  // The same symmetric buffers on each peer (peer_x[rank] == x).
  uint8_t* peer_rows[kMaxRanks] = {};
  SlotMeta* peer_meta[kMaxRanks] = {};
  uint32_t* peer_slot_flag[kMaxRanks] = {};
  int32_t* peer_counts[kMaxRanks] = {};
  uint32_t* peer_counts_flag[kMaxRanks] = {};
  uint8_t* peer_partials[kMaxRanks] = {};
  uint32_t* peer_partial_flag[kMaxRanks] = {};
  float* peer_grad_w[kMaxRanks] = {};
  uint32_t* peer_grad_w_flag[kMaxRanks] = {};

  // Local to this GPU.
  int32_t* block_hist = nullptr;  // [max_blocks][kMaxExperts + kMaxRanks] layout scratch
  int32_t* token_rank = nullptr;  // [max_tokens][kMaxTopK] layout scratch
  uint32_t* calls = nullptr;      // [2]: dispatch-like and combine-like calls so far (flag tags)
  int32_t* errors = nullptr;      // [kErrorWords] in mapped pinned host memory
};

// Which call counter (and so which flag tag) a kernel uses.
constexpr int kDispatchLikeCalls = 0;
constexpr int kCombineLikeCalls = 1;

// Offsets of the per-call receive summary (`recv_info`, int32) written by dispatch.
struct RecvInfo {
  int world, local_experts;
  __host__ __device__ int slots_from(int src) const { return src; }                 // [world]
  __host__ __device__ int seg_start(int e) const { return world + e; }              // [local_experts]
  __host__ __device__ int count(int e) const { return world + local_experts + e; }  // [local_experts]
  __host__ __device__ int size() const { return world + 2 * local_experts; }
};

}  // namespace moe_comm
