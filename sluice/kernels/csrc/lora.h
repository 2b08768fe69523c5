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
// the expand reads int8 B^T as plain numbers. Beside int8 matrices the activations are
// int8 too, as the base's quantized matmuls have them: each x row (shrink) and each
// row's u within a slice (expand) rounded to steps of its absmax / 127, the products
// summed exactly in int32 (VNNI where the level has it; fp32 FMAs were the cost of
// many streams' prompts), so every level gives the same bits.
//
// Both share their rows out with an orphaned `omp for`: the C entry points open a
// parallel region around them, the decode stack calls them from every thread of its
// own. The shrink's loop has no barrier (`nowait`): its caller joins before reading u
// (the end of the entry point's region; in the decode stack, the barrier closing the
// base matmul it runs beside). The expand's ends with one.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

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
// 16 values of a row as fp32 (bf16 is the top half of an fp32).
SLUICE_INLINE __m512 lora_load16(const float* p) { return _mm512_loadu_ps(p); }
SLUICE_INLINE __m512 lora_load16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// N rows of one slot at once: each A row or B^T tile row is loaded once for all of
// them, and each row's sums are formed in the same order whatever N, so a row's
// result does not depend on which rows share its step. (Written out: the vectorizer
// left the portable loops as mixed scalar and vector code at a third of the speed.)
template <int N, typename T, typename W>
SLUICE_INLINE void lora_dots_avx512(const T* const* x, const W* a, int n, float* sums) {
  __m512 acc0[N], acc1[N];
  for (int k = 0; k < N; ++k) acc0[k] = acc1[k] = _mm512_setzero_ps();
  int h = 0;
  for (; h + 32 <= n; h += 32) {
    const __m512 a0 = lora_load16(a + h), a1 = lora_load16(a + h + 16);
    for (int k = 0; k < N; ++k) {
      acc0[k] = _mm512_fmadd_ps(lora_load16(x[k] + h), a0, acc0[k]);
      acc1[k] = _mm512_fmadd_ps(lora_load16(x[k] + h + 16), a1, acc1[k]);
    }
  }
  const bool half = h + 16 <= n;
  if (half) {
    const __m512 a0 = lora_load16(a + h);
    for (int k = 0; k < N; ++k) acc0[k] = _mm512_fmadd_ps(lora_load16(x[k] + h), a0, acc0[k]);
  }
  for (int k = 0; k < N; ++k) {
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0[k], acc1[k]));
    for (int c = h + (half ? 16 : 0); c < n; ++c) sum += to_float(x[k][c]) * to_float(a[c]);
    sums[k] = sum;
  }
}

template <int N, typename W>
SLUICE_INLINE void lora_tiles64_avx512(const float* const* u, const W* b, int stride, int rank,
                                       float* delta) {
  __m512 d[N][4];
  for (int k = 0; k < N; ++k) d[k][0] = d[k][1] = d[k][2] = d[k][3] = _mm512_setzero_ps();
  for (int r = 0; r < rank; ++r) {
    const W* br = b + static_cast<int64_t>(r) * stride;
    const __m512 b0 = lora_load16(br), b1 = lora_load16(br + 16);
    const __m512 b2 = lora_load16(br + 32), b3 = lora_load16(br + 48);
    for (int k = 0; k < N; ++k) {
      const __m512 w = _mm512_set1_ps(u[k][r]);
      d[k][0] = _mm512_fmadd_ps(w, b0, d[k][0]);
      d[k][1] = _mm512_fmadd_ps(w, b1, d[k][1]);
      d[k][2] = _mm512_fmadd_ps(w, b2, d[k][2]);
      d[k][3] = _mm512_fmadd_ps(w, b3, d[k][3]);
    }
  }
  for (int k = 0; k < N; ++k)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(delta + k * 64 + j * 16, d[k][j]);
}
#endif

