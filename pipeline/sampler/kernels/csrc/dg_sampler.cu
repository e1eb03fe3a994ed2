// Fused entropy-bound sampler step for DiffusionGemma (docs/model.md, "Sampler"), one denoise step per launch pair.
//
// The PyTorch sampler (pipeline/sampler/reference.py) is the oracle: kept sets, sampled tokens, argmax and the next
// canvas must match it bit for bit, entropies to 1e-5 relative. What that takes:
//   * z = logits / T with an IEEE division (__fdiv_rn), as torch divides a tensor by a tensor;
//   * the Gumbel noise is the stateless hash of pipeline/sampler/rng.py (dg_rng.cuh), z + g is one rounded fp32
//     add (__fadd_rn, never contracted into an FMA) and g = -logf(-logf(u)) is what torch's CUDA log gives;
//   * argmax ties go to the lowest index, like torch.argmax;
//   * the entropy sort breaks ties by position, i.e. torch.sort(stable=True) (torch.sort's default order
//     among exactly equal entropies is unspecified: on CPU it is not stable past 16 elements), and the
//     prefix sum is accumulated in double and rounded to fp32, as torch's CPU cumsum does.
//
// Kernel A (dg_rows_f32x4, _f32x1, _bf16x8, _bf16x1): one block per (row, position), one pass over the
//   vocabulary computing the online softmax (max m, s = sum e^(z-m), t = sum e^(z-m) (z-m)), the argmax
//   of z and the Gumbel-max sample; entropy H = log s - t / s has no cancellation (both terms >= 0), and
//   the Gumbel logs are skipped for tokens that provably cannot win (exact). An optional second pass
//   writes softmax(z) in bf16 for the next step's self-conditioning: the only [B, L, V] output.
// Kernel B (dg_accept): one block per row: pinned entropies -> 0, bitonic sort of (H, index),
//   inclusive scan, keep = cumsum - H <= bound, next canvas (kept ? sample : re-noise token, pinned ->
//   template), argmax canvas, stability counter and stop flag, all on the device.
//
// No torch headers here: plain extern "C" launchers on raw pointers, so the TensorRT plugin and the torch
// binding (torch_binding.cpp) share one implementation. Logits are finite in a working model (they are
// softcapped); a NaN or infinite one (a broken checkpoint) gives what the oracle gives (NaN entropies, the first
// NaN as argmax and sample, NaN entropies sorted last: dg_order.cuh).
//
// Constrained decoding (docs/constrained.md): kernel A optionally reads compact allowed-token masks, a table
// [M, V] of bytes and a row index [B, L] (int64, -1 = free), and replaces a disallowed logit with
// kMaskedLogit before everything else, exactly as pipeline/sampler/reference.py's mask_logits does
// (masked_fill with -1e30): -inf in effect, finite so 0 * log 0 terms stay 0. Null pointers: no mask.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "dg_order.cuh"
#include "dg_rng.cuh"

namespace {

constexpr int kRowThreads = 512;    // kernel A block size (16 warps)
constexpr int kMaxCanvas = 1024;    // kernel B sorts one row of at most this many positions in a block
constexpr float kGumbelBound = 17.0f;  // > the largest Gumbel value, 16.6355 (u = 1 - 2**-24)
constexpr float kMaskedLogit = -1e30f;  // reference.masked_logit(torch.float32)

// ---- vector loads and stores -------------------------------------------------------------------------

// Load N consecutive logits starting at element `i` and widen them to fp32 (exact for bf16).
template <typename T, int N>
__device__ __forceinline__ void load_chunk(const T* __restrict__ row, int i, float (&x)[N]) {
  if constexpr (sizeof(T) == 4 && N == 4) {
    const float4 v = *reinterpret_cast<const float4*>(row + i);
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
  } else if constexpr (sizeof(T) == 2 && N == 8) {
    const uint4 v = *reinterpret_cast<const uint4*>(row + i);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(h[j]);
      x[2 * j] = f.x;
      x[2 * j + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if constexpr (sizeof(T) == 4) {
        x[j] = row[i + j];
      } else {
        x[j] = __bfloat162float(row[i + j]);
      }
    }
  }
}

// Store N probabilities as bf16 with streaming stores (nothing reads them again in this step).
template <int N>
__device__ __forceinline__ void store_probs(__nv_bfloat16* __restrict__ row, int i, const float (&p)[N]) {
  if constexpr (N == 8 || N == 4) {
    using Packed = typename std::conditional<N == 8, uint4, uint2>::type;
    Packed packed;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
    for (int j = 0; j < N / 2; ++j) h[j] = __floats2bfloat162_rn(p[2 * j], p[2 * j + 1]);
    __stcs(reinterpret_cast<Packed*>(row + i), packed);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) row[i + j] = __float2bfloat16_rn(p[j]);
  }
}

