// 8-bit weight x 8-bit activation matmul for small batches (decode), with a path for
// each instruction-set level (isa.h).
//
// Weights: symmetric int8 per output channel, w = s * q, q in -127..127, stored offset
// as u = q + 128 (so u ^ 0x80 is q again as a signed byte). Activations are quantized
// per call exactly as for the 4-bit kernel (q4_matmul.h: int8 in blocks of 32, each
// pair of blocks stored as [b0 low, b1 low, b0 high, b1 high] halves); the weight bytes
// are stored in that same order at load time, so each 64-byte run of both lines up.
//   AVX-512 VNNI: vpdpbusd multiplies unsigned u by signed qx; the offset comes back out
//     once per activation row: sum_i u_i qx_i = sum_i q_i qx_i + 128 * sum_i qx_i.
//   AVX2: maddubs(|q|, sign(qx, q)), whose int16 pair sums cannot saturate
//     (2 * 127 * 127 < 2^15), as llama.cpp does for q8_0.
//   generic: the signed products in plain C++.
//   y_n = s_n * sum_b dx_b * sum_{i in b} q_i qx_i.
#pragma once
#include <cstdint>
#include <vector>

#include "dtype.h"
#include "isa.h"
#include "q4_matmul.h"
#include "side_prefetch.h"

namespace sluice {

// out[r] = sum_b dx_b * sum_{i in b} q_i qx_i for one weight row (K offset bytes) and R
// activation rows (xr, dxr: each row's int8 values and block scales); `offset[r]` is
// 128 * sum_b dx_b sum(qx_b) of row r (AVX-512 only). Each row's sum is the same chain
// whatever R (two accumulators, one reduction), so a row's result does not depend on
// its batch; R rows share the weight loads and interleave R chains, which one row
// alone leaves waiting on latency.
#if defined(SLUICE_ISA_AVX512)
template <int R>
inline void q8_rows_dot(const uint8_t* wr, const int8_t* const* xr, const float* const* dxr,
                        int nb, const float* offset, float* out) {
  const __m512i lanes = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int p = 0; p < nb / 2; ++p) {
    const __m512i w = _mm512_loadu_si512(wr + 64 * p);
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_loadu_si512(xr[r] + 64 * p);
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x));
      const __m128 dx2 =
          _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dxr[r] + 2 * p)));
      const __m512 sc = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(dx2));
      acc[r][p & 1] = _mm512_fmadd_ps(dot, sc, acc[r][p & 1]);
    }
  }
  for (int r = 0; r < R; ++r)
    out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1])) - offset[r];
}
constexpr int kQ8Rows = 4;
#elif defined(SLUICE_ISA_AVX2)
template <int R>
inline void q8_rows_dot(const uint8_t* wr, const int8_t* const* xr, const float* const* dxr,
                        int nb, const float* /*offset*/, float* out) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int p = 0; p < nb / 2; ++p) {
    __m256i w[2], wabs[2];
    for (int h = 0; h < 2; ++h) {  // low halves, then high halves, of both blocks
      w[h] = _mm256_xor_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + 64 * p + 32 * h)), flip);
      wabs[h] = _mm256_abs_epi8(w[h]);
    }
    for (int r = 0; r < R; ++r) {
      __m256i s32 = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        const __m256i x =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[r] + 64 * p + 32 * h));
        const __m256i prod = _mm256_maddubs_epi16(wabs[h], _mm256_sign_epi8(x, w[h]));
        s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(prod, ones));
      }
      const __m128 dx2 =
          _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dxr[r] + 2 * p)));
      acc[r][p & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), pair_lanes(dx2), acc[r][p & 1]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1]));
}
constexpr int kQ8Rows = 4;
#else
// An offset weight byte as the signed value it stands for.
inline int16_t q8_i16(uint8_t u) { return static_cast<int16_t>(static_cast<int16_t>(u) - 128); }

// One row a call: the compiler vectorizes a plain loop its own way, which a loop over
// several rows might not repeat.
template <int R>
inline void q8_rows_dot(const uint8_t* wr, const int8_t* const* xr, const float* const* dxr,
                        int nb, const float* /*offset*/, float* out) {
  static_assert(R == 1);
  float sum = 0.f;
  for (int p = 0; p < nb / 2; ++p) {
    // A pair's two blocks (b0: bytes 0-15 and 32-47, b1: 16-31 and 48-63) in one
    // loop of int16 products: compilers make it widening multiply-adds (SSE2 pmaddwd,
    // NEON smlal), where byte-to-int32 products stayed about 4x slower.
    const uint8_t* w = wr + 64 * p;
    const int8_t* x = xr[0] + 64 * p;
    int32_t d0 = 0, d1 = 0;
    for (int j = 0; j < 16; ++j) {
      d0 += q8_i16(w[j]) * int16_t{x[j]} + q8_i16(w[32 + j]) * int16_t{x[32 + j]};
      d1 += q8_i16(w[16 + j]) * int16_t{x[16 + j]} + q8_i16(w[48 + j]) * int16_t{x[48 + j]};
    }
    sum += dxr[0][2 * p] * static_cast<float>(d0);
    sum += dxr[0][2 * p + 1] * static_cast<float>(d1);
  }
  out[0] = sum;
}
constexpr int kQ8Rows = 1;
#endif

// Activation rows r0 .. r0 + R - 1 against weight row n.
template <int R, typename T>
void q8_row_block(const Q4Activations& xa, int r0, int nb, const uint8_t* wr,
                  const float* offset, float scale, int N, int n, T* y) {
  const int8_t* xr[R];
  const float* dxr[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = xa.row(r0 + r);
    dxr[r] = xa.dx.data() + static_cast<int64_t>(r0 + r) * nb;
  }
  float sums[R];
  q8_rows_dot<R>(wr, xr, dxr, nb, offset + r0, sums);
  for (int r = 0; r < R; ++r) {
    T* dst = y + static_cast<int64_t>(r0 + r) * N + n;
    *dst = sluice::round_to(dst, scale * sums[r]);
  }
}

