// Device helpers shared by the dispatch and combine kernels.
//
// The kernels move rows between GPUs with plain 16-byte stores through nvshmem_ptr (NVLink
// peer mappings) and publish each finished row with a per-row flag: the sender fences its
// stores and then writes the flag with release semantics; the receiver spins on the flag with
// acquire semantics before it reads the row. Flags carry the call's tag (a per-kernel-kind call
// counter kept on the device), so no flag is ever reset and a step can be replayed from a CUDA
// graph. A communication kernel ends only once every row meant for its rank has arrived, so
// the local layout kernels launched after it on the same stream (expand, reduce) read the
// arrived rows without flags.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace moe_comm {

// Most experts one token may pick (DeepSeek-V3 uses 8). Bounds per-slot metadata and the
// per-pick registers of the copy loops.
constexpr int kMaxTopK = 8;
// Most experts in one MoE layer. Bounds the per-block histograms in shared memory.
constexpr int kMaxExperts = 1024;
// Most ranks in one expert-parallel group served by these intranode kernels.
constexpr int kMaxRanks = 8;
constexpr int kWarpSize = 32;
constexpr int kThreadsPerBlock = 1024;
constexpr int kWarpsPerBlock = kThreadsPerBlock / kWarpSize;
// Blocks of the local layout kernels (expand, reduce): two per SM keeps 64 registers a thread.
constexpr int kLocalThreadsPerBlock = 512;
constexpr int kLocalBlocksPerSM = 2;
constexpr int kLocalWarpsPerBlock = kLocalThreadsPerBlock / kWarpSize;
// 16-byte vectors each lane loads before it stores any when copying a row: with one load in
// flight per lane a row copy waits one memory round trip per 512 bytes of the warp, and the
// copies (not the link) then bound the kernels.
constexpr int kCopyUnroll = 4;

// Words of the error array the host reads (mapped pinned memory; plain stores, no atomics).
constexpr int kErrorRowsNeeded = 0;       // rows a call needed when they exceeded the capacity
constexpr int kErrorExpertIndex = 1;      // 1: a topk index outside [0, num_experts)
constexpr int kErrorDuplicateExpert = 2;  // 1: a token picked the same expert twice
constexpr int kErrorWords = 3;

// What travels with a token to each rank that holds one of its experts.
struct SlotMeta {
  int32_t token;                 // index of the token on its source rank
  int32_t expert[kMaxTopK];      // global expert ids, -1 where the k-th pick is not on this rank
  int32_t rank_in_expert[kMaxTopK];  // position among the source's rows for that expert
  float weight[kMaxTopK];        // routing weight of the k-th pick
};

#if defined(__CUDACC__)  // the host-only torch bindings include this file for the constants

__device__ __forceinline__ void store_release_sys(uint32_t* addr, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(value) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* addr) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(addr) : "memory");
  return value;
}

// Every lane of the warp waits until the flag holds `tag`, so each lane's later loads are
// ordered after the acquire.
__device__ __forceinline__ void wait_flag(const uint32_t* flag, uint32_t tag) {
  while (load_acquire_sys(flag) != tag) {
  }
}

// Called by every lane after its stores of a row: the fence orders them before the flag that
// lane 0 then releases.
__device__ __forceinline__ void publish_flag(uint32_t* flag, uint32_t tag, int lane) {
  __threadfence_system();
  __syncwarp();
  if (lane == 0) store_release_sys(flag, tag);
}

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

// A 16-byte vector viewed as elements of T.
template <typename T>
struct Vec {
  static constexpr int kElems = 16 / sizeof(T);
  union {
    uint4 raw;
    T elems[kElems];
  };
};

// Accumulate weight * (16 bytes of T) into fp32 lanes.
template <typename T>
__device__ __forceinline__ void accumulate(float (&acc)[Vec<T>::kElems], uint4 raw, float weight) {
  Vec<T> v;
  v.raw = raw;
#pragma unroll
  for (int i = 0; i < Vec<T>::kElems; ++i) acc[i] += weight * to_float(v.elems[i]);
}

template <typename T>
__device__ __forceinline__ uint4 pack(const float (&acc)[Vec<T>::kElems], float scale) {
  Vec<T> v;
#pragma unroll
  for (int i = 0; i < Vec<T>::kElems; ++i) v.elems[i] = from_float<T>(acc[i] * scale);
  return v.raw;
}

template <typename T>
__device__ __forceinline__ float dot16(uint4 a, uint4 b) {
  Vec<T> va, vb;
  va.raw = a;
  vb.raw = b;
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < Vec<T>::kElems; ++i) s += to_float(va.elems[i]) * to_float(vb.elems[i]);
  return s;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// One warp copies a row of `row_vecs` 16-byte vectors from `src` to every non-null `dst[i]`