// ---- kernel A: one (row, position) ---------------------------------------------------------------------

// Per-thread partial state; the merge is associative up to rounding (softmax sums) and exact (argmaxes).
struct RowState {
  float m;     // running max of z (also the argmax value)
  float s;     // sum exp(z - m)
  float t;     // sum exp(z - m) * (z - m), <= 0
  int amax;    // lowest index holding m
  float best;  // max of z + g
  int bidx;    // lowest index holding best
  int nan_at;  // lowest index whose z is NaN (a broken checkpoint's logits), INT32_MAX if none
  int ninf;    // 1 where some z is -inf: the oracle's entropy then holds 0 * log 0 = NaN
  float c;     // sum exp(bf16(z) - bf16(m)): the self-conditioning softmax's denominator (see `sc_logit`); every
               // term <= 1, as rounding to bf16 is monotone (bf16(z) <= bf16(m)), and bf16(m) is torch's max
};

// z as the self-conditioning softmax reads it: rounded to bf16, the dtype transformers keeps the scaled logits
// in between steps (`processed_logits.to(embeddings_dtype)`), then softmaxed in fp32 by the decoder.
__device__ __forceinline__ float sc_logit(float z) { return __bfloat162float(__float2bfloat16_rn(z)); }

// The state of no token yet: what every thread starts from, and what pads the last warp's merge.
__device__ __forceinline__ RowState empty_row_state() {
  return RowState{-INFINITY, 0.0f, 0.0f, INT32_MAX, -INFINITY, INT32_MAX, INT32_MAX, 0, 0.0f};
}

__device__ __forceinline__ bool beats(float v2, int i2, float v1, int i1) {
  return v2 > v1 || (v2 == v1 && i2 < i1);
}

__device__ __forceinline__ void merge(RowState& a, const RowState& b) {
  // softmax statistics: rescale the side with the smaller max
  RowState hi = a, lo = b;
  if (beats(b.m, b.amax, a.m, a.amax)) {
    hi = b;
    lo = a;
  }
  float s = hi.s, t = hi.t, c = hi.c;
  if (lo.s > 0.0f) {  // lo is empty (m = -inf) when s == 0
    const float d = lo.m - hi.m;  // <= 0
    const float e = expf(d);
    // e == 0: lo's terms are all exactly 0, as the reference's are; d * lo.s may be -inf there (masked
    // tokens at -1e30 / T, many of them), and 0 * -inf would make the entropy NaN
    if (e > 0.0f) {
      s += e * lo.s;
      t += e * (lo.t + d * lo.s);
    }
    c += expf(sc_logit(lo.m) - sc_logit(hi.m)) * lo.c;  // a weight <= 1: no inf, and lo.c is finite
  }
  a.m = hi.m;
  a.amax = hi.amax;
  a.s = s;
  a.t = t;
  a.c = c;
  if (beats(b.best, b.bidx, a.best, a.bidx)) {
    a.best = b.best;
    a.bidx = b.bidx;
  }
  a.nan_at = min(a.nan_at, b.nan_at);
  a.ninf |= b.ninf;
}

