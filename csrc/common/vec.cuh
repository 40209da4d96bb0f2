// Vector maths on 16-byte rows: the element views, fp32 accumulation, and the e4m3 quantiser
// every FP8 path uses: a scale is amax / 448 over its group of values (128 channels for FP8
// dispatch, a whole row for the FP8 experts' rows), applied as a product with its reciprocal
// (both correctly rounded) and rounded to nearest even, so a pure-torch reference
// (moe_comm/kernels/fp8_reference.py) reproduces it bit for bit.
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
// Smallest amax a group is scaled for, so an all-zero group gets a finite scale: activation
// rows (FP8 dispatch, and the rows the FP8 experts receive).
constexpr float kFp8MinAmax = 1e-4f;
// The same for gradients and the FP8 experts' own operands (weights, the gate's output, the
// output gradient): a gradient row's values are often far below 1e-4, and a floor there would
// flatten them, so only an all-zero group is kept from dividing by zero.
constexpr float kFp8MinAmaxSmall = 1e-30f;

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

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// 16 bytes of bf16 as 8 floats, and back (rounded to nearest).
__device__ __forceinline__ void bf16x8_to_floats(uint4 raw, float (&out)[8]) {
  Vec<__nv_bfloat16> v;
  v.raw = raw;
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = __bfloat162float(v.elems[i]);
}

__device__ __forceinline__ uint4 floats_to_bf16x8(const float (&in)[8]) {
  Vec<__nv_bfloat16> v;
#pragma unroll
  for (int i = 0; i < 8; ++i) v.elems[i] = __float2bfloat16(in[i]);
  return v.raw;
}

__device__ __forceinline__ float amax8(const float (&in)[8]) {
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(in[i]));
  return m;
}

// ---- FP8 (e4m3) rows ------------------------------------------------------------------------
// A bf16 row of `hidden` channels is quantised by one warp, 16 lanes per 128-channel group: lane
// v holds bf16 vector v (8 channels). The payload byte of channel c is at c, the scale of group
// g at hidden + 4 g.

// The scale of a group whose largest |value| is amax.
__device__ __forceinline__ float fp8_scale(float amax, float min_amax) { return fmaxf(amax, min_amax) / kFp8Max; }

// Half-warp amax of |x| over the lane's 8 channels: the group's scale.
__device__ __forceinline__ float fp8_group_scale(uint4 raw, float min_amax = kFp8MinAmax) {
  float f[8];
  bf16x8_to_floats(raw, f);
  float amax = amax8(f);
#pragma unroll
  for (int offset = 8; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  return fp8_scale(amax, min_amax);
}

// What a group's values are multiplied by before rounding to e4m3: 1 / scale, correctly rounded
// (one IEEE division a group). Dividing each value by the scale instead cost a correctly rounded
// division per value (div.rn.f32: a reciprocal, its Newton steps, a range check and a branch to a
// slow path, about ten instructions against one multiply): a fifth to two fifths of the FP8
// experts' row kernels' SASS instructions (quantise_rows 4,080 -> 3,216, weights 2,968 -> 1,648,
// all template instances). The product is the quotient to within an ulp of fp32,
// far inside an e4m3 rounding step (2^-3 relative), so a code moves only where the quotient sits
// within that ulp of a rounding boundary.
__device__ __forceinline__ float fp8_inverse_scale(float scale) { return 1.f / scale; }

// 8 values -> 8 e4m3 bytes, x * inv_scale (fp8_inverse_scale) rounded to nearest even and saturated.
__device__ __forceinline__ uint2 fp8_quantise_floats8(const float (&f)[8], float inv_scale) {
  uint32_t word[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t packed = 0;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const float2 pair = make_float2(f[4 * h + 2 * p] * inv_scale, f[4 * h + 2 * p + 1] * inv_scale);
      const __nv_fp8x2_storage_t q = __nv_cvt_float2_to_fp8x2(pair, __NV_SATFINITE, __NV_E4M3);
      packed |= (uint32_t)q << (16 * p);
    }
    word[h] = packed;
  }
  return make_uint2(word[0], word[1]);
}

// 8 bf16 channels -> 8 e4m3 bytes.
__device__ __forceinline__ uint2 fp8_quantise8(uint4 raw, float inv_scale) {
  float f[8];
  bf16x8_to_floats(raw, f);
  return fp8_quantise_floats8(f, inv_scale);
}

// 8 e4m3 bytes -> their 8 values (unscaled).
__device__ __forceinline__ void fp8x8_to_floats(uint2 raw, float (&out)[8]) {
  const uint32_t words[2] = {raw.x, raw.y};
#pragma unroll
  for (int w = 0; w < 2; ++w) {
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(words[w] >> (16 * p)), __NV_E4M3);
      __half2 h;
      h = *reinterpret_cast<const __half2*>(&h2);
      const float2 f = __half22float2(h);
      out[4 * w + 2 * p] = f.x;
      out[4 * w + 2 * p + 1] = f.y;
    }
  }
}

// 16 e4m3 bytes -> 16 bf16 channels (two vectors), q * scale.
__device__ __forceinline__ void fp8_dequantise16(uint4 raw, float scale, uint4& lo, uint4& hi) {
  float f[2][8];
  fp8x8_to_floats(make_uint2(raw.x, raw.y), f[0]);
  fp8x8_to_floats(make_uint2(raw.z, raw.w), f[1]);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int i = 0; i < 8; ++i) f[h][i] *= scale;
  }
  lo = floats_to_bf16x8(f[0]);
  hi = floats_to_bf16x8(f[1]);
}

#endif  // __CUDACC__

}  // namespace moe_comm