#if defined(SLUICE_ISA_AVX512)
// The largest magnitude of n bf16 values: with the sign bit cleared, a bf16's bits
// order as its magnitude does (NaN aside), so the max runs on 16-bit integers.
inline float lora_bf16_absmax(const uint16_t* v, int n) {
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
  __m512i m = _mm512_setzero_si512();
  int h = 0;
  for (; h + 32 <= n; h += 32)
    m = _mm512_max_epu16(m, _mm512_and_si512(_mm512_loadu_si512(v + h), magnitude));
  const __m256i m16 = _mm256_max_epu16(_mm512_castsi512_si256(m), _mm512_extracti64x4_epi64(m, 1));
  __m128i m8 = _mm_max_epu16(_mm256_castsi256_si128(m16), _mm256_extracti128_si256(m16, 1));
  m8 = _mm_xor_si128(m8, _mm_set1_epi16(-1));  // the max as the min of the complements
  uint16_t bits = static_cast<uint16_t>(~_mm_extract_epi16(_mm_minpos_epu16(m8), 0));
  for (; h < n; ++h) bits = std::max<uint16_t>(bits, v[h] & 0x7FFF);
  return to_float(bits);
}
#endif

// int8 activations beside int8 matrices. A row's values as int8 steps of its absmax /
// 127, each biased by 128 into an unsigned byte (VNNI multiplies unsigned bytes by
// signed ones; the sums take the bias back out). One multiply by 127 / absmax and a
// round to nearest even per value, as sluice/layers/lora.py's torch path rounds.
// Returns the step (0 for a row of zeros). The library is built with -ffast-math, so
// each float result here is written as the one order of operations the compiler
// keeps, which the torch path repeats (a test compares them bit for bit).
template <typename T>
inline float lora_quantize(const T* v, int n, uint8_t* q) {
  int h = 0;
  float amax = 0.f;
#if defined(SLUICE_ISA_AVX512)
  if constexpr (std::is_same_v<T, uint16_t>) {
    amax = lora_bf16_absmax(v, n);  // 32 values an instruction, on the bits
    h = n;
  } else {
    __m512 m = _mm512_setzero_ps();
    for (; h + 16 <= n; h += 16) m = _mm512_max_ps(m, _mm512_abs_ps(lora_load16(v + h)));
    amax = _mm512_reduce_max_ps(m);
  }
#endif
  for (; h < n; ++h) amax = std::max(amax, std::fabs(to_float(v[h])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  h = 0;
#if defined(SLUICE_ISA_AVX512)
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i bias = _mm512_set1_epi32(128);
  for (; h + 16 <= n; h += 16) {
    const __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(lora_load16(v + h), vinv));  // even
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + h),
                     _mm512_cvtepi32_epi8(_mm512_add_epi32(i, bias)));
  }
#endif
  for (; h < n; ++h)
    q[h] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(to_float(v[h]) * inv)) + 128);
  return amax * (1.f / 127.f);  // (as -ffast-math would have it anyway)
}

// sum over h < n of (q[h] - 128) * a[h], exact.
inline int32_t lora_idot(const uint8_t* q, const int8_t* a, int n) {
  int32_t sum = 0;
  for (int h = 0; h < n; ++h) sum += (static_cast<int32_t>(q[h]) - 128) * a[h];
  return sum;
}

// A tile of int8 B^T (its rank rows in groups of four, each group's 64 columns with
// their four values side by side: VNNI's order) times one row's biased u, as fp32:
// delta[c] = (sum over r < 4 * groups of (q[r] - 128) * B[r][c]) * step.
inline void lora_itile(const uint8_t* q, const int8_t* b, int groups, float step, float* delta) {
  int32_t sums[64] = {};
  for (int g = 0; g < groups; ++g)
    for (int c = 0; c < 64; ++c)
      for (int j = 0; j < 4; ++j)
        sums[c] += (static_cast<int32_t>(q[4 * g + j]) - 128) * b[(g * 64 + c) * 4 + j];
  for (int c = 0; c < 64; ++c) delta[c] = static_cast<float>(sums[c]) * step;
}

#if defined(SLUICE_ISA_AVX512)
// lora_idot for N rows at once, each row of A loaded once for all of them. The bias
// comes out as 128 times A's sum, one more vpdpbusd per 64 values for them all.
template <int N>
SLUICE_INLINE void lora_idots_avx512(const uint8_t* const* q, const int8_t* a, int n,
                                     int32_t* sums) {
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[N], corr = _mm512_setzero_si512();
  for (int k = 0; k < N; ++k) acc[k] = _mm512_setzero_si512();
  for (int h = 0; h < n; h += 64) {
    const __mmask64 m = n - h >= 64 ? ~0ULL : (1ULL << (n - h)) - 1;
    const __m512i av = _mm512_maskz_loadu_epi8(m, a + h);  // zero past n: adds nothing
    corr = _mm512_dpbusd_epi32(corr, bias, av);
    for (int k = 0; k < N; ++k)
      acc[k] = _mm512_dpbusd_epi32(acc[k], _mm512_maskz_loadu_epi8(m, q[k] + h), av);
  }
  const int32_t c = _mm512_reduce_add_epi32(corr);
  for (int k = 0; k < N; ++k) sums[k] = _mm512_reduce_add_epi32(acc[k]) - c;
}

