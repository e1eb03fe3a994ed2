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
// [1, kMaxTile]; tile * (d * sizeof(TX) + I * 4) bytes of dynamic shared memory <= 48 KiB.
// A slot whose expert index is outside [0, E) gets a zero row (block x = 0 writes it), never garbage.

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace dg_moe {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTile = 16;

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__nv_fp8_e4m3 v) { return static_cast<float>(v); }

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

template <typename TX, typename TW>
__device__ void moe_experts(const TX* __restrict__ x, const int64_t* __restrict__ index,
                            const float* __restrict__ weight, const TW* __restrict__ gate_up,
                            const TW* __restrict__ down, Scales sc, int tokens, int k, int d, int inter,
                            int experts, int tile, float* __restrict__ out) {
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
      run_tile<TX, TW>(x, weight, gate_up, down, sc, s_slot, tile, e, k, d, inter, experts, xs, hs, out);
      const int rest = pending - tile;  // < kThreads: one element per thread to move
      const int moved = threadIdx.x < rest ? s_slot[tile + threadIdx.x] : 0;
      __syncthreads();
      if (threadIdx.x < rest) s_slot[threadIdx.x] = moved;
      __syncthreads();
      pending = rest;
    }
  }
  if (pending > 0)
    run_tile<TX, TW>(x, weight, gate_up, down, sc, s_slot, pending, e, k, d, inter, experts, xs, hs, out);
}

}  // namespace dg_moe

// ---- TensorRT AOT entry points: inputs, int32 extras (T, K, d, I, E, tile), outputs ----------------------
#define DG_MOE_EXTRAS int tokens, int k, int d, int inter, int experts, int tile

extern "C" __global__ void __launch_bounds__(dg_moe::kThreads)
dg_trt_moe_f32(const float* x, const int64_t* index, const float* weight, const float* gate_up,
               const float* down, DG_MOE_EXTRAS, float* out) {
  dg_moe::moe_experts<float, float>(x, index, weight, gate_up, down, {nullptr, nullptr, nullptr}, tokens,
                                    k, d, inter, experts, tile, out);
}

extern "C" __global__ void __launch_bounds__(dg_moe::kThreads)
dg_trt_moe_bf16(const __nv_bfloat16* x, const int64_t* index, const float* weight,
                const __nv_bfloat16* gate_up, const __nv_bfloat16* down, DG_MOE_EXTRAS, float* out) {
  dg_moe::moe_experts<__nv_bfloat16, __nv_bfloat16>(x, index, weight, gate_up, down,
                                                    {nullptr, nullptr, nullptr}, tokens, k, d, inter,
                                                    experts, tile, out);
}

// FP8 E4M3 weights (ModelOpt FP8: per-expert weight scales), bf16 activations
extern "C" __global__ void __launch_bounds__(dg_moe::kThreads)
dg_trt_moe_bf16_w8(const __nv_bfloat16* x, const int64_t* index, const float* weight,
                   const __nv_fp8_e4m3* gate_up, const float* gate_up_scale, const __nv_fp8_e4m3* down,
                   const float* down_scale, DG_MOE_EXTRAS, float* out) {
  dg_moe::moe_experts<__nv_bfloat16, __nv_fp8_e4m3>(x, index, weight, gate_up, down,
                                                    {gate_up_scale, down_scale, nullptr}, tokens, k, d,
                                                    inter, experts, tile, out);
}

// FP8 weights and FP8 fake-quantised expert inputs (act_quant = fp8, input_scale [3, E])
extern "C" __global__ void __launch_bounds__(dg_moe::kThreads)
dg_trt_moe_bf16_w8a8(const __nv_bfloat16* x, const int64_t* index, const float* weight,
                     const __nv_fp8_e4m3* gate_up, const float* gate_up_scale, const __nv_fp8_e4m3* down,
                     const float* down_scale, const float* input_scale, DG_MOE_EXTRAS, float* out) {
  dg_moe::moe_experts<__nv_bfloat16, __nv_fp8_e4m3>(x, index, weight, gate_up, down,
                                                    {gate_up_scale, down_scale, input_scale}, tokens, k,
                                                    d, inter, experts, tile, out);
}
