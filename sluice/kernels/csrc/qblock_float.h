// qblock weights dequantized on the fly (qblock.h has the layouts): the matmul with
// unquantized activations (the output head, where int8 activation blocks flip
// near-tied logits), dequantization to [N, K] (feeding dense GEMMs for large batches)
// and embedding rows. A run of 16 values becomes 16 fp32 weights d * u + m (one
// rounding: d * u is exact in fp32, an fp16 times an 8-bit integer), written out or
// multiplied into the activation rows with fp32 accumulation.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtype.h"
#include "isa.h"
#include "qblock.h"

namespace sluice {

// Pair p's 64 values u in position order: 8 bits point into the row itself, 4 and 5
// bits are unpacked into `buf`.
template <int BITS>
inline const uint8_t* qb_pair_bytes(const QbRow& w, int p, uint8_t* buf) {
  if constexpr (BITS == 8) {
    return w.w + 64 * p;
  } else {
#if defined(SLUICE_ISA_AVX512)
    _mm512_storeu_si512(buf, qb_unpack<BITS>(w, p));
#elif defined(SLUICE_ISA_AVX2)
    __m256i lo, hi;
    qb_unpack<BITS>(w, p, lo, hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf + 32), hi);
#else
    qb_unpack<BITS>(w, p, buf);
#endif
    return buf;
  }
}

// ---- 16 values of a run -> fp32 weights, kept in registers (matmul) or stored.
#if defined(SLUICE_ISA_AVX512)
using QbRun = __m512;
inline QbRun qb_run(const uint8_t* u, float d, float m) {
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u))));
  return _mm512_fmadd_ps(v, _mm512_set1_ps(d), _mm512_set1_ps(m));
}
inline void qb_store(const QbRun& v, float* dst) { _mm512_storeu_ps(dst, v); }
inline void qb_store(const QbRun& v, uint16_t* dst) {  // bf16, round to nearest even
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
template <int R>
inline void qb_run_fma(const QbRun& v, const float* const* xr, int off, __m512* acc) {
  for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(v, _mm512_loadu_ps(xr[r] + off), acc[r]);
}
inline float qb_sum(const __m512& a, const __m512& b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
using QbAcc = __m512;
inline QbAcc qb_zero() { return _mm512_setzero_ps(); }
#elif defined(SLUICE_ISA_AVX2)
struct QbRun {
  __m256 a, b;
};
inline __m256 qb_run8(const uint8_t* u, float d, float m) {
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u))));
  return _mm256_fmadd_ps(v, _mm256_set1_ps(d), _mm256_set1_ps(m));
}
inline QbRun qb_run(const uint8_t* u, float d, float m) { return {qb_run8(u, d, m), qb_run8(u + 8, d, m)}; }
inline void qb_store(const QbRun& v, float* dst) {
  _mm256_storeu_ps(dst, v.a);
  _mm256_storeu_ps(dst + 8, v.b);
}
inline __m128i qb_bf16x8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline void qb_store(const QbRun& v, uint16_t* dst) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), qb_bf16x8(v.a));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 8), qb_bf16x8(v.b));
}
template <int R>
inline void qb_run_fma(const QbRun& v, const float* const* xr, int off, __m256* acc) {
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_fmadd_ps(v.a, _mm256_loadu_ps(xr[r] + off), acc[r]);
    acc[r] = _mm256_fmadd_ps(v.b, _mm256_loadu_ps(xr[r] + off + 8), acc[r]);
  }
}
inline float qb_sum(const __m256& a, const __m256& b) { return hsum8(_mm256_add_ps(a, b)); }
using QbAcc = __m256;
inline QbAcc qb_zero() { return _mm256_setzero_ps(); }
#else
struct QbRun {
  float v[16];
};
inline QbRun qb_run(const uint8_t* u, float d, float m) {
  QbRun out;
  for (int i = 0; i < 16; ++i) out.v[i] = d * static_cast<float>(u[i]) + m;
  return out;
}
template <typename T>
inline void qb_store(const QbRun& v, T* dst) {
  for (int i = 0; i < 16; ++i) dst[i] = round_to(dst, v.v[i]);
}
// Out of line, so that a row's result does not depend on R (see qb_pair_dot).
__attribute__((noinline)) inline float qb_run_dot(const float* w, const float* x) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += w[i] * x[i];
  return s;
}
template <int R>
inline void qb_run_fma(const QbRun& v, const float* const* xr, int off, float* acc) {
  for (int r = 0; r < R; ++r) acc[r] += qb_run_dot(v.v, xr[r] + off);
}
inline float qb_sum(float a, float b) { return a + b; }
using QbAcc = float;
inline QbAcc qb_zero() { return 0.f; }
#endif