// lora_itile for N rows at once: each group of B^T's tile is loaded once for them all.
template <int N>
SLUICE_INLINE void lora_itiles_avx512(const uint8_t* const* q, const int8_t* b, int groups,
                                      const float* steps, float* delta) {
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[N][4], corr[4];
  for (int i = 0; i < 4; ++i) corr[i] = _mm512_setzero_si512();
  for (int k = 0; k < N; ++k)
    for (int i = 0; i < 4; ++i) acc[k][i] = _mm512_setzero_si512();
  for (int g = 0; g < groups; ++g) {
    __m512i bv[4];
    for (int i = 0; i < 4; ++i) {
      bv[i] = _mm512_loadu_si512(b + g * 256 + i * 64);
      corr[i] = _mm512_dpbusd_epi32(corr[i], bias, bv[i]);
    }
    for (int k = 0; k < N; ++k) {
      int32_t four;
      std::memcpy(&four, q[k] + 4 * g, sizeof(four));
      const __m512i w = _mm512_set1_epi32(four);
      for (int i = 0; i < 4; ++i) acc[k][i] = _mm512_dpbusd_epi32(acc[k][i], w, bv[i]);
    }
  }
  for (int k = 0; k < N; ++k) {
    const __m512 step = _mm512_set1_ps(steps[k]);
    for (int i = 0; i < 4; ++i) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[k][i], corr[i]));
      _mm512_storeu_ps(delta + k * 64 + i * 16, _mm512_mul_ps(sum, step));
    }
  }
}
#endif

// Up to this many rows of one slot share each read of an adapter's row (a step of
// many streams spread over a few adapters: the reads, not the multiplies, were its
// cost).
constexpr int kLoraRows = 4;

// A step's rows that have an adapter, grouped by slot (stable) in blocks of up to
// kLoraRows rows of one slot: block b is rows order[start[b] .. start[b + 1]).
struct LoraBlocks {
  std::vector<int32_t> order, start;

  int64_t count() const { return static_cast<int64_t>(start.size()) - 1; }
};

// This thread's blocks for a call (every thread of the team makes the same ones; the
// buffers are the thread's own and kept, so a decode step allocates nothing).
inline const LoraBlocks& lora_blocks(int64_t rows, const int32_t* slots) {
  static thread_local LoraBlocks blocks;
  auto& order = blocks.order;
  auto& start = blocks.start;
  order.clear();
  start.clear();
  for (int64_t t = 0; t < rows; ++t)
    if (slots[t] >= 0) order.push_back(static_cast<int32_t>(t));
  const auto by_slot = [slots](int32_t p, int32_t q) { return slots[p] < slots[q]; };
  if (!std::is_sorted(order.begin(), order.end(), by_slot))  // one row: nothing to sort
    std::stable_sort(order.begin(), order.end(), by_slot);
  for (size_t i = 0; i < order.size(); ++i)
    if (i == 0 || slots[order[i]] != slots[order[i - 1]] ||
        static_cast<int>(i) - start.back() == kLoraRows)
      start.push_back(static_cast<int32_t>(i));
  start.push_back(static_cast<int32_t>(order.size()));
  return blocks;
}

#if defined(SLUICE_ISA_AVX512)
// f(std::integral_constant<int, n>) for a block's n rows: the AVX-512 loops keep each
// row's sums in registers, so they take the row count as a constant.
template <typename F>
SLUICE_INLINE void lora_with_rows(int n, F&& f) {
  static_assert(kLoraRows == 4, "one case per block size");
  switch (n) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, kLoraRows>{});
  }
}
#endif

