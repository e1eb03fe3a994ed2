// Routed experts of one DiffusionGemma decoder layer as ONE kernel launch: TensorRT AOT plugin
// dgpipe::MoEExperts* (pipeline/engine/moe_spec.py; oracle: pipeline/engine/kernels/moe_reference.py).
//
//   out[s, :] = w[s] * down[e] @ (gelu_tanh(gate[e] @ x[t]) * (up[e] @ x[t])),  s = t*K + k, e = index[s]
//
// One slot s = (token t, choice k) row of out [T*K, d] fp32 is written by exactly one block, so the launch
// needs no atomics, no zero-fill and no second kernel; the graph sums the K rows of a token in fp32 and
// casts once (ReduceSum + Cast after the plugin: pipeline/engine/moe_graph.py).
//
// Grouped GEMM over tokens sorted by expert: block (e, split) scans its split's slots of `index` in order
// (a ballot compaction: a stable counting sort of the slots by expert, done where they are consumed) and
// gathers those routed to expert e into tiles of `tile` tokens. Per tile it stages the tokens' rows in
// shared memory, computes h = gelu_tanh(gate) * up for all I intermediate columns (one warp per weight
// row, lanes along d: coalesced weight reads, each weight element reused `tile` times from registers), then
// the down projection (one warp per output column, lanes along I) scaled by the slot's routing weight.
// Weights bf16 / fp32 / FP8 E4M3 (per-expert scales), products and sums in fp32.
//
// Parameter order is TensorRT's AOT convention: input pointers, the extra int32 scalars, output pointers.
// Preconditions (checked by the plugin at build time, moe_spec.check_*): d, I >= 1; `tile` in
// [1, kMaxTile]; tile * (d * sizeof(TX) + I * 4) bytes of dynamic shared memory <= 48 KiB less the
// static s_slot and s_warp (moe_spec.SMEM_BUDGET).
// A slot whose expert index is outside [0, E) gets a zero row (block x = 0 writes it), never garbage.

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include <string.h>