__device__ __forceinline__ RowState shfl_down(const RowState& x, int offset) {
  RowState y;
  y.m = __shfl_down_sync(0xFFFFFFFFu, x.m, offset);
  y.s = __shfl_down_sync(0xFFFFFFFFu, x.s, offset);
  y.t = __shfl_down_sync(0xFFFFFFFFu, x.t, offset);
  y.amax = __shfl_down_sync(0xFFFFFFFFu, x.amax, offset);
  y.best = __shfl_down_sync(0xFFFFFFFFu, x.best, offset);
  y.bidx = __shfl_down_sync(0xFFFFFFFFu, x.bidx, offset);
  y.nan_at = __shfl_down_sync(0xFFFFFFFFu, x.nan_at, offset);
  y.ninf = __shfl_down_sync(0xFFFFFFFFu, x.ninf, offset);
  y.c = __shfl_down_sync(0xFFFFFFFFu, x.c, offset);
  return y;
}

// Block-wide merge: warp shuffles, then one warp over the per-warp results. Result valid in thread 0.
__device__ __forceinline__ RowState block_merge(RowState x) {
  __shared__ RowState warp_state[kRowThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) merge(x, shfl_down(x, offset));
  if (lane == 0) warp_state[warp] = x;
  __syncthreads();
  if (warp == 0) {
    const int n_warps = blockDim.x >> 5;
    x = lane < n_warps ? warp_state[lane] : empty_row_state();
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) merge(x, shfl_down(x, offset));
  }
  return x;
}

template <typename T, int N>
__device__ __forceinline__ void rows_body(const T* __restrict__ logits, int length, int vocab,
                                          const float* __restrict__ temperature,
                                          const int64_t* __restrict__ seed,
                                          const int64_t* __restrict__ request,
                                          const int64_t* __restrict__ canvas,
                                          const int64_t* __restrict__ step, float* __restrict__ entropy,
                                          float* __restrict__ max_prob, int64_t* __restrict__ argmax,
                                          int64_t* __restrict__ sample, __nv_bfloat16* __restrict__ probs,
                                          const uint8_t* __restrict__ mask_table,
                                          const int64_t* __restrict__ mask_index) {
  const int64_t cell = blockIdx.x;  // row * length + position
  const int row = static_cast<int>(cell / length);
  const uint32_t position = static_cast<uint32_t>(cell % length);
  const T* __restrict__ x_row = logits + cell * vocab;
  const float temp = temperature[row];
  const uint32_t row_key = dg::key_hash(seed[row], request[row], canvas[row], step[row], dg::kStreamSample);
  const uint32_t pos_key = dg::position_bits(row_key, position);
  const int64_t mask_row = mask_index != nullptr ? mask_index[cell] : -1;
  const uint8_t* __restrict__ allowed = mask_row >= 0 ? mask_table + mask_row * vocab : nullptr;

  RowState st = empty_row_state();
  // Each thread walks its chunks in increasing index order, so strict '>' keeps the lowest index on ties.
  for (int i = threadIdx.x * N; i < vocab; i += blockDim.x * N) {
    float z[N];
    load_chunk<T, N>(x_row, i, z);
    if (allowed != nullptr) {
#pragma unroll
      for (int j = 0; j < N; ++j) z[j] = allowed[i + j] ? z[j] : kMaskedLogit;
    }
    float cm = -INFINITY;
    int ci = INT32_MAX;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      z[j] = __fdiv_rn(z[j], temp);
      if (isnan(z[j]) && st.nan_at == INT32_MAX) st.nan_at = i + j;  // chunks in increasing order: the lowest
      st.ninf |= z[j] == -INFINITY;
      if (z[j] > cm) {
        cm = z[j];
        ci = i + j;
      }
    }
    if (cm > st.m) {  // new running max: rescale s and t to it
      if (st.s > 0.0f) {
        const float d = st.m - cm;
        const float e = expf(d);
        st.t = e > 0.0f ? e * (st.t + d * st.s) : 0.0f;  // as in `merge`: no 0 * -inf
        st.s *= e;
        st.c *= expf(sc_logit(st.m) - sc_logit(cm));  // <= 1
      }
      st.m = cm;
      st.amax = ci;
    }
    // Chunk partials first: shorter sequential sums, smaller rounding error. With no finite z yet (m = -inf)
    // every z so far is -inf (probability 0) or NaN (answered below): -inf - -inf would make the sums NaN,
    // and a merge would then drop this thread's later finite terms with them.
    if (st.m > -INFINITY) {
      float ps = 0.0f, pt = 0.0f, pc = 0.0f;
      const float mb = sc_logit(st.m);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const float d = z[j] - st.m;
        const float e = expf(d);
        ps += e;
        pt += e > 0.0f ? e * d : 0.0f;
        if (probs != nullptr) pc += expf(sc_logit(z[j]) - mb);  // bf16(z) <= bf16(m): each term <= 1
      }
      st.s += ps;
      st.t += pt;
      st.c += pc;
    }