// sums[k] = x[rows[k]] . a for the n <= kLoraRows rows of a block.
template <typename T, typename W>
inline void lora_block_dots(const T* x, const int32_t* rows, int n, int in_dim, const W* a,
                            float* sums) {
  const T* xr[kLoraRows];
  for (int k = 0; k < n; ++k) xr[k] = x + static_cast<int64_t>(rows[k]) * in_dim;
#if defined(SLUICE_ISA_AVX512)
  lora_with_rows(n, [&](auto rows_n) { lora_dots_avx512<rows_n>(xr, a, in_dim, sums); });
#else
  for (int k = 0; k < n; ++k) sums[k] = lora_dot(xr[k], a, in_dim);
#endif
}

// sums[k] = (q[k] - 128) . a for a block's n <= kLoraRows quantized rows.
inline void lora_block_idots(const uint8_t* const* q, int n, int in_dim, const int8_t* a,
                             int32_t* sums) {
#if defined(SLUICE_ISA_AVX512)
  lora_with_rows(n, [&](auto rows_n) { lora_idots_avx512<rows_n>(q, a, in_dim, sums); });
#else
  for (int k = 0; k < n; ++k) sums[k] = lora_idot(q[k], a, in_dim);
#endif
}

// delta[k * kTile ..] for each of a block's n rows (their u rows) over one tile of B^T.
template <int kTile, typename W>
inline void lora_block_tile(const float* const* u, const W* b, int rank, int n, int cols,
                            float* delta) {
#if defined(SLUICE_ISA_AVX512)
  static_assert(kTile == 64, "the AVX-512 tile is 64 columns");
  if (cols == kTile) {
    return lora_with_rows(
        n, [&](auto rows_n) { lora_tiles64_avx512<rows_n>(u, b, kTile, rank, delta); });
  }
#endif
  for (int k = 0; k < n; ++k) {
    if (cols == kTile)
      lora_tile<kTile>(u[k], b, kTile, rank, cols, delta + k * kTile);
    else
      lora_tile<0>(u[k], b, kTile, rank, cols, delta + k * kTile);
  }
}

// delta[k * 64 ..] for each of a block's n rows (their biased u rows, scaled by their
// steps) over one int8 tile of B^T, `groups` groups of four ranks of it (a partial
// tile's padding is zero).
inline void lora_block_itile(const uint8_t* const* q, const int8_t* b, int groups, int n,
                             const float* steps, float* delta) {
#if defined(SLUICE_ISA_AVX512)
  lora_with_rows(n,
                 [&](auto rows_n) { lora_itiles_avx512<rows_n>(q, b, groups, steps, delta); });
#else
  for (int k = 0; k < n; ++k) lora_itile(q[k], b, groups, steps[k], delta + k * 64);
#endif
}

// Ask for a block's rows of y from column `col` (the next item's tile: 64 columns)
// while this item computes: the base matmul wrote y in its own order, and an item's
// few short runs of it came from beyond the cache (perf: a third of the expand's
// samples on its loads of y).
template <typename T>
inline void lora_prefetch_rows(const T* y, const int32_t* block, int n, int out_dim, int col) {
  constexpr int kLine = 64 / sizeof(T);
  for (int k = 0; k < n; ++k)
    for (int c = 0; c < 64; c += kLine)
      __builtin_prefetch(y + static_cast<int64_t>(block[k]) * out_dim + col + c, 1);
}

// y[0, n) += d[0, n), rounded once to y's type (bf16: to nearest even, as round_to).
inline void lora_add(float* y, const float* d, int n) {
  for (int c = 0; c < n; ++c) y[c] += d[c];
}

inline void lora_add(uint16_t* y, const float* d, int n) {
  int c = 0;
#if defined(SLUICE_ISA_AVX512)
  const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  for (; c + 16 <= n; c += 16) {
    const __m512i bits =
        _mm512_castps_si512(_mm512_add_ps(lora_load16(y + c), _mm512_loadu_ps(d + c)));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(half, odd));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + c),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
  }
#endif
  for (; c < n; ++c) y[c] = round_to(y, to_float(y[c]) + d[c]);
}