namespace dg_moe {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTile = 16;

__host__ __device__ __forceinline__ float to_f(float v) { return v; }
__host__ __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__host__ __device__ __forceinline__ float to_f(__nv_fp8_e4m3 v) { return static_cast<float>(v); }

__device__ __forceinline__ float gelu_tanh(float v) {
  const float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * v * (1.f + tanhf(k0 * (v + 0.044715f * v * v * v)));
}

// E4M3 fake quantisation with a per-expert scale: float(e4m3_saturate(v / s)) * s
__device__ __forceinline__ float fake_fp8(float v, float s) {
  return static_cast<float>(__nv_fp8_e4m3(fminf(fmaxf(v / s, -448.f), 448.f))) * s;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

struct Scales {            // FP8 variants only (nullptr otherwise)
  const float* gate_up;    // [E, 2, d]: DequantizeLinear scale of gate_up (gate row 0, up row 1)
  const float* down;       // [E]
  const float* input;      // [3, E]: gate, up, down input scales (act_quant fp8)
};

// One tile: n <= tile slots (slot ids in s_slot) routed to expert e.
template <typename TX, typename TW>
__device__ void run_tile(const TX* __restrict__ x, const float* __restrict__ weight,
                         const TW* __restrict__ gate_up, const TW* __restrict__ down, Scales sc,
                         const int* s_slot, int n, int e, int k, int d, int inter, int experts,
                         TX* xs, float* hs, float* __restrict__ out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int t = 0; t < n; ++t) {
    const TX* row = x + static_cast<int64_t>(s_slot[t] / k) * d;
    for (int c = threadIdx.x; c < d; c += kThreads) xs[t * d + c] = row[c];
  }
  __syncthreads();
  const float sg_in = sc.input ? sc.input[e] : 0.f;
  const float su_in = sc.input ? sc.input[experts + e] : 0.f;
  const float sd_in = sc.input ? sc.input[2 * experts + e] : 0.f;
  // gate / up: warp per intermediate column r, lanes along d
  for (int r = warp; r < inter; r += kWarps) {
    const TW* wg = gate_up + (static_cast<int64_t>(e) * 2 * inter + r) * d;
    const TW* wu = wg + static_cast<int64_t>(inter) * d;
    float g[kMaxTile], u[kMaxTile];
#pragma unroll
    for (int t = 0; t < kMaxTile; ++t) g[t] = u[t] = 0.f;
    for (int c = lane; c < d; c += 32) {
      float a = to_f(wg[c]), b = to_f(wu[c]);
      if (sc.gate_up) {
        a *= sc.gate_up[(static_cast<int64_t>(e) * 2) * d + c];
        b *= sc.gate_up[(static_cast<int64_t>(e) * 2 + 1) * d + c];
      }
#pragma unroll
      for (int t = 0; t < kMaxTile; ++t) {
        if (t < n) {
          const float v = to_f(xs[t * d + c]);
          g[t] += a * (sc.input ? fake_fp8(v, sg_in) : v);
          u[t] += b * (sc.input ? fake_fp8(v, su_in) : v);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kMaxTile; ++t) {
      if (t < n) {
        const float gt = warp_sum(g[t]), ut = warp_sum(u[t]);
        if (lane == 0) {
          const float h = gelu_tanh(gt) * ut;
          hs[t * inter + r] = sc.input ? fake_fp8(h, sd_in) : h;
        }
      }
    }
  }
  __syncthreads();
  // down: warp per output column c, lanes along I; the slot's routing weight applied once
  const float s_down = sc.down ? sc.down[e] : 1.f;
  for (int c = warp; c < d; c += kWarps) {
    const TW* wd = down + (static_cast<int64_t>(e) * d + c) * inter;
    float acc[kMaxTile];
#pragma unroll
    for (int t = 0; t < kMaxTile; ++t) acc[t] = 0.f;
    for (int i = lane; i < inter; i += 32) {
      const float w = to_f(wd[i]);
#pragma unroll
      for (int t = 0; t < kMaxTile; ++t)
        if (t < n) acc[t] += w * hs[t * inter + i];
    }
#pragma unroll
    for (int t = 0; t < kMaxTile; ++t) {
      if (t < n) {
        const float v = warp_sum(acc[t]);
        if (lane == 0) {
          const int s = s_slot[t];
          out[static_cast<int64_t>(s) * d + c] = v * s_down * weight[s];
        }
      }
    }
  }
  __syncthreads();  // xs / hs / s_slot are reused by the next tile
}

// ---- weight formats: what a tile reads (moe_experts is the same grouped GEMM for all of them) ------------
template <typename TW>
struct DenseWeights {  // fp32 / bf16 / FP8 E4M3 weights, one element per lane per step
  const TW* gate_up;
  const TW* down;
  Scales sc;
};

template <typename TX, typename TW>
__device__ __forceinline__ void run_tile(const DenseWeights<TW>& w, const TX* x, const float* weight,
                                         const int* s_slot, int n, int e, int k, int d, int inter,
                                         int experts, TX* xs, float* hs, float* out) {
  run_tile<TX, TW>(x, weight, w.gate_up, w.down, w.sc, s_slot, n, e, k, d, inter, experts, xs, hs, out);
}

// NVFP4 experts exactly as the export's two-level DequantizeLinear stores them (pipeline/onnx/quant.py
// insert_routed_nvfp4; ModelOpt's NVFP4 layout): E2M1 codes two per byte, the even element in the low
// nibble; one E4M3 scale per 16 consecutive elements of a row; an fp32 global scale (gate_up: [E, 2, d/16],
// the DQ scale with axis 1, block I, so gate and up keep their own; down: [E]). A weight is
// e2m1 * (float(block_scale) * global) in fp32: the DQ chain's operations in its order, so the kernel
// multiplies by the very values the ONNX node sees. Read 8 codes (one 32-bit word) per lane per step: a warp
// reads 128 contiguous bytes = 256 weights, 4.5 bits per weight from HBM with the block scales.
template <bool kActQuant>  // NVFP4 activation fake quant: a compile-time choice (each kernel one path)
struct Fp4Weights {
  const uint32_t* gate_up;              // [E, 2I, d/8] words of 8 codes
  const __nv_fp8_e4m3* gate_up_block;   // [E, 2I, d/16]
  const float* gate_up_global;          // [E, 2, d/16]
  const uint32_t* down;                 // [E, d, I/8]
  const __nv_fp8_e4m3* down_block;      // [E, d, I/16]
  const float* down_global;             // [E]
  const float* input;                   // [3, E] NVFP4 activation global scales (kActQuant only)
};

constexpr int kBlock = 16;  // NVFP4 block: 16 consecutive elements along the input dim share a scale
constexpr int kChunk = 8;   // codes per 32-bit word: each lane's step

// The NVFP4 helpers are __host__ __device__ so tests/unit/engine/test_moe.py compiles them into a host
// program and checks them bit for bit against pipeline.model (fake_quant, modelopt) without a GPU.
__host__ __device__ __forceinline__ float bits_float(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
#endif
}

// E2M1 code -> float: sign bit 3, magnitude index 2..0 into {0, .5, 1, 1.5, 2, 3, 4, 6}
__host__ __device__ __forceinline__ float e2m1_value(uint32_t code) {
  const uint32_t m = code & 7u, ex = m >> 1, man = m & 1u;
  uint32_t bits = ex ? ((ex + 126u) << 23) | (man << 22) : (man ? 0x3F000000u : 0u);
  return bits_float(bits | ((code & 8u) << 28));
}

// index (0..7) of the nearest E2M1 magnitude of a >= 0, saturating at 6, ties to the even mantissa
// (pipeline.model.fake_quant e2m1_round: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)
__host__ __device__ __forceinline__ uint32_t e2m1_index(float a) {
  return (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.f);
}

// the dynamic E4M3 scale of one block of 16 activations (nvfp4_fake_quant, same operations and order):
// s = float(e4m3(min(amax / (6 * gs), 448))) * gs, gs = input scale (1e-12 where <= 0), 1.0 where s < 1e-5
__host__ __device__ __forceinline__ float nvfp4_block_scale(float amax, float gs) {
  gs = gs > 0.f ? gs : 1e-12f;
  const float s = static_cast<float>(__nv_fp8_e4m3(fminf(amax / (6.f * gs), 448.f))) * gs;
  return s >= 1e-5f ? s : 1.f;
}

template <typename T>
__host__ __device__ __forceinline__ float block_amax(const T* v) {  // one block of 16, as float
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < kBlock; ++j) amax = fmaxf(amax, fabsf(to_f(v[j])));
  return amax;
}

// the E2M1 code (sign bit 3) of v / s: nvfp4_fake_quant's value is e2m1_value(code) * s, bit for bit
__host__ __device__ __forceinline__ uint32_t e2m1_code(float v, float s) {
  return e2m1_index(fabsf(v) / s) | (v >= 0.f ? 0u : 8u);
}

__host__ __device__ __forceinline__ float fake_fp4(float v, float s) { return e2m1_value(e2m1_code(v, s)) * s; }

// 8 consecutive elements (16- or 32-byte aligned: d, I are multiples of 16) from shared memory
__host__ __device__ __forceinline__ void load8(const float* p, float v[kChunk]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__host__ __device__ __forceinline__ void load8(const __nv_bfloat16* p, float v[kChunk]) {
  const uint4 r = *reinterpret_cast<const uint4*>(p);
  const uint32_t words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // a bf16 is the high half of an fp32
    v[2 * i] = bits_float(words[i] << 16);
    v[2 * i + 1] = bits_float(words[i] & 0xFFFF0000u);
  }
}

// 8 dequantized weights: codes of one word times their block's scale (block_scale * global, fp32)
__host__ __device__ __forceinline__ void dequant8(uint32_t word, float scale, float v[kChunk]) {
#pragma unroll
  for (int j = 0; j < kChunk; ++j) v[j] = e2m1_value((word >> (4 * j)) & 0xFu) * scale;
}

// One tile with NVFP4 weights. Weight-only: the tile's rows of x staged in the model dtype, as the dense
// formats do. With NVFP4 activations the staging quantizes instead (once per tile, not once per weight row):
// the xs region then holds each row's E2M1 codes for gate and for up (their global scales differ) and the
// two fp32 block scales per 16 elements, 1.5 d bytes a row (xs has d * sizeof(TX) >= 2 d).
template <typename TX, bool kActQuant>
__device__ void run_tile(const Fp4Weights<kActQuant>& w, const TX* __restrict__ x, const float* __restrict__ weight,
                         const int* s_slot, int n, int e, int k, int d, int inter, int experts, TX* xs,
                         float* hs, float* __restrict__ out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int dblocks = d / kBlock, iblocks = inter / kBlock, d8 = d / kChunk;
  constexpr bool aq = kActQuant;
  uint32_t* xcode = reinterpret_cast<uint32_t*>(xs);  // aq: [2][n][d/8] words (gate codes, then up codes)
  float* xscale = reinterpret_cast<float*>(xcode + 2 * n * d8);  // aq: [n][d/16][2] (gate, up)
  if constexpr (!aq) {
    for (int t = 0; t < n; ++t) {
      const TX* row = x + static_cast<int64_t>(s_slot[t] / k) * d;
      for (int c = threadIdx.x; c < d; c += kThreads) xs[t * d + c] = row[c];
    }
  } else {  // one thread per (row, block of 16): its amax, gate's and up's block scales, 2 x 16 codes
    const float gs_g = w.input[e], gs_u = w.input[experts + e];
    for (int i = threadIdx.x; i < n * dblocks; i += kThreads) {
      const int t = i / dblocks, b = i % dblocks;
      const TX* v = x + static_cast<int64_t>(s_slot[t] / k) * d + b * kBlock;
      const float amax = block_amax(v);
      const float sg = nvfp4_block_scale(amax, gs_g), su = nvfp4_block_scale(amax, gs_u);
      xscale[2 * i] = sg;
      xscale[2 * i + 1] = su;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t cg = 0, cu = 0;
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
          const float f = to_f(v[h * kChunk + j]);
          cg |= e2m1_code(f, sg) << (4 * j);
          cu |= e2m1_code(f, su) << (4 * j);
        }
        xcode[t * d8 + 2 * b + h] = cg;
        xcode[(n + t) * d8 + 2 * b + h] = cu;
      }
    }
  }
  __syncthreads();
  // gate / up: warp per intermediate column r, lanes along d, 8 weights per lane per step
  for (int r = warp; r < inter; r += kWarps) {
    const int64_t grow = static_cast<int64_t>(e) * 2 * inter + r, urow = grow + inter;
    float g[kMaxTile], u[kMaxTile];
#pragma unroll
    for (int t = 0; t < kMaxTile; ++t) g[t] = u[t] = 0.f;
    for (int c0 = lane * kChunk; c0 < d; c0 += 32 * kChunk) {
      const int b = c0 / kBlock;
      const float sg = static_cast<float>(w.gate_up_block[grow * dblocks + b]) *
                       w.gate_up_global[(static_cast<int64_t>(e) * 2) * dblocks + b];
      const float su = static_cast<float>(w.gate_up_block[urow * dblocks + b]) *
                       w.gate_up_global[(static_cast<int64_t>(e) * 2 + 1) * dblocks + b];
      float a[kChunk], bu[kChunk];
      dequant8(w.gate_up[grow * d8 + c0 / kChunk], sg, a);
      dequant8(w.gate_up[urow * d8 + c0 / kChunk], su, bu);
#pragma unroll
      for (int t = 0; t < kMaxTile; ++t) {
        if (t < n) {
          float vg[kChunk], vu[kChunk];
          if constexpr (aq) {  // the fake-quantized inputs: code value * block scale
            dequant8(xcode[t * d8 + c0 / kChunk], xscale[2 * (t * dblocks + b)], vg);
            dequant8(xcode[(n + t) * d8 + c0 / kChunk], xscale[2 * (t * dblocks + b) + 1], vu);
          } else {
            load8(xs + t * d + c0, vg);
#pragma unroll
            for (int j = 0; j < kChunk; ++j) vu[j] = vg[j];
          }
#pragma unroll
          for (int j = 0; j < kChunk; ++j) {
            g[t] += a[j] * vg[j];
            u[t] += bu[j] * vu[j];
          }
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kMaxTile; ++t) {
      if (t < n) {
        const float gt = warp_sum(g[t]), ut = warp_sum(u[t]);
        if (lane == 0) hs[t * inter + r] = gelu_tanh(gt) * ut;
      }
    }
  }
  __syncthreads();
  if constexpr (aq) {  // the GELU products fake-quantized in place, per block of 16 along I, down's global scale
    const float gs_d = w.input[2 * experts + e];
    for (int i = threadIdx.x; i < n * iblocks; i += kThreads) {
      float* v = hs + (i / iblocks) * inter + (i % iblocks) * kBlock;
      const float s = nvfp4_block_scale(block_amax(v), gs_d);
#pragma unroll
      for (int j = 0; j < kBlock; ++j) v[j] = fake_fp4(v[j], s);
    }
    __syncthreads();
  }
  // down: warp per output column c, lanes along I, 8 weights per lane per step; the routing weight once
  const int64_t i8 = inter / kChunk;
  const float gd = w.down_global[e];
  for (int c = warp; c < d; c += kWarps) {
    const int64_t drow = static_cast<int64_t>(e) * d + c;
    float acc[kMaxTile];
#pragma unroll
    for (int t = 0; t < kMaxTile; ++t) acc[t] = 0.f;
    for (int i0 = lane * kChunk; i0 < inter; i0 += 32 * kChunk) {
      float wd[kChunk];
      dequant8(w.down[drow * i8 + i0 / kChunk],
               static_cast<float>(w.down_block[drow * iblocks + i0 / kBlock]) * gd, wd);
#pragma unroll
      for (int t = 0; t < kMaxTile; ++t) {
        if (t < n) {
          float h[kChunk];
          load8(hs + t * inter + i0, h);
#pragma unroll
          for (int j = 0; j < kChunk; ++j) acc[t] += wd[j] * h[j];
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kMaxTile; ++t) {
      if (t < n) {
        const float v = warp_sum(acc[t]);
        if (lane == 0) {
          const int s = s_slot[t];
          out[static_cast<int64_t>(s) * d + c] = v * weight[s];
        }
      }
    }
  }
  __syncthreads();  // xs / hs / s_slot are reused by the next tile
}

template <typename TX, typename W>
__device__ void moe_experts(const TX* __restrict__ x, const int64_t* __restrict__ index,
                            const float* __restrict__ weight, const W& wt, int tokens, int k, int d,
                            int inter, int experts, int tile, float* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem[];
  float* hs = reinterpret_cast<float*>(smem);                                     // [tile][I] fp32
  TX* xs = reinterpret_cast<TX*>(smem + sizeof(float) * static_cast<size_t>(tile) * inter);  // [tile][d]
  __shared__ int s_slot[kThreads + kMaxTile];
  __shared__ int s_warp[kWarps];
  const int e = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // this block's split: a contiguous token range, so the scan covers T*K / gridDim.y slots
  const int per_split = (tokens + gridDim.y - 1) / gridDim.y;
  const int lo = min(tokens, static_cast<int>(blockIdx.y) * per_split) * k;
  const int hi = min(tokens, static_cast<int>(blockIdx.y + 1) * per_split) * k;
  int pending = 0;  // block-uniform: slots gathered, not yet computed
  for (int base = lo; base < hi; base += kThreads) {
    const int s = base + threadIdx.x;
    const int64_t ex = s < hi ? index[s] : -1;
    if (e == 0 && s < hi && (ex < 0 || ex >= experts)) {  // invalid expert: a defined (zero) row
      for (int c = 0; c < d; ++c) out[static_cast<int64_t>(s) * d + c] = 0.f;
    }
    const bool hit = ex == e;
    const unsigned mask = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) s_warp[warp] = __popc(mask);
    __syncthreads();
    int before = 0, chunk = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int c = s_warp[w];
      before += w < warp ? c : 0;
      chunk += c;
    }
    if (hit) s_slot[pending + before + __popc(mask & ((1u << lane) - 1u))] = s;  // slot order kept
    pending += chunk;
    __syncthreads();
    while (pending >= tile) {
      run_tile(wt, x, weight, s_slot, tile, e, k, d, inter, experts, xs, hs, out);
      const int rest = pending - tile;  // < kThreads: one element per thread to move
      const int moved = threadIdx.x < rest ? s_slot[tile + threadIdx.x] : 0;
      __syncthreads();
      if (threadIdx.x < rest) s_slot[threadIdx.x] = moved;
      __syncthreads();
      pending = rest;
    }
  }
  if (pending > 0)
    run_tile(wt, x, weight, s_slot, pending, e, k, d, inter, experts, xs, hs, out);
}

}  // namespace dg_moe

// ---- TensorRT AOT entry points: inputs, int32 extras (T, K, d, I, E, tile), outputs ----------------------
#ifndef DG_MOE_HELPERS_ONLY  // defined by the host test program, which needs the helpers above only
#define DG_MOE_EXTRAS int tokens, int k, int d, int inter, int experts, int tile
#define DG_MOE_DENSE(TW, gate_up, down, s_gu, s_dn, s_in) \
  dg_moe::DenseWeights<TW> { gate_up, down, {s_gu, s_dn, s_in} }

extern "C" __global__ void __launch_bounds__(dg_moe::kThreads)
dg_trt_moe_f32(const float* x, const int64_t* index, const float* weight, const float* gate_up,
               const float* down, DG_MOE_EXTRAS, float* out) {
  dg_moe::moe_experts(x, index, weight, DG_MOE_DENSE(float, gate_up, down, nullptr, nullptr, nullptr),
                      tokens, k, d, inter, experts, tile, out);
}

extern "C" __global__ void __launch_bounds__(dg_moe::kThreads)
dg_trt_moe_bf16(const __nv_bfloat16* x, const int64_t* index, const float* weight,
                const __nv_bfloat16* gate_up, const __nv_bfloat16* down, DG_MOE_EXTRAS, float* out) {
  dg_moe::moe_experts(x, index, weight,
                      DG_MOE_DENSE(__nv_bfloat16, gate_up, down, nullptr, nullptr, nullptr), tokens, k, d,
                      inter, experts, tile, out);
}

// FP8 E4M3 weights (ModelOpt FP8: per-expert weight scales), bf16 activations
extern "C" __global__ void __launch_bounds__(dg_moe::kThreads)
dg_trt_moe_bf16_w8(const __nv_bfloat16* x, const int64_t* index, const float* weight,
                   const __nv_fp8_e4m3* gate_up, const float* gate_up_scale, const __nv_fp8_e4m3* down,
                   const float* down_scale, DG_MOE_EXTRAS, float* out) {
  dg_moe::moe_experts(x, index, weight,
                      DG_MOE_DENSE(__nv_fp8_e4m3, gate_up, down, gate_up_scale, down_scale, nullptr),
                      tokens, k, d, inter, experts, tile, out);
}

// FP8 weights and FP8 fake-quantised expert inputs (act_quant = fp8, input_scale [3, E])
extern "C" __global__ void __launch_bounds__(dg_moe::kThreads)
dg_trt_moe_bf16_w8a8(const __nv_bfloat16* x, const int64_t* index, const float* weight,
                     const __nv_fp8_e4m3* gate_up, const float* gate_up_scale, const __nv_fp8_e4m3* down,
                     const float* down_scale, const float* input_scale, DG_MOE_EXTRAS, float* out) {
  dg_moe::moe_experts(x, index, weight,
                      DG_MOE_DENSE(__nv_fp8_e4m3, gate_up, down, gate_up_scale, down_scale, input_scale),
                      tokens, k, d, inter, experts, tile, out);
}

// NVFP4 weights (ModelOpt NVFP4: packed E2M1 codes, E4M3 block scales, fp32 global scales), bf16 activations
extern "C" __global__ void __launch_bounds__(dg_moe::kThreads)
dg_trt_moe_bf16_w4(const __nv_bfloat16* x, const int64_t* index, const float* weight, const uint32_t* gate_up,
                   const __nv_fp8_e4m3* gate_up_block_scale, const float* gate_up_scale, const uint32_t* down,
                   const __nv_fp8_e4m3* down_block_scale, const float* down_scale, DG_MOE_EXTRAS, float* out) {
  dg_moe::moe_experts(x, index, weight,
                      dg_moe::Fp4Weights<false>{gate_up, gate_up_block_scale, gate_up_scale, down,
                                                down_block_scale, down_scale, nullptr},
                      tokens, k, d, inter, experts, tile, out);
}

// NVFP4 weights and NVFP4 fake-quantised expert inputs (act_quant = nvfp4, input_scale [3, E]: global scales)
extern "C" __global__ void __launch_bounds__(dg_moe::kThreads)
dg_trt_moe_bf16_w4a4(const __nv_bfloat16* x, const int64_t* index, const float* weight,
                     const uint32_t* gate_up, const __nv_fp8_e4m3* gate_up_block_scale,
                     const float* gate_up_scale, const uint32_t* down, const __nv_fp8_e4m3* down_block_scale,
                     const float* down_scale, const float* input_scale, DG_MOE_EXTRAS, float* out) {
  dg_moe::moe_experts(x, index, weight,
                      dg_moe::Fp4Weights<true>{gate_up, gate_up_block_scale, gate_up_scale, down,
                                               down_block_scale, down_scale, input_scale},
                      tokens, k, d, inter, experts, tile, out);
}
#endif  // DG_MOE_HELPERS_ONLY