#pragma unroll
    for (int j = 0; j < N; ++j) {
      // Gumbel-max. z + g <= z + 16.64 for every g, so a token with z + 17 < best can neither win nor
      // tie: skipping its two logs is exact.
      const uint32_t r = dg::gumbel_bits(pos_key, static_cast<uint32_t>(i + j));
      if (__fadd_rn(z[j], kGumbelBound) >= st.best) {
        const float u = dg::gumbel_uniform_from_bits(r);
        const float g = -logf(-logf(u));
        const float v = __fadd_rn(z[j], g);
        if (v > st.best) {
          st.best = v;
          st.bidx = i + j;
        }
      }
    }
  }

  __shared__ float row_max, row_inv_sc;
  st = block_merge(st);
  if (threadIdx.x == 0) {
    // Non-finite logits get what torch's reductions answer. NaN: softmax and entropy NaN, argmax (and the
    // Gumbel argmax of z + g) the first NaN; comparisons skip NaN and a merge may drop a NaN sum, so say it.
    // -inf: probability 0, but the entropy NaN (0 * log 0). Every z -inf: softmax NaN, argmax index 0.
    const bool has_nan = st.nan_at != INT32_MAX;
    const float inv = has_nan || st.s == 0.0f ? NAN : 1.0f / st.s;
    entropy[cell] = has_nan || st.ninf ? NAN : logf(st.s) - st.t * inv;  // both terms >= 0: no cancellation
    max_prob[cell] = inv;
    argmax[cell] = has_nan ? st.nan_at : (st.amax == INT32_MAX ? 0 : st.amax);
    sample[cell] = has_nan ? st.nan_at : (st.bidx == INT32_MAX ? 0 : st.bidx);
    row_max = st.m;
    row_inv_sc = has_nan || st.c == 0.0f ? NAN : 1.0f / st.c;
  }
  if (probs == nullptr) return;
  __syncthreads();

  // Second pass: softmax(bf16(z)) in bf16, the next step's self-conditioning input (see `sc_logit`).
  const float m = sc_logit(row_max), inv = row_inv_sc;
  __nv_bfloat16* __restrict__ p_row = probs + cell * vocab;
  for (int i = threadIdx.x * N; i < vocab; i += blockDim.x * N) {
    float z[N];
    load_chunk<T, N>(x_row, i, z);
    if (allowed != nullptr) {
#pragma unroll
      for (int j = 0; j < N; ++j) z[j] = allowed[i + j] ? z[j] : kMaskedLogit;
    }
#pragma unroll
    for (int j = 0; j < N; ++j) z[j] = expf(sc_logit(__fdiv_rn(z[j], temp)) - m) * inv;
    store_probs<N>(p_row, i, z);
  }
}

}  // namespace