// u[t, :] = A[slot(t)] x[t] in fp32 for the rows with an adapter (the others' u is
// left as it is: nothing reads it), A in x's type. ranks[s]: the rows of each slice
// that slot s uses (its adapter's rank, 0 where it adapts nothing here); the padding
// beyond is zero and never read. A work item is one row of A for a block of rows of
// its slot. No barrier at the end.
template <typename T>
void lora_shrink(const T* x, int64_t rows, int in_dim, const T* a, int r_total, int rank,
                 const int32_t* slots, const int32_t* ranks, float* u) {
  const LoraBlocks& blocks = lora_blocks(rows, slots);
  const int64_t items = blocks.count() * r_total;
  // bf16 rows are widened once per block into this thread's buffer, not once per row
  // of A they meet (exact, so the sums are the same; at 64 streams the widening was a
  // third of the shrink's instructions). The buffer is sized and reached before the
  // loop: each reach for a thread_local is a call to __tls_get_addr.
  static thread_local std::vector<float> widened_rows;
  float* widened = nullptr;
  if constexpr (!std::is_same_v<T, float>) {
    widened_rows.resize(static_cast<size_t>(kLoraRows) * in_dim);
    widened = widened_rows.data();
  }
  static constexpr int32_t kInOrder[kLoraRows] = {0, 1, 2, 3};
  static_assert(kLoraRows == 4, "kInOrder lists a block's rows");
  int64_t widened_block = -1;
#pragma omp for schedule(static) nowait
  for (int64_t i = 0; i < items; ++i) {
    const int64_t blk = i / r_total;
    const int r = static_cast<int>(i % r_total);
    const int32_t* block = blocks.order.data() + blocks.start[blk];
    const int n = blocks.start[blk + 1] - blocks.start[blk];
    const int32_t s = slots[block[0]];
    float sums[kLoraRows] = {};
    if (r % rank < ranks[s]) {
      const T* ar = a + (static_cast<int64_t>(s) * r_total + r) * in_dim;
      if constexpr (std::is_same_v<T, float>) {
        lora_block_dots(x, block, n, in_dim, ar, sums);
      } else {
        if (widened_block != blk) {
          for (int k = 0; k < n; ++k)
            for (int h = 0; h < in_dim; ++h)
              widened[static_cast<size_t>(k) * in_dim + h] =
                  to_float(x[static_cast<int64_t>(block[k]) * in_dim + h]);
          widened_block = blk;
        }
        lora_block_dots(widened, kInOrder, n, in_dim, ar, sums);
      }
    }
    for (int k = 0; k < n; ++k) u[static_cast<int64_t>(block[k]) * r_total + r] = sums[k];
  }
}

// lora_shrink with int8 A: each block's x rows quantized once per thread (a buffer as
// the widened rows above), their sums exact, times the row's step and then the (slot,
// row)'s `scale`.
template <typename T>
void lora_shrink_int8(const T* x, int64_t rows, int in_dim, const int8_t* a, const float* scale,
                      int r_total, int rank, const int32_t* slots, const int32_t* ranks,
                      float* u) {
  const LoraBlocks& blocks = lora_blocks(rows, slots);
  const int64_t items = blocks.count() * r_total;
  static thread_local std::vector<uint8_t> quantized_rows;
  quantized_rows.resize(static_cast<size_t>(kLoraRows) * in_dim);
  uint8_t* quantized = quantized_rows.data();
  const uint8_t* q[kLoraRows];
  for (int k = 0; k < kLoraRows; ++k) q[k] = quantized + static_cast<size_t>(k) * in_dim;
  float step[kLoraRows] = {};
  int64_t quantized_block = -1;
#pragma omp for schedule(static) nowait
  for (int64_t i = 0; i < items; ++i) {
    const int64_t blk = i / r_total;
    const int r = static_cast<int>(i % r_total);
    const int32_t* block = blocks.order.data() + blocks.start[blk];
    const int n = blocks.start[blk + 1] - blocks.start[blk];
    const int32_t s = slots[block[0]];
    float sums[kLoraRows] = {};
    if (r % rank < ranks[s]) {
      if (quantized_block != blk) {
        for (int k = 0; k < n; ++k)
          step[k] = lora_quantize(x + static_cast<int64_t>(block[k]) * in_dim, in_dim,
                                  quantized + static_cast<size_t>(k) * in_dim);
        quantized_block = blk;
      }
      int32_t isums[kLoraRows];
      const int64_t row = static_cast<int64_t>(s) * r_total + r;
      lora_block_idots(q, n, in_dim, a + row * in_dim, isums);
      for (int k = 0; k < n; ++k) {
        const float factor = step[k] * scale[row];  // the order -ffast-math kept (a test)
        sums[k] = static_cast<float>(isums[k]) * factor;
      }
    }
    for (int k = 0; k < n; ++k) u[static_cast<int64_t>(block[k]) * r_total + r] = sums[k];
  }
}