// y [M, N] = x @ w.T for quantized x; weight rows shared out by an orphaned `omp for`
// (called by every thread of an enclosing parallel region; barrier at the end).
template <typename T>
void q8_rows(const Q4Activations& xa, int M, int K, const uint8_t* qw, const float* scale, int N,
             T* y) {
  const int nb = K / 32;
  // The AVX-512 offset term does not depend on the weight row: once per activation row.
  std::vector<float> offset(M);
  for (int r = 0; r < M; ++r) {
    float s = 0.f;
    for (int b = 0; b < nb; ++b) s += xa.sx[static_cast<size_t>(r) * nb + b];
    offset[r] = 128.f * s;
  }
  SidePrefetch queue = side_prefetch_queue;
#pragma omp for schedule(static)
  for (int n = 0; n < N; ++n) {
    side_prefetch_step(queue);
    const uint8_t* wr = qw + static_cast<int64_t>(n) * K;
    for_row_blocks<kQ8Rows>(0, M, [&](auto rows, int r0) {  // q4_matmul.h
      q8_row_block<decltype(rows)::value>(xa, r0, nb, wr, offset.data(), scale[n], N, n, y);
    });
  }
  side_prefetch_queue = queue;
}

// The same int8 weights times unquantized activations, for the output head: int8
// activation blocks there flip near-ties between logits (the bundled model's first
// answer token to "What is the capital of France?"). The activations are widened to
// fp32 once per call, in the weights' pair order, and each weight row is widened
// 16 (avx512), 8 (avx2) or 1 byte at a time; fp32 accumulation.
template <typename T>
std::vector<float> pair_ordered(const T* x, int M, int K) {
  std::vector<float> out(static_cast<size_t>(M) * K);
  for (int64_t r = 0; r < M; ++r)
    for (int b = 0; b < K / 32; ++b)
      for (int i = 0; i < 32; ++i)
        out[r * K + (b / 2) * 64 + (i < 16 ? 0 : 32) + 16 * (b % 2) + (i % 16)] =
            to_float(x[r * K + b * 32 + i]);
  return out;
}

// out[r] = w . x_r for R activation rows, the weight row converted once for all of
// them. Each row's sum is the same chain of FMAs whatever R (two accumulators, then
// one reduction), so a row's logits do not depend on its batch; R rows interleave R
// such chains, which one row alone leaves waiting on the FMA latency.
#if defined(SLUICE_ISA_AVX512)
template <int R>
inline void q8f_rows_dot(const uint8_t* wr, const float* const* xr, int K, float* out) {
  const __m512i offset = _mm512_set1_epi32(128);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int i = 0; i < K; i += 16) {
    const __m128i w8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + i));
    const __m512 w = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(w8), offset));
    for (int r = 0; r < R; ++r)
      acc[r][(i / 16) & 1] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xr[r] + i), acc[r][(i / 16) & 1]);
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}
constexpr int kQ8fRows = 8;
#elif defined(SLUICE_ISA_AVX2)
template <int R>
inline void q8f_rows_dot(const uint8_t* wr, const float* const* xr, int K, float* out) {
  const __m256i offset = _mm256_set1_epi32(128);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int i = 0; i < K; i += 8) {
    const __m128i w8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + i));
    const __m256 w = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(w8), offset));
    for (int r = 0; r < R; ++r)
      acc[r][(i / 8) & 1] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xr[r] + i), acc[r][(i / 8) & 1]);
  }
  for (int r = 0; r < R; ++r) out[r] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1]));
}
constexpr int kQ8fRows = 4;
#else
// One row a call: the compiler vectorizes a plain loop its own way, which a loop over
// several rows might not repeat.
template <int R>
inline void q8f_rows_dot(const uint8_t* wr, const float* const* xr, int K, float* out) {
  static_assert(R == 1);
  float sum = 0.f;
  for (int i = 0; i < K; ++i) sum += static_cast<float>(static_cast<int>(wr[i]) - 128) * xr[0][i];
  out[0] = sum;
}
constexpr int kQ8fRows = 1;
#endif

// The activation rows r0 .. r0 + R - 1 against weight row n.
template <int R, typename T>
void q8f_row_block(const float* x, int r0, int K, const uint8_t* wr, float scale, int N, int n,
                   T* y) {
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x + static_cast<int64_t>(r0 + r) * K;
  float sums[R];
  q8f_rows_dot<R>(wr, xr, K, sums);
  for (int r = 0; r < R; ++r) {
    T* dst = y + static_cast<int64_t>(r0 + r) * N + n;
    *dst = sluice::round_to(dst, scale * sums[r]);
  }
}

// y [M, N] = x @ w.T with x already pair-ordered fp32; orphaned `omp for` over rows.
template <typename T>
void q8f_rows(const float* x, int M, int K, const uint8_t* qw, const float* scale, int N, T* y) {
  SidePrefetch queue = side_prefetch_queue;
#pragma omp for schedule(static)
  for (int n = 0; n < N; ++n) {
    side_prefetch_step(queue);
    const uint8_t* wr = qw + static_cast<int64_t>(n) * K;
    for_row_blocks<kQ8fRows>(0, M, [&](auto rows, int r0) {
      q8f_row_block<decltype(rows)::value>(x, r0, K, wr, scale[n], N, n, y);
    });
  }
  side_prefetch_queue = queue;
}

}  // namespace sluice
