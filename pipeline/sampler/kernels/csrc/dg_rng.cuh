// Stateless counter-based RNG shared by the CUDA sampler and host code.
//
// This is the same function as pipeline/sampler/rng.py (murmur3 fmix32 chained with a boost-style combine).
// rng.py emulates uint32 arithmetic with int64 & 0xFFFFFFFF; here it is native uint32 arithmetic, which
// wraps modulo 2**32 exactly as the masked int64 does. Everything is __host__ __device__ so a tiny host
// program (tests/unit/sampler/test_kernels_build.py) can prove the GPU hash equals the CPU one without a GPU.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define DG_HD __host__ __device__ __forceinline__
#else
#define DG_HD inline
#endif

namespace dg {

constexpr uint32_t kGolden = 0x9E3779B9u;
constexpr uint32_t kStreamInit = 0;     // initial canvas tokens
constexpr uint32_t kStreamSample = 1;   // Gumbel noise for sampling
constexpr uint32_t kStreamRenoise = 2;  // replacement tokens for positions that were not kept

// murmur3's 32-bit finalizer.
DG_HD uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

// h' = fmix32(h ^ (word + GOLDEN + (h << 6) + (h >> 2))): order-sensitive combine.
DG_HD uint32_t combine(uint32_t h, uint32_t word) {
  return fmix32(h ^ (word + kGolden + (h << 6) + (h >> 2)));
}

// Per-row key for one (canvas, step, stream). int64 ids are reduced to their low 32 bits, which is
// what `w & MASK32` does to an int64 (two's complement) in rng.py; the seed's high word is folded in after
// its low one where it is not 0.
DG_HD uint32_t key_hash(int64_t seed, int64_t request, int64_t canvas, int64_t step, uint32_t stream) {
  uint32_t h = fmix32(static_cast<uint32_t>(seed));
  const uint32_t hi = static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32);
  if (hi != 0) h = combine(h, hi);  // a seed's high word, only where set (rng.key_hash)
  h = combine(h, static_cast<uint32_t>(request));
  h = combine(h, static_cast<uint32_t>(canvas));
  h = combine(h, static_cast<uint32_t>(step));
  return combine(h, stream);
}

// 32 random bits for one canvas position (rng.position_bits).
DG_HD uint32_t position_bits(uint32_t key, uint32_t position) { return combine(key, position); }

// Uniform token in [0, vocab): multiply-shift in 64 bits (rng.uniform_tokens).
DG_HD int64_t uniform_token(uint32_t key, uint32_t position, uint32_t vocab) {
  return static_cast<int64_t>((static_cast<uint64_t>(position_bits(key, position)) * vocab) >> 32);
}

// The 23 random bits behind the Gumbel uniform of token v at a position (rng.gumbel: bits >> 9).
DG_HD uint32_t gumbel_bits(uint32_t position_key, uint32_t v) { return combine(position_key, v) >> 9; }

// u = (r + 0.5) * 2**-23, as rng.gumbel computes it in fp32. With 23 bits r + 0.5 needs 24 significant
// bits, so both operations are exact and u lies strictly inside (0, 1): g is always finite.
DG_HD float gumbel_uniform_from_bits(uint32_t r) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(__fadd_rn(static_cast<float>(r), 0.5f), 1.1920928955078125e-07f);
#else
  volatile float sum = static_cast<float>(r) + 0.5f;  // volatile: a real fp32 rounding, no contraction
  return sum * 1.1920928955078125e-07f;                // times 2**-23: exact
#endif
}

DG_HD float gumbel_uniform(uint32_t position_key, uint32_t v) {
  return gumbel_uniform_from_bits(gumbel_bits(position_key, v));
}


}  // namespace dg