// The columns a tile of B^T holds: a slice's columns are cut into tiles of this many
// (its last one zero-padded), each stored as its rank rows one after another, so an
// item of the expand reads one contiguous run (row by row across the whole of B^T,
// a cold decode step read 16 streams at a time at a third of the speed). An int8
// tile's rows go in groups of four, each group's columns with their four values side
// by side (lora_itile). sluice/kernels/lora.py's TILE_COLUMNS is this (checked by a
// test).
constexpr int kLoraTile = 64;
static_assert(kLoraTile == 64, "lora_itile sums 64 columns");

// Tiles of B^T per slot: every slice's columns, each slice rounded up to whole tiles.
inline int64_t lora_tiles(int n_slices, const int32_t* offsets) {
  int64_t tiles = 0;
  for (int j = 0; j < n_slices; ++j)
    tiles += (offsets[j + 1] - offsets[j] + kLoraTile - 1) / kLoraTile;
  return tiles;
}

// Where a slot's tile of B^T lands: its slice, and the output columns it covers.
struct LoraTileSpan {
  int slice, begin, cols;
};

inline LoraTileSpan lora_tile_span(const int32_t* offsets, int64_t tile) {
  int j = 0, k = static_cast<int>(tile);
  for (;; ++j) {
    const int in_slice = (offsets[j + 1] - offsets[j] + kLoraTile - 1) / kLoraTile;
    if (k < in_slice) break;
    k -= in_slice;
  }
  const int begin = offsets[j] + k * kLoraTile;
  return {j, begin, std::min(kLoraTile, offsets[j + 1] - begin)};
}

// Where a step's adapter rows are one block (one slot, at most kLoraRows rows), the
// shrink's items are its slot's A rows in order and the expand's its B^T tiles, and
// `omp for schedule(static)` hands each thread one run of them: thread t of n takes
// items / n of them, one more for the first items % n threads (libgomp's split; the
// OpenMP standard leaves it to the runtime, and another split only makes a prefetch of
// the run, side_prefetch.h, fetch a neighbour's items). `first` is the slot's first
// item; the run's bytes are returned as {start, length}.
struct LoraRun {
  const char* start;
  int64_t bytes;
};

inline LoraRun lora_thread_run(const void* first, int64_t items, int64_t item_bytes, int thread,
                               int threads) {
  const int64_t base = items / threads, extra = items % threads;
  const int64_t begin = thread * base + std::min<int64_t>(thread, extra);
  const int64_t count = base + (thread < extra ? 1 : 0);
  return {static_cast<const char*>(first) + begin * item_bytes, count * item_bytes};
}

// y[t, :] += B[slot(t)] u[t, :] over every slice: the product summed in fp32 from zero
// (as PEFT adds the adapter's output to the base's), then added to y and rounded once
// to y's type. B^T is [slots, tiles, rank, kLoraTile] in y's type; a work item is one
// tile for a block of rows of its slot, summed in registers while it reads the slot's
// rank rows there.
template <typename T>
void lora_expand(const float* u, int64_t rows, int rank, int n_slices, const int32_t* offsets,
                 const T* bt, int out_dim, const int32_t* slots, const int32_t* ranks, T* y) {
  constexpr int kTile = kLoraTile;
  const LoraBlocks& blocks = lora_blocks(rows, slots);
  const int64_t tiles = lora_tiles(n_slices, offsets);  // per row, over the slices
  const int64_t items = blocks.count() * tiles;
  const int r_total = n_slices * rank;
#pragma omp for schedule(static)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t blk = i / tiles;
    const int32_t* block = blocks.order.data() + blocks.start[blk];
    const int n = blocks.start[blk + 1] - blocks.start[blk];
    const int32_t s = slots[block[0]];
    if (ranks[s] == 0) continue;
    const int64_t tile = i % tiles;
    const LoraTileSpan span = lora_tile_span(offsets, tile);
    if (tile + 1 < tiles) lora_prefetch_rows(y, block, n, out_dim, span.begin + span.cols);
    const float* ur[kLoraRows];
    for (int k = 0; k < n; ++k)
      ur[k] = u + static_cast<int64_t>(block[k]) * r_total + span.slice * rank;
    const T* b = bt + (static_cast<int64_t>(s) * tiles + tile) * rank * kTile;
    float delta[kLoraRows * kTile];
    lora_block_tile<kTile>(ur, b, ranks[s], n, span.cols, delta);
    for (int k = 0; k < n; ++k)
      lora_add(y + static_cast<int64_t>(block[k]) * out_dim + span.begin, delta + k * kTile,
               span.cols);
  }
}