// Kernel A entry points with unmangled names (a TensorRT AOT plugin launches kernels by PTX name):
// fp32 / bf16 logits, vectorised (16-byte loads) or scalar (any vocabulary size or alignment).
#define DG_ROWS_PARAMS(T)                                                                              \
  const T* __restrict__ logits, int length, int vocab, const float* __restrict__ temperature,          \
      const int64_t* __restrict__ seed, const int64_t* __restrict__ request,                           \
      const int64_t* __restrict__ canvas, const int64_t* __restrict__ step, float* __restrict__ entropy, \
      float* __restrict__ max_prob, int64_t* __restrict__ argmax, int64_t* __restrict__ sample,        \
      __nv_bfloat16* __restrict__ probs, const uint8_t* __restrict__ mask_table,                       \
      const int64_t* __restrict__ mask_index
#define DG_ROWS_ARGS                                                                                  \
  logits, length, vocab, temperature, seed, request, canvas, step, entropy, max_prob, argmax, sample, probs, \
      mask_table, mask_index

extern "C" __global__ void __launch_bounds__(kRowThreads) dg_rows_f32x4(DG_ROWS_PARAMS(float)) {
  rows_body<float, 4>(DG_ROWS_ARGS);
}
extern "C" __global__ void __launch_bounds__(kRowThreads) dg_rows_f32x1(DG_ROWS_PARAMS(float)) {
  rows_body<float, 1>(DG_ROWS_ARGS);
}
extern "C" __global__ void __launch_bounds__(kRowThreads) dg_rows_bf16x8(DG_ROWS_PARAMS(__nv_bfloat16)) {
  rows_body<__nv_bfloat16, 8>(DG_ROWS_ARGS);
}
extern "C" __global__ void __launch_bounds__(kRowThreads) dg_rows_bf16x1(DG_ROWS_PARAMS(__nv_bfloat16)) {
  rows_body<__nv_bfloat16, 1>(DG_ROWS_ARGS);
}

namespace {

// ---- kernel B: one row -----------------------------------------------------------------------------------

// Inclusive block scan in double (blockDim.x <= 1024): warp shuffles, then a scan of the warp totals.
__device__ __forceinline__ double block_inclusive_scan(double v, double* warp_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const double up = __shfl_up_sync(0xFFFFFFFFu, v, offset);
    if (lane >= offset) v += up;
  }
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int n_warps = blockDim.x >> 5;
    double w = lane < n_warps ? warp_sums[lane] : 0.0;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const double up = __shfl_up_sync(0xFFFFFFFFu, w, offset);
      if (lane >= offset) w += up;
    }
    if (lane < n_warps) warp_sums[lane] = w;
  }
  __syncthreads();
  return warp > 0 ? v + warp_sums[warp - 1] : v;
}

}  // namespace