// out[r] = sum_k W[k] x_r[k] for one weight row and R <= 4 pair-ordered fp32 rows.
template <int BITS, int G, int R>
inline void qbf_dot_rows(const QbRow& w, const float* const* xr, int np, float* out) {
  QbAcc acc0[R], acc1[R];  // runs 0, 2 and runs 1, 3: two FMA chains a row
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = qb_zero();
  alignas(64) uint8_t buf[64];
  for (int p = 0; p < np; ++p) {
    const uint8_t* u = qb_pair_bytes<BITS>(w, p, buf);
    for (int j = 0; j < 4; j += 2) {
      const int g0 = qb_run_group<G>(p, j), g1 = qb_run_group<G>(p, j + 1);
      qb_run_fma<R>(qb_run(u + 16 * j, qb_half(w.d[g0]), qb_half(w.m[g0])), xr, 64 * p + 16 * j,
                    acc0);
      qb_run_fma<R>(qb_run(u + 16 * j + 16, qb_half(w.d[g1]), qb_half(w.m[g1])), xr,
                    64 * p + 16 * j + 16, acc1);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = qb_sum(acc0[r], acc1[r]);
}

template <int BITS, int G, typename T>
void qblock_float_rows_t(const float* x, int M, int K, const uint8_t* packed,
                         const uint8_t* hbits, const uint16_t* d, const uint16_t* m, int N, T* y) {
#pragma omp for schedule(static)
  for (int n = 0; n < N; ++n) {
    const QbRow w = qb_row<BITS, G>(packed, hbits, d, m, K, n);
    for (int r0 = 0; r0 < M; r0 += 4) {
      const float* xr[4];
      float out[4];
      const int R = std::min(4, M - r0);
      for (int r = 0; r < R; ++r) xr[r] = x + static_cast<int64_t>(r0 + r) * K;
      switch (R) {
        case 4: qbf_dot_rows<BITS, G, 4>(w, xr, K / 64, out); break;
        case 3: qbf_dot_rows<BITS, G, 3>(w, xr, K / 64, out); break;
        case 2: qbf_dot_rows<BITS, G, 2>(w, xr, K / 64, out); break;
        default: qbf_dot_rows<BITS, G, 1>(w, xr, K / 64, out); break;
      }
      for (int r = 0; r < R; ++r) {
        T* dst = y + static_cast<int64_t>(r0 + r) * N + n;
        *dst = round_to(dst, out[r]);
      }
    }
  }
}

// ---- Dequantization of whole rows, natural order.
template <int BITS, int G, typename T>
inline void qb_dequantize_row(const QbRow& w, int K, T* out) {
  alignas(64) uint8_t buf[64];
  for (int p = 0; p < K / 64; ++p) {
    const uint8_t* u = qb_pair_bytes<BITS>(w, p, buf);
    for (int j = 0; j < 4; ++j) {
      const int g = qb_run_group<G>(p, j);
      qb_store(qb_run(u + 16 * j, qb_half(w.d[g]), qb_half(w.m[g])), out + qb_run_k(p, j));
    }
  }
}

// out[t] = W[rows[t]] for t < T (rows: null for 0..T-1); orphaned `omp for`.
template <int BITS, int G, typename T>
void qblock_gather_t(const int64_t* rows, int T_, const uint8_t* packed, const uint8_t* hbits,
                     const uint16_t* d, const uint16_t* m, int K, T* out) {
#pragma omp for schedule(static)
  for (int t = 0; t < T_; ++t) {
    const int64_t n = rows ? rows[t] : t;
    qb_dequantize_row<BITS, G>(qb_row<BITS, G>(packed, hbits, d, m, K, n), K,
                               out + static_cast<int64_t>(t) * K);
  }
}

}  // namespace sluice