// lora_expand with int8 B^T (rank a multiple of 4; its scales are in u, from the
// shrink): each block's u rows quantized per slice once per thread, the tile's sums
// exact, times the row's step for the slice.
template <typename T>
void lora_expand_int8(const float* u, int64_t rows, int rank, int n_slices,
                      const int32_t* offsets, const int8_t* bt, int out_dim,
                      const int32_t* slots, const int32_t* ranks, T* y) {
  constexpr int kTile = kLoraTile;
  const LoraBlocks& blocks = lora_blocks(rows, slots);
  const int64_t tiles = lora_tiles(n_slices, offsets);
  const int64_t items = blocks.count() * tiles;
  const int r_total = n_slices * rank;
  static thread_local std::vector<uint8_t> quantized_rows;  // reached once, as the shrink's
  static thread_local std::vector<float> row_steps;
  quantized_rows.resize(static_cast<size_t>(kLoraRows) * r_total);
  row_steps.resize(static_cast<size_t>(kLoraRows) * n_slices);
  uint8_t* quantized = quantized_rows.data();
  float* steps = row_steps.data();
  int64_t quantized_block = -1;
#pragma omp for schedule(static)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t blk = i / tiles;
    const int32_t* block = blocks.order.data() + blocks.start[blk];
    const int n = blocks.start[blk + 1] - blocks.start[blk];
    const int32_t s = slots[block[0]];
    if (ranks[s] == 0) continue;
    if (quantized_block != blk) {
      for (int k = 0; k < n; ++k)
        for (int j = 0; j < n_slices; ++j)
          steps[k * n_slices + j] =
              lora_quantize(u + static_cast<int64_t>(block[k]) * r_total + j * rank, rank,
                            quantized + static_cast<size_t>(k) * r_total + j * rank);
      quantized_block = blk;
    }
    const int64_t tile = i % tiles;
    const LoraTileSpan span = lora_tile_span(offsets, tile);
    if (tile + 1 < tiles) lora_prefetch_rows(y, block, n, out_dim, span.begin + span.cols);
    const uint8_t* q[kLoraRows];
    float step[kLoraRows];
    for (int k = 0; k < n; ++k) {
      q[k] = quantized + static_cast<size_t>(k) * r_total + span.slice * rank;
      step[k] = steps[k * n_slices + span.slice];
    }
    float delta[kLoraRows * kTile];
    const int8_t* b = bt + (static_cast<int64_t>(s) * tiles + tile) * rank * kTile;
    lora_block_itile(q, b, (ranks[s] + 3) / 4, n, step, delta);
    for (int k = 0; k < n; ++k)  // (apart from the product: no multiply-add, as torch)
      lora_add(y + static_cast<int64_t>(block[k]) * out_dim + span.begin, delta + k * kTile,
               span.cols);
  }
}

// The entry points' and the decode stack's calls: A and B^T as the slots store them,
// int8 where `scale` is not null, else in the activations' type T.
template <typename T>
void lora_shrink_stored(const T* x, int64_t rows, int in_dim, const void* a,
                        const float* scale, int r_total, int rank, const int32_t* slots,
                        const int32_t* ranks, float* u) {
  if (scale != nullptr)
    lora_shrink_int8(x, rows, in_dim, static_cast<const int8_t*>(a), scale, r_total, rank,
                     slots, ranks, u);
  else
    lora_shrink(x, rows, in_dim, static_cast<const T*>(a), r_total, rank, slots, ranks, u);
}

template <typename T>
void lora_expand_stored(const float* u, int64_t rows, int rank, int n_slices,
                        const int32_t* offsets, const void* bt, bool int8, int out_dim,
                        const int32_t* slots, const int32_t* ranks, T* y) {
  if (int8)
    lora_expand_int8(u, rows, rank, n_slices, offsets, static_cast<const int8_t*>(bt), out_dim,
                     slots, ranks, y);
  else
    lora_expand(u, rows, rank, n_slices, offsets, static_cast<const T*>(bt), out_dim, slots,
                ranks, y);
}

}  // namespace sluice
