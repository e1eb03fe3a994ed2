// Host emulation of the CUDA execution model for dg_sampler.cu: each thread of a block is a std::thread,
// __syncthreads a std::barrier over the block, warp shuffles an exchange through a per-warp buffer between two
// warp barriers (CUDA semantics: a source lane outside [0, 32) returns the caller's own value).
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <climits>
#include <functional>
#include <memory>
#include <thread>
#include <vector>
#include <algorithm>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static

struct dim3_ { unsigned x = 0, y = 0, z = 0; };
inline thread_local dim3_ threadIdx;
inline dim3_ blockIdx, blockDim;

struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
typedef int cudaError_t;
typedef void* cudaStream_t;

using std::isnan;
inline int min(int a, int b) { return a < b ? a : b; }

inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
template <class P> inline void __stcs(P* p, P v) { *p = v; }

namespace emu {
inline std::unique_ptr<std::barrier<>> block_bar;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_bar;
inline uint64_t xbuf[32][32];
inline std::atomic<int> and_acc{1};
}  // namespace emu

inline void __syncthreads() { emu::block_bar->arrive_and_wait(); }
inline int __syncthreads_and(int p) {
  if (threadIdx.x == 0) emu::and_acc.store(1);
  emu::block_bar->arrive_and_wait();
  if (!p) emu::and_acc.store(0);
  emu::block_bar->arrive_and_wait();
  const int r = emu::and_acc.load();
  emu::block_bar->arrive_and_wait();
  return r;
}

template <class T> inline T emu_shfl(unsigned mask, T v, int src_rel, bool down) {
  static_assert(sizeof(T) <= 8);
  if (mask != 0xFFFFFFFFu) std::abort();
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  std::memcpy(&emu::xbuf[w][l], &v, sizeof(T));
  emu::warp_bar[w]->arrive_and_wait();
  int src = down ? l + src_rel : l - src_rel;
  if (src < 0 || src > 31) src = l;
  T r;
  std::memcpy(&r, &emu::xbuf[w][src], sizeof(T));
  emu::warp_bar[w]->arrive_and_wait();
  return r;
}
template <class T> inline T __shfl_down_sync(unsigned m, T v, int o) { return emu_shfl(m, v, o, true); }
template <class T> inline T __shfl_up_sync(unsigned m, T v, int o) { return emu_shfl(m, v, o, false); }

// Run `body` for each block of `grid`, `block` threads (a multiple of 32), blocks one after another.
inline void emu_launch(unsigned grid, unsigned block, const std::function<void()>& body) {
  if (block % 32) std::abort();
  blockDim.x = block;
  emu::block_bar = std::make_unique<std::barrier<>>(block);
  emu::warp_bar.clear();
  for (unsigned w = 0; w < block / 32; ++w) emu::warp_bar.push_back(std::make_unique<std::barrier<>>(32));
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < block; ++t) {
    threads.emplace_back([t, grid, &body] {
      threadIdx.x = t;
      for (unsigned b = 0; b < grid; ++b) {
        if (t == 0) blockIdx.x = b;
        emu::block_bar->arrive_and_wait();  // blockIdx set; the previous block done with shared memory
        body();
        emu::block_bar->arrive_and_wait();
      }
    });
  }
  for (auto& th : threads) th.join();
}