// (peers' buffers through NVLink, or expert-major rows in HBM), kUnroll loads in flight per
// lane. `src` must not be written by anyone while the copy runs.
template <int kDsts, int kUnroll = kCopyUnroll>
__device__ __forceinline__ void copy_row(const uint4* src, uint4* const (&dst)[kDsts], int row_vecs, int lane) {
  int v = lane;
  for (; v + (kUnroll - 1) * kWarpSize < row_vecs; v += kUnroll * kWarpSize) {
    uint4 value[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) value[u] = src[v + u * kWarpSize];
#pragma unroll
    for (int d = 0; d < kDsts; ++d) {
      if (dst[d] == nullptr) continue;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) dst[d][v + u * kWarpSize] = value[u];
    }
  }
  for (; v < row_vecs; v += kWarpSize) {
    const uint4 value = src[v];
#pragma unroll
    for (int d = 0; d < kDsts; ++d) {
      if (dst[d] != nullptr) dst[d][v] = value;
    }
  }
}

// The destinations of one token's row at its peers: the slot each peer assigned it in that
// peer's `rows` buffer, or nullptr for the own rank and for peers the token does not go to.
// `my_slot` is lane d's slot at rank d (-1: not sent there).
__device__ __forceinline__ void peer_row_destinations(uint4* (&dst)[kMaxRanks], uint8_t* const (&peer_rows)[kMaxRanks],
                                                      int my_slot, int world, int rank, int64_t max_tokens,
                                                      int row_stride) {
#pragma unroll
  for (int d = 0; d < kMaxRanks; ++d) {
    const int slot = __shfl_sync(0xffffffffu, my_slot, d < world ? d : 0);
    dst[d] = (d < world && d != rank && slot >= 0)
                 ? reinterpret_cast<uint4*>(peer_rows[d]) + ((int64_t)rank * max_tokens + slot) * row_stride
                 : nullptr;
  }
}

__device__ __forceinline__ int round_up(int x, int align) { return (x + align - 1) / align * align; }

// Received slots are visited in one order by every kernel: the own rank's slots first, then
// those of rank + 1, rank + 2, ... (a source's slots in index order). Slot (source s, index j)
// lives at s * max_tokens + j of the per-slot buffers.
struct SlotOrder {
  int prefix[kMaxRanks + 1];  // slots visited before the q-th source
  int rank, world, first;     // first: 1 skips the own rank's slots

  // slots_from[s * stride]: how many slots source rank s sent to this rank.
  __device__ __forceinline__ SlotOrder(const int32_t* slots_from, int stride, int rank_, int world_, bool skip_own)
      : rank(rank_), world(world_), first(skip_own ? 1 : 0) {
    prefix[0] = 0;
#pragma unroll
    for (int q = 0; q < kMaxRanks; ++q) {
      const int s = (rank + first + q) % world;
      prefix[q + 1] = prefix[q] + (first + q < world ? slots_from[(int64_t)s * stride] : 0);
    }
  }
  __device__ __forceinline__ int total() const { return prefix[kMaxRanks]; }
  // The i-th visited slot (i < total()): its source rank and index within that source.
  __device__ __forceinline__ void locate(int i, int& source, int& index) const {
    int q = 0;
    while (i >= prefix[q + 1]) ++q;
    source = (rank + first + q) % world;
    index = i - prefix[q];
  }
};

// Expert-major rows and routing weights of one slot, broadcast to the whole warp (row -1: the
// pick is not on this rank, or its row fell beyond the receive capacity).
struct SlotRows {
  int row[kMaxTopK];
  float weight[kMaxTopK];
};

// slot_w == nullptr: every weight is 1 (the backward of dispatch sums the copies' gradients).
__device__ __forceinline__ SlotRows load_slot_rows(const int32_t* slot_rows, const float* slot_w, int64_t slot_index,
                                                   int top_k, int capacity, int lane) {
  int row = -1;
  float weight = 1.f;
  if (lane < top_k) {
    row = slot_rows[slot_index * top_k + lane];
    if (slot_w != nullptr) weight = slot_w[slot_index * top_k + lane];
  }
  SlotRows r;
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {
    const int rk = __shfl_sync(0xffffffffu, row, k < top_k ? k : 0);
    r.weight[k] = __shfl_sync(0xffffffffu, weight, k < top_k ? k : 0);
    r.row[k] = (k < top_k && rk >= 0 && rk < capacity) ? rk : -1;
  }
  return r;
}

#endif  // __CUDACC__

}  // namespace moe_comm