namespace {

// Kernel B body: one block per row (blockDim.x = a power of two >= length).
__device__ __forceinline__ void accept_body(int length, int vocab, const float* __restrict__ entropy_in,
                     const int64_t* __restrict__ argmax_in, const int64_t* __restrict__ sample,
                     const int64_t* __restrict__ templ, const float* __restrict__ bound,
                     const int64_t* __restrict__ seed, const int64_t* __restrict__ request,
                     const int64_t* __restrict__ canvas_idx, const int64_t* __restrict__ step,
                     const int64_t* __restrict__ prev_argmax, const int64_t* __restrict__ stable_in,
                     const int64_t* __restrict__ stability_threshold,
                     const float* __restrict__ confidence_threshold, float* __restrict__ entropy_out,
                     uint8_t* __restrict__ kept, int64_t* __restrict__ canvas_out,
                     int64_t* __restrict__ argmax_out, int64_t* __restrict__ stable_out,
                     uint8_t* __restrict__ stop) {
  __shared__ float key[kMaxCanvas];
  __shared__ int index[kMaxCanvas];
  __shared__ uint8_t keep[kMaxCanvas];
  __shared__ double warp_sums[32];
  __shared__ double total;

  const int row = blockIdx.x, tid = threadIdx.x, n = blockDim.x;  // n: power of two >= length
  const bool active = tid < length;
  const int64_t at = static_cast<int64_t>(row) * length + tid;

  // Read everything this thread needs before any write: outputs may alias inputs (in-place use).
  int64_t tpl = -1, amax = 0, cand = 0;
  float h = dg::padding_key();  // sorts after every real position
  if (active) {
    tpl = templ != nullptr ? templ[at] : -1;
    amax = argmax_in[at];
    cand = sample[at];
    h = tpl >= 0 ? 0.0f : entropy_in[at];  // pinned cells cost nothing from the budget
  }
  key[tid] = h;
  index[tid] = tid;
  __syncthreads();

  // Bitonic sort of (H, index) ascending, NaN last (dg::sorts_after); the index tie-break makes it stable.
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      const int other = tid ^ j;
      if (other > tid) {
        const float ka = key[tid], kb = key[other];
        const int ia = index[tid], ib = index[other];
        if (dg::sorts_after(ka, ia, kb, ib) == ((tid & k) == 0)) {
          key[tid] = kb;
          key[other] = ka;
          index[tid] = ib;
          index[other] = ia;
        }
      }
      __syncthreads();
    }
  }

  // Keep rule on the sorted entropies: cumsum (double accumulation, fp32 result) - H <= bound.
  const float hs = active ? key[tid] : 0.0f;
  const double cum = block_inclusive_scan(static_cast<double>(hs), warp_sums);
  if (tid == n - 1) total = cum;
  if (active) keep[index[tid]] = __fsub_rn(static_cast<float>(cum), hs) <= bound[row];
  __syncthreads();

  const uint32_t renoise_key =
      dg::key_hash(seed[row], request[row], canvas_idx[row], step[row], dg::kStreamRenoise);
  bool same = true;
  if (active) {
    const bool pinned = tpl >= 0, kp = keep[tid];
    const int64_t noise =
        dg::uniform_token(renoise_key, static_cast<uint32_t>(tid), static_cast<uint32_t>(vocab));
    const int64_t a = pinned ? tpl : amax;
    same = a == prev_argmax[at];
    entropy_out[at] = h;
    kept[at] = kp;
    canvas_out[at] = pinned ? tpl : (kp ? cand : noise);
    argmax_out[at] = a;
  }
  const bool all_same = __syncthreads_and(same);
  if (tid == 0) {
    const int64_t count = all_same ? stable_in[row] + 1 : 0;
    // torch's entropy.mean(-1) sums in fp32, this in double (the keep rule's scan): the two means can differ
    // in their last bit, and `stop` with them where the threshold lies that close to the mean
    const float mean = __fdiv_rn(static_cast<float>(total), static_cast<float>(length));
    stable_out[row] = count;
    stop[row] = count >= stability_threshold[row] && mean < confidence_threshold[row];
  }
}

}  // namespace

#define DG_ACCEPT_ARGS                                                                                  \
  length, vocab, entropy_in, argmax_in, sample, templ, bound, seed, request, canvas_idx, step, prev_argmax, \
      stable_in, stability_threshold, confidence_threshold, entropy_out, kept, canvas_out, argmax_out,      \
      stable_out, stop

// Kernel B entry point (unmangled, like kernel A's).
extern "C" __global__ void __launch_bounds__(kMaxCanvas)
    dg_accept(int length, int vocab, const float* __restrict__ entropy_in, const int64_t* __restrict__ argmax_in,
              const int64_t* __restrict__ sample, const int64_t* __restrict__ templ,
              const float* __restrict__ bound, const int64_t* __restrict__ seed,
              const int64_t* __restrict__ request, const int64_t* __restrict__ canvas_idx,
              const int64_t* __restrict__ step, const int64_t* __restrict__ prev_argmax,
              const int64_t* __restrict__ stable_in, const int64_t* __restrict__ stability_threshold,
              const float* __restrict__ confidence_threshold, float* __restrict__ entropy_out,
              uint8_t* __restrict__ kept, int64_t* __restrict__ canvas_out, int64_t* __restrict__ argmax_out,
              int64_t* __restrict__ stable_out, uint8_t* __restrict__ stop) {
  accept_body(DG_ACCEPT_ARGS);
}

