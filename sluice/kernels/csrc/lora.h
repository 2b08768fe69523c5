// LoRA adapters beside a linear layer, many adapters in one batch: each row of the
// step's activations names its adapter's slot (or -1: the base model alone). The base
// matmul runs once over every row; these two kernels add each row's low-rank product,
// gathering its adapter's matrices by the row's slot (the segmented "shrink" and
// "expand" of Punica and S-LoRA).
//
// One layer's slots: A [slots, slices * rank, in] (a fused layer, q/k/v or gate/up,
// has one A per slice) and B^T [slots, rank, out], whose column range of slice j
// multiplies u's columns j * rank .. (j + 1) * rank. Storing B transposed makes the
// expand an axpy over the output row. Portable C++ with lane arrays that each level's
// flags vectorize (the loops are short: a rank of 8-64).
//
// Both share their rows out with an orphaned `omp for`: the C entry points open a
// parallel region around them, the decode stack calls them from every thread of its
// own. The shrink's loop has no barrier (`nowait`): its caller joins before reading u
// (the end of the entry point's region; in the decode stack, the barrier closing the
// base matmul it runs beside). The expand's ends with one.
#pragma once
#include <algorithm>
#include <cstdint>

#include "dtype.h"
#include "isa.h"

namespace sluice {

// u[t, :] = A[slot(t)] x[t] in fp32 (zeros for rows without an adapter). ranks[s]:
// the rows of each slice that slot s uses (its adapter's rank, 0 where it adapts
// nothing here); the padding beyond is zero and never read. No barrier at the end.
template <typename T>
void lora_shrink(const T* x, int64_t rows, int in_dim, const T* a, int r_total, int rank,
                 const int32_t* slots, const int32_t* ranks, float* u) {
  constexpr int kLanes = 16;  // partial sums, added in a fixed order at the end
  const int64_t items = rows * r_total;
#pragma omp for schedule(static) nowait
  for (int64_t i = 0; i < items; ++i) {
    const int64_t t = i / r_total;
    const int r = static_cast<int>(i % r_total);
    const int32_t s = slots[t];
    if (s < 0 || r % rank >= ranks[s]) {
      u[i] = 0.f;
      continue;
    }
    const T* xr = x + t * in_dim;
    const T* ar = a + (static_cast<int64_t>(s) * r_total + r) * in_dim;
    float acc[kLanes] = {};
    int h = 0;
    for (; h + kLanes <= in_dim; h += kLanes)
      for (int j = 0; j < kLanes; ++j) acc[j] += to_float(xr[h + j]) * to_float(ar[h + j]);
    for (; h < in_dim; ++h) acc[h % kLanes] += to_float(xr[h]) * to_float(ar[h]);
    float sum = 0.f;
    for (int j = 0; j < kLanes; ++j) sum += acc[j];
    u[i] = sum;
  }
}

// delta[0, n) = sum over r < rank of u[r] * b[r * out_dim + c], in rank order. N: n as a
// constant where the tile is whole, so the sums stay in registers.
template <int N, typename T>
inline void lora_tile(const float* u, const T* b, int out_dim, int rank, int n, float* delta) {
  const int cols = N > 0 ? N : n;
  for (int c = 0; c < cols; ++c) delta[c] = 0.f;
  for (int r = 0; r < rank; ++r) {
    const float w = u[r];
    const T* br = b + static_cast<int64_t>(r) * out_dim;
    for (int c = 0; c < cols; ++c) delta[c] += w * to_float(br[c]);
  }
}

// y[t, :] += B[slot(t)] u[t, :] over every slice: the product summed in fp32 from zero
// (as PEFT adds the adapter's output to the base's), then added to y and rounded once
// to y's type. A work item is a tile of kTile columns within a slice, summed in
// registers while it reads its slot's rank rows of B^T there.
template <typename T>
void lora_expand(const float* u, int64_t rows, int rank, int n_slices, const int32_t* offsets,
                 const T* bt, int out_dim, const int32_t* slots, const int32_t* ranks, T* y) {
  constexpr int kTile = 64;
  int64_t tiles = 0;  // per row, over the slices
  for (int j = 0; j < n_slices; ++j) tiles += (offsets[j + 1] - offsets[j] + kTile - 1) / kTile;
  const int64_t items = rows * tiles;
  const int r_total = n_slices * rank;
#pragma omp for schedule(static)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t t = i / tiles;
    const int32_t s = slots[t];
    const int rank_s = s < 0 ? 0 : ranks[s];
    if (rank_s == 0) continue;
    int j = 0, k = static_cast<int>(i % tiles);
    for (;; ++j) {  // the tile's slice
      const int in_slice = (offsets[j + 1] - offsets[j] + kTile - 1) / kTile;
      if (k < in_slice) break;
      k -= in_slice;
    }
    const int begin = offsets[j] + k * kTile, n = std::min(kTile, offsets[j + 1] - begin);
    const float* ur = u + t * r_total + j * rank;
    const T* b = bt + static_cast<int64_t>(s) * rank * out_dim + begin;
    float delta[kTile];
    if (n == kTile)
      lora_tile<kTile>(ur, b, out_dim, rank_s, n, delta);
    else
      lora_tile<0>(ur, b, out_dim, rank_s, n, delta);
    T* yr = y + t * out_dim + begin;
    for (int c = 0; c < n; ++c) yr[c] = round_to(yr, to_float(yr[c]) + delta[c]);
  }
}

}  // namespace sluice
