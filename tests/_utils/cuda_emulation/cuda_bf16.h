// bf16 as CUDA's cuda_bf16.h defines the conversions used here: __float2bfloat16_rn rounds to nearest even,
// NaN stays NaN (canonical 0x7FFF as CUDA's host path returns), widening is exact.
#pragma once
#include "cuda_runtime.h"
#include <cstdint>
#include <cstring>
struct __nv_bfloat16 { uint16_t x; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  __nv_bfloat16 r;
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) { r.x = 0x7FFF; return r; }
  u += 0x7FFFu + ((u >> 16) & 1u);
  r.x = static_cast<uint16_t>(u >> 16);
  return r;
}
inline float __bfloat162float(__nv_bfloat16 h) { uint32_t u = uint32_t(h.x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return float2{__bfloat162float(h.x), __bfloat162float(h.y)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
