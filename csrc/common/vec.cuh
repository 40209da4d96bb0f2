// Vector maths on 16-byte rows: the element views, fp32 accumulation, and the e4m3 quantiser
// FP8 dispatch uses (one fp32 scale per 128 channels, computed as amax / 448 and applied by
// division, so a pure-torch reference reproduces it bit for bit).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/wire.h"

namespace moe_comm {

constexpr int kWarpSize = 32;
// Largest finite e4m3 value: a group's amax maps onto it.
constexpr float kFp8Max = 448.f;
// Smallest amax a group is scaled for, so an all-zero group gets a finite scale.
constexpr float kFp8MinAmax = 1e-4f;

#if defined(__CUDACC__)

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

// acc += weight * (16 bytes of T), in fp32.
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

// ---- FP8 (e4m3) rows ------------------------------------------------------------------------
// A bf16 row of `hidden` channels is quantised by one warp, 16 lanes per 128-channel group: lane
// v holds bf16 vector v (8 channels). The payload byte of channel c is at c, the scale of group
// g at hidden + 4 g.

// Half-warp amax of |x| over the lane's 8 channels: the group's scale.
__device__ __forceinline__ float fp8_group_scale(uint4 raw) {
  Vec<__nv_bfloat16> v;
  v.raw = raw;
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(__bfloat162float(v.elems[i])));
#pragma unroll
  for (int offset = 8; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  return fmaxf(amax, kFp8MinAmax) / kFp8Max;
}

// 8 bf16 channels -> 8 e4m3 bytes, x / scale rounded to nearest even and saturated.
__device__ __forceinline__ uint2 fp8_quantise8(uint4 raw, float scale) {
  Vec<__nv_bfloat16> v;
  v.raw = raw;
  uint32_t word[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t packed = 0;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const float2 pair = make_float2(__bfloat162float(v.elems[4 * h + 2 * p]) / scale,
                                      __bfloat162float(v.elems[4 * h + 2 * p + 1]) / scale);
      const __nv_fp8x2_storage_t q = __nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3);
      packed |= (uint32_t)q << (16 * p);
    }
    word[h] = packed;
  }
  return make_uint2(word[0], word[1]);
}

// 16 e4m3 bytes -> 16 bf16 channels (two vectors), q * scale.
__device__ __forceinline__ void fp8_dequantise16(uint4 raw, float scale, uint4& lo, uint4& hi) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  Vec<__nv_bfloat16> out[2];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(words[w] >> (16 * p)), __NV_E4M3);
      __half2 h;
      h = *reinterpret_cast<const __half2*>(&h2);
      const float2 f = __half22float2(h);
      const int c = 4 * w + 2 * p;
      out[c / 8].elems[c % 8] = __float2bfloat16(f.x * scale);
      out[c / 8].elems[c % 8 + 1] = __float2bfloat16(f.y * scale);
    }
  }
  lo = out[0].raw;
  hi = out[1].raw;
}

#endif  // __CUDACC__

}  // namespace moe_comm
