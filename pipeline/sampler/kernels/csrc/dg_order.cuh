// The order kernel B sorts a row's entropies in, shared with host code so that a test
// (tests/unit/sampler/test_kernels_build.py) can run kernel B's sorting network on the CPU against torch.sort.
#pragma once

#include <math.h>

#include "dg_rng.cuh"  // DG_HD

namespace dg {

// Whether (ka, ia) sorts after (kb, ib): ascending by key with NaN after every number, as torch.sort puts it,
// and equal keys (NaN with NaN) by index, which makes the sort stable. A plain `ka > kb` is false both ways
// for a NaN, so a sorting network leaves NaN rows in no defined order (and may move a real position past the
// row's end, where nothing reads it back).
DG_HD bool sorts_after(float ka, int ia, float kb, int ib) {
  const bool a_nan = isnan(ka), b_nan = isnan(kb);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && ka != kb) return ka > kb;
  return ia > ib;
}

// What pads a row to the network's power of two: it sorts after every number, and after every real NaN by its
// index (>= the row's length), so the row's positions fill the first `length` places.
DG_HD float padding_key() { return NAN; }

}  // namespace dg
