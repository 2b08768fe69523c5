// LoRA adapters beside a linear layer, many adapters in one batch: each row of the
// step's activations names its adapter's slot (or -1: the base model alone). The base
// matmul runs once over every row; these two kernels add each row's low-rank product,
// gathering its adapter's matrices by the row's slot (the segmented "shrink" and
// "expand" of Punica and S-LoRA).
//
// One layer's slots: A [slots, slices * rank, in] (a fused layer, q/k/v or gate/up,
// has one A per slice) and B^T in tiles of columns, [slots, tiles, rank, kLoraTile]
// (below), whose slice j multiplies u's columns j * rank .. (j + 1) * rank. Storing B
// transposed makes the expand an axpy over the output row. Portable C++ with lane
// arrays that each level's flags vectorize (the loops are short: a rank of 8-64), and
// AVX-512 loops written out.
//
// A and B^T are stored (W) in the activations' type T, or as int8 (beside quantized
// base weights: a cold decode step's adapter cost grows with the bytes it reads).
// int8 A has a scale per row and int8 B a scale per column (a B^T row within a
// slice); the shrink multiplies each sum by both (`scale` [slots, slices * rank]), so
// the expand reads int8 B^T as plain numbers.
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

// Dot product of x and one row of A over n values, 16 lanes of partial sums.
template <typename T, typename W>
inline float lora_dot(const T* x, const W* a, int n) {
  constexpr int kLanes = 16;  // partial sums, added in a fixed order at the end
  float acc[kLanes] = {};
  int h = 0;
  for (; h + kLanes <= n; h += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += to_float(x[h + j]) * to_float(a[h + j]);
  for (; h < n; ++h) acc[h % kLanes] += to_float(x[h]) * to_float(a[h]);
  float sum = 0.f;
  for (int j = 0; j < kLanes; ++j) sum += acc[j];
  return sum;
}

// delta[0, n) = sum over r < rank of u[r] * b[r * stride + c], in rank order. N: n as a
// constant where the tile is whole, so the sums stay in registers.
template <int N, typename W>
inline void lora_tile(const float* u, const W* b, int stride, int rank, int n, float* delta) {
  const int cols = N > 0 ? N : n;
  for (int c = 0; c < cols; ++c) delta[c] = 0.f;
  for (int r = 0; r < rank; ++r) {
    const float w = u[r];
    const W* br = b + static_cast<int64_t>(r) * stride;
    for (int c = 0; c < cols; ++c) delta[c] += w * to_float(br[c]);
  }
}

#if defined(SLUICE_ISA_AVX512)
// 16 values of a row as fp32 (bf16 is the top half of an fp32; int8 as integers).
SLUICE_INLINE __m512 lora_load16(const float* p) { return _mm512_loadu_ps(p); }
SLUICE_INLINE __m512 lora_load16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
SLUICE_INLINE __m512 lora_load16(const int8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

// The vectorizer left these two as mixed scalar and vector code at a third of the
// speed written out: a decode step's adapter is ~8 calls a layer of a few rows each.
template <typename T, typename W>
inline float lora_dot_avx512(const T* x, const W* a, int n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int h = 0;
  for (; h + 32 <= n; h += 32) {
    acc0 = _mm512_fmadd_ps(lora_load16(x + h), lora_load16(a + h), acc0);
    acc1 = _mm512_fmadd_ps(lora_load16(x + h + 16), lora_load16(a + h + 16), acc1);
  }
  if (h + 16 <= n) {
    acc0 = _mm512_fmadd_ps(lora_load16(x + h), lora_load16(a + h), acc0);
    h += 16;
  }
  float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  for (; h < n; ++h) sum += to_float(x[h]) * to_float(a[h]);
  return sum;
}

template <typename W>
SLUICE_INLINE void lora_tile64_avx512(const float* u, const W* b, int stride, int rank,
                                      float* delta) {
  __m512 d0 = _mm512_setzero_ps(), d1 = d0, d2 = d0, d3 = d0;
  for (int r = 0; r < rank; ++r) {
    const __m512 w = _mm512_set1_ps(u[r]);
    const W* br = b + static_cast<int64_t>(r) * stride;
    d0 = _mm512_fmadd_ps(w, lora_load16(br), d0);
    d1 = _mm512_fmadd_ps(w, lora_load16(br + 16), d1);
    d2 = _mm512_fmadd_ps(w, lora_load16(br + 32), d2);
    d3 = _mm512_fmadd_ps(w, lora_load16(br + 48), d3);
  }
  _mm512_storeu_ps(delta, d0);
  _mm512_storeu_ps(delta + 16, d1);
  _mm512_storeu_ps(delta + 32, d2);
  _mm512_storeu_ps(delta + 48, d3);
}
#endif

// u[t, :] = A[slot(t)] x[t] in fp32 (zeros for rows without an adapter). ranks[s]:
// the rows of each slice that slot s uses (its adapter's rank, 0 where it adapts
// nothing here); the padding beyond is zero and never read. scale: null where W is
// T, else each slot's per-row factor of u (int8 A and B^T). No barrier at the end.
template <typename T, typename W>
void lora_shrink(const T* x, int64_t rows, int in_dim, const W* a, const float* scale,
                 int r_total, int rank, const int32_t* slots, const int32_t* ranks, float* u) {
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
    const W* ar = a + (static_cast<int64_t>(s) * r_total + r) * in_dim;
#if defined(SLUICE_ISA_AVX512)
    const float sum = lora_dot_avx512(xr, ar, in_dim);
#else
    const float sum = lora_dot(xr, ar, in_dim);
#endif
    u[i] = scale == nullptr ? sum : sum * scale[static_cast<int64_t>(s) * r_total + r];
  }
}


// The columns a tile of B^T holds: a slice's columns are cut into tiles of this many
// (its last one zero-padded), each stored as its rank rows one after another, so an
// item of the expand reads one contiguous run (row by row across the whole of B^T,
// a cold decode step read 16 streams at a time at a third of the speed).
// sluice/kernels/lora.py's TILE_COLUMNS is this (checked by a test).
constexpr int kLoraTile = 64;

// Tiles of B^T per slot: every slice's columns, each slice rounded up to whole tiles.
inline int64_t lora_tiles(int n_slices, const int32_t* offsets) {
  int64_t tiles = 0;
  for (int j = 0; j < n_slices; ++j)
    tiles += (offsets[j + 1] - offsets[j] + kLoraTile - 1) / kLoraTile;
  return tiles;
}

// y[t, :] += B[slot(t)] u[t, :] over every slice: the product summed in fp32 from zero
// (as PEFT adds the adapter's output to the base's), then added to y and rounded once
// to y's type. B^T is [slots, tiles, rank, kLoraTile]; a work item is one tile of a
// row, summed in registers while it reads the slot's rank rows there (W: as the
// shrink's A; int8 B^T's scales are already in u).
template <typename T, typename W>
void lora_expand(const float* u, int64_t rows, int rank, int n_slices, const int32_t* offsets,
                 const W* bt, int out_dim, const int32_t* slots, const int32_t* ranks, T* y) {
  constexpr int kTile = kLoraTile;
  const int64_t tiles = lora_tiles(n_slices, offsets);  // per row, over the slices
  const int64_t items = rows * tiles;
  const int r_total = n_slices * rank;
#pragma omp for schedule(static)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t t = i / tiles;
    const int32_t s = slots[t];
    const int rank_s = s < 0 ? 0 : ranks[s];
    if (rank_s == 0) continue;
    const int64_t tile = i % tiles;
    int j = 0, k = static_cast<int>(tile);
    for (;; ++j) {  // the tile's slice
      const int in_slice = (offsets[j + 1] - offsets[j] + kTile - 1) / kTile;
      if (k < in_slice) break;
      k -= in_slice;
    }
    const int begin = offsets[j] + k * kTile, n = std::min(kTile, offsets[j + 1] - begin);
    const float* ur = u + t * r_total + j * rank;
    const W* b = bt + (static_cast<int64_t>(s) * tiles + tile) * rank * kTile;
    float delta[kTile];
    if (n == kTile)
#if defined(SLUICE_ISA_AVX512)
      lora_tile64_avx512(ur, b, kTile, rank_s, delta);
#else
      lora_tile<kTile>(ur, b, kTile, rank_s, n, delta);
#endif
    else
      lora_tile<0>(ur, b, kTile, rank_s, n, delta);
    T* yr = y + t * out_dim + begin;
    for (int c = 0; c < n; ++c) yr[c] = round_to(yr, to_float(yr[c]) + delta[c]);
  }
}

}  // namespace sluice
