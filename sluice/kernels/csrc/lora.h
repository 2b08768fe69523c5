// LoRA adapters beside a linear layer, many adapters in one batch: each row of the
// step's activations names its adapter's slot (or -1: the base model alone). The base
// matmul has run over every row already; these two kernels add each row's low-rank
// product, gathering its adapter's matrices by the row's slot (the segmented "shrink"
// and "expand" of Punica and S-LoRA).
//
// One layer's slots: A [slots, slices * rank, in] (a fused layer, q/k/v or gate/up,
// has one A per slice) and B^T [slots, rank, out], whose column range of slice j
// multiplies u's columns j * rank .. (j + 1) * rank. Storing B transposed makes the
// expand an axpy over the output row. Portable C++ with lane arrays that each level's
// flags vectorize (the loops are short: a rank of 8-64).
//
// Both share their rows out with an orphaned `omp for` (a barrier at its end): the C
// entry points open a parallel region around them, the decode stack calls them from
// every thread of its own.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "dtype.h"
#include "isa.h"

namespace sluice {

// u[t, :] = A[slot(t)] x[t] in fp32 (zeros for rows without an adapter). ranks[s]:
// the rows of each slice that slot s uses (its adapter's rank, 0 where it adapts
// nothing here); the padding beyond is zero and never read.
template <typename T>
void lora_shrink(const T* x, int64_t rows, int in_dim, const T* a, int r_total, int rank,
                 const int32_t* slots, const int32_t* ranks, float* u) {
  constexpr int kLanes = 16;  // partial sums, added in a fixed order at the end
  const int64_t items = rows * r_total;
#pragma omp for schedule(static)
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

// A piece of one output row: columns [begin, end) of slice `slice`.
struct LoraChunk {
  int slice, begin, end;
};

// y[t, :] += B[slot(t)] u[t, :] over every slice, in y's storage type (rounded once).
template <typename T>
void lora_expand(const float* u, int64_t rows, int rank, int n_slices, const int32_t* offsets,
                 const T* bt, int out_dim, const int32_t* slots, const int32_t* ranks, T* y) {
  constexpr int kChunk = 256;  // columns per work item: the row's accumulators stay in L1
  std::vector<LoraChunk> chunks;
  for (int j = 0; j < n_slices; ++j)
    for (int c = offsets[j]; c < offsets[j + 1]; c += kChunk)
      chunks.push_back({j, c, std::min(c + kChunk, offsets[j + 1])});
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());
  const int64_t items = rows * n_chunks;
  const int r_total = n_slices * rank;
#pragma omp for schedule(static)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t t = i / n_chunks;
    const int32_t s = slots[t];
    if (s < 0 || ranks[s] == 0) continue;
    const LoraChunk& ch = chunks[i % n_chunks];
    const float* ur = u + t * r_total + ch.slice * rank;
    const T* b = bt + static_cast<int64_t>(s) * rank * out_dim;
    T* yr = y + t * out_dim;
    float acc[kChunk];
    const int n = ch.end - ch.begin;
    for (int c = 0; c < n; ++c) acc[c] = to_float(yr[ch.begin + c]);
    for (int r = 0; r < ranks[s]; ++r) {
      const float w = ur[r];
      const T* br = b + static_cast<int64_t>(r) * out_dim + ch.begin;
      for (int c = 0; c < n; ++c) acc[c] += w * to_float(br[c]);
    }
    for (int c = 0; c < n; ++c) yr[ch.begin + c] = round_to(yr, acc[c]);
  }
}

}  // namespace sluice