// ---- TensorRT AOT plugin entry points ---------------------------------------------------------------------
//
// A TensorRT ahead-of-time Python plugin (tensorrt.plugin.aot_impl, pipeline/engine/plugin.py) launches a
// kernel from PTX with the arguments in a fixed order: the input tensors' device pointers in node order, then
// the extra int32 scalars it returns (here length and vocab, resolved from the shapes at run time), then the
// output tensors' pointers. These thin wrappers take that order and run the same bodies as the kernels above,
// so the engine samples exactly what the PyTorch runtime's fused sampler does.

#define DG_TRT_ROWS(NAME, T, N)                                                                            \
  extern "C" __global__ void __launch_bounds__(kRowThreads)                                                \
      NAME(const T* __restrict__ logits, const float* __restrict__ temperature,                            \
           const int64_t* __restrict__ seed, const int64_t* __restrict__ request,                          \
           const int64_t* __restrict__ canvas, const int64_t* __restrict__ step, int length, int vocab,     \
           float* __restrict__ entropy, float* __restrict__ max_prob, int64_t* __restrict__ argmax,        \
           int64_t* __restrict__ sample, __nv_bfloat16* __restrict__ probs) {                              \
    const uint8_t* mask_table = nullptr; /* the engine masks in the graph's logits path, not here */      \
    const int64_t* mask_index = nullptr;                                                                   \
    rows_body<T, N>(DG_ROWS_ARGS);                                                                         \
  }
DG_TRT_ROWS(dg_trt_rows_f32x4, float, 4)
DG_TRT_ROWS(dg_trt_rows_f32x1, float, 1)
DG_TRT_ROWS(dg_trt_rows_bf16x8, __nv_bfloat16, 8)
DG_TRT_ROWS(dg_trt_rows_bf16x1, __nv_bfloat16, 1)

extern "C" __global__ void __launch_bounds__(kMaxCanvas)
    dg_trt_accept(const float* __restrict__ entropy_in, const int64_t* __restrict__ argmax_in,
                  const int64_t* __restrict__ sample, const int64_t* __restrict__ templ,
                  const float* __restrict__ bound, const int64_t* __restrict__ seed,
                  const int64_t* __restrict__ request, const int64_t* __restrict__ canvas_idx,
                  const int64_t* __restrict__ step, const int64_t* __restrict__ prev_argmax,
                  const int64_t* __restrict__ stable_in, const int64_t* __restrict__ stability_threshold,
                  const float* __restrict__ confidence_threshold, int length, int vocab,
                  float* __restrict__ entropy_out, uint8_t* __restrict__ kept, int64_t* __restrict__ canvas_out,
                  int64_t* __restrict__ argmax_out, int64_t* __restrict__ stable_out, uint8_t* __restrict__ stop) {
  accept_body(DG_ACCEPT_ARGS);
}

// ---- host launchers (everything above is device code: tests/_utils/cuda_emulation runs it on the CPU) ----

namespace {

int next_pow2(int x) {
  int p = 32;
  while (p < x) p <<= 1;
  return p;
}

template <typename T>
cudaError_t launch_rows(void (*kernel)(DG_ROWS_PARAMS(T)), const T* logits, int batch, int length, int vocab,
                        const float* temperature, const int64_t* seed, const int64_t* request,
                        const int64_t* canvas, const int64_t* step, float* entropy, float* max_prob,
                        int64_t* argmax, int64_t* sample, __nv_bfloat16* probs, const uint8_t* mask_table,
                        const int64_t* mask_index, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(static_cast<int64_t>(batch) * length);
  kernel<<<blocks, kRowThreads, 0, stream>>>(DG_ROWS_ARGS);
  return cudaGetLastError();
}

bool aligned16(const void* p) { return p == nullptr || (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

extern "C" {

// Kernel A for B rows of L positions: per-position entropy, max probability, argmax and Gumbel sample of
// z = logits / T(row); softmax(bf16(z)) in bf16 into `probs` ([B, L, V]) unless it is null: the bf16 model's
// self-conditioning input, as transformers computes it (the logits rounded to bf16 before the softmax). `logits_bf16`
// selects the input dtype (0: fp32, 1: bf16). Row keys (seed, request, canvas, step) are int64 arrays of
// length B. `mask_table` [M, V] bytes and `mask_index` [B, L] (-1 = free) restrict each position to its
// table row's tokens (constrained decoding); both null: no mask. Returns a cudaError_t.
int dg_sampler_rows(const void* logits, int logits_bf16, int batch, int length, int vocab,
                    const float* temperature, const int64_t* seed, const int64_t* request,
                    const int64_t* canvas, const int64_t* step, float* entropy, float* max_prob,
                    int64_t* argmax, int64_t* sample, void* probs, const uint8_t* mask_table,
                    const int64_t* mask_index, cudaStream_t stream) {
  if ((mask_table == nullptr) != (mask_index == nullptr)) return cudaErrorInvalidValue;
  if (batch < 0 || length <= 0 || vocab <= 0) return cudaErrorInvalidValue;
  if (batch == 0) return cudaSuccess;
  auto* p = static_cast<__nv_bfloat16*>(probs);
  if (logits_bf16) {
    const auto* x = static_cast<const __nv_bfloat16*>(logits);
    if (vocab % 8 == 0 && aligned16(x) && aligned16(p))
      return launch_rows(dg_rows_bf16x8, x, batch, length, vocab, temperature, seed, request, canvas, step,
                                           entropy, max_prob, argmax, sample, p, mask_table, mask_index, stream);
    return launch_rows(dg_rows_bf16x1, x, batch, length, vocab, temperature, seed, request, canvas, step,
                                         entropy, max_prob, argmax, sample, p, mask_table, mask_index, stream);
  }
  const auto* x = static_cast<const float*>(logits);
  if (vocab % 4 == 0 && aligned16(x) && (p == nullptr || (reinterpret_cast<uintptr_t>(p) & 7u) == 0))
    return launch_rows(dg_rows_f32x4, x, batch, length, vocab, temperature, seed, request, canvas, step, entropy,
                                 max_prob, argmax, sample, p, mask_table, mask_index, stream);
  return launch_rows(dg_rows_f32x1, x, batch, length, vocab, temperature, seed, request, canvas, step, entropy,
                               max_prob, argmax, sample, p, mask_table, mask_index, stream);
}

// Kernel B for B rows: entropy-bound acceptance, next canvas, argmax canvas (pinned where template >= 0;
// `templ` may be null), stability counter (stable_out = all(argmax == prev_argmax) ? stable_in + 1 : 0)
// and stop flag. Outputs may alias the matching inputs (entropy_out/entropy_in, argmax_out/argmax_in,
// stable_out/stable_in). `kept` and `stop` are bytes (torch.bool). Returns a cudaError_t.
int dg_sampler_accept(int batch, int length, int vocab, const float* entropy_in, const int64_t* argmax_in,
                      const int64_t* sample, const int64_t* templ, const float* bound, const int64_t* seed,
                      const int64_t* request, const int64_t* canvas, const int64_t* step,
                      const int64_t* prev_argmax, const int64_t* stable_in, const int64_t* stability_threshold,
                      const float* confidence_threshold, float* entropy_out, uint8_t* kept,
                      int64_t* canvas_out, int64_t* argmax_out, int64_t* stable_out, uint8_t* stop,
                      cudaStream_t stream) {
  if (batch < 0 || length <= 0 || length > kMaxCanvas || vocab <= 0) return cudaErrorInvalidValue;
  if (batch == 0) return cudaSuccess;
  dg_accept<<<batch, next_pow2(length), 0, stream>>>(
      length, vocab, entropy_in, argmax_in, sample, templ, bound, seed, request, canvas, step, prev_argmax,
      stable_in, stability_threshold, confidence_threshold, entropy_out, kept, canvas_out, argmax_out,
      stable_out, stop);
  return cudaGetLastError();
}

}  // extern "C"
