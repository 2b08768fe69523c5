// qblock weights dequantized on the fly (qblock.h has the layouts): the matmul with
// unquantized activations (exact to fp32 rounding: the reference the output head's
// two-level int8 path is checked against), dequantization to [N, K] (feeding dense
// GEMMs for large batches) and embedding rows. A run of 16 values becomes 16 fp32
// weights d * u + m, one FMA (one rounding; an integer scale times its fp16
// multiplier is exact in fp32), written out or multiplied into the activation rows
// with fp32 accumulation.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtype.h"
#include "isa.h"
#include "qblock.h"

namespace sluice {

// Pair p's 64 values u in position order: 8 bits point into the row itself, 4-6
// bits are unpacked into `buf`.
template <int BITS>
SLUICE_INLINE const uint8_t* qb_pair_bytes(const QbRow& w, int p, uint8_t* buf) {
#if defined(SLUICE_ISA_AVX512)
  // 4 and 8 bits: qb_run reads the row itself. 5 and 6 bits: their high bits are
  // merged once a pair, bytewise (a third of the instructions of merging them into
  // each run's 32-bit lanes, which left the output head compute-bound); MXFP4's codes
  // looked up likewise.
  if constexpr (BITS == 5 || BITS == 6 || BITS == kQbE2M1)
    _mm512_store_si512(buf, qb_unpack<BITS>(w, p));
  return buf;
#else
  if constexpr (BITS == 8) {
    return w.w + 64 * p;
  } else {
#if defined(SLUICE_ISA_AVX2)
    __m256i lo, hi;
    qb_unpack<BITS>(w, p, lo, hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf + 32), hi);
#else
    qb_unpack<BITS>(w, p, buf);
#endif
    return buf;
  }
#endif
}

// ---- 16 values of a run -> fp32 weights, kept in registers (matmul) or stored.
#if defined(SLUICE_ISA_AVX512)
using QbRun = __m512;
// Run j of pair p widened to 16 int32 lanes: 8 bits straight from the row, 4 bits from
// bytes 16 * (j & 1).. of the pair (low nibbles for runs 0, 1, high for 2, 3), 5 and 6
// bits from the pair qb_pair_bytes unpacked.
template <int BITS>
SLUICE_INLINE QbRun qb_run(const QbRow& w, int p, int j, const uint8_t* u, float d, float m) {
  __m512i v;
  if constexpr (BITS == 8) {
    v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.w + 64 * p + 16 * j)));
  } else if constexpr (BITS == 4) {
    v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.w + 32 * p + 16 * (j & 1))));
    v = j < 2 ? _mm512_and_si512(v, _mm512_set1_epi32(15)) : _mm512_srli_epi32(v, 4);
  } else {  // unpacked by qb_pair_bytes
    v = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(u + 16 * j)));
  }
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(d), _mm512_set1_ps(m));
}
inline void qb_store(const QbRun& v, float* dst) { _mm512_storeu_ps(dst, v); }
inline void qb_store(const QbRun& v, uint16_t* dst) {  // bf16, round to nearest even
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
template <int R>
SLUICE_INLINE void qb_run_fma(const QbRun& v, const float* const* xr, int off, __m512* acc) {
  for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(v, _mm512_loadu_ps(xr[r] + off), acc[r]);
}
inline float qb_sum(const __m512& a, const __m512& b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
using QbAcc = __m512;
inline QbAcc qb_zero() { return _mm512_setzero_ps(); }
#elif defined(SLUICE_ISA_AVX2)
struct QbRun {
  __m256 a, b;
};
SLUICE_INLINE __m256 qb_run8(const uint8_t* u, float d, float m) {
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u))));
  return _mm256_fmadd_ps(v, _mm256_set1_ps(d), _mm256_set1_ps(m));
}
template <int BITS>
SLUICE_INLINE QbRun qb_run(const QbRow&, int, int j, const uint8_t* u, float d, float m) {
  return {qb_run8(u + 16 * j, d, m), qb_run8(u + 16 * j + 8, d, m)};
}
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
SLUICE_INLINE void qb_run_fma(const QbRun& v, const float* const* xr, int off, __m256* acc) {
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
template <int BITS>
SLUICE_INLINE QbRun qb_run(const QbRow&, int, int j, const uint8_t* u, float d, float m) {
  QbRun out;
  for (int i = 0; i < 16; ++i) out.v[i] = d * static_cast<float>(u[16 * j + i]) + m;
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
SLUICE_INLINE void qb_run_fma(const QbRun& v, const float* const* xr, int off, float* acc) {
  for (int r = 0; r < R; ++r) acc[r] += qb_run_dot(v.v, xr[r] + off);
}
inline float qb_sum(float a, float b) { return a + b; }
using QbAcc = float;
inline QbAcc qb_zero() { return 0.f; }
#endif

// d and m of pair p's runs 0..3 as fp32 (m = implied * d for a symmetric weight).
template <int BITS, int G, bool IQ>
SLUICE_INLINE void qb_pair_dm(const QbRow& w, int p, float* d, float* m) {
#if defined(SLUICE_ISA_AVX512) || defined(SLUICE_ISA_AVX2)
  const int sb = p / kQbSuperPairs;
  __m128 dv = qb_pair_groups<G, IQ>(w.d, IQ ? qb_half(w.sd[sb]) : 0.f, p);
  __m128 mv = w.m ? qb_pair_groups<G, IQ>(w.m, IQ ? qb_half(w.sm[sb]) : 0.f, p)
                  : _mm_mul_ps(dv, _mm_set1_ps(qb_implied_m<BITS>));
  if constexpr (G == 32) {  // runs: groups 2p, 2p+1, 2p, 2p+1
    dv = _mm_movelh_ps(dv, dv);
    mv = _mm_movelh_ps(mv, mv);
  } else {  // runs: groups 4p, 4p+2, 4p+1, 4p+3
    dv = _mm_shuffle_ps(dv, dv, _MM_SHUFFLE(3, 1, 2, 0));
    mv = _mm_shuffle_ps(mv, mv, _MM_SHUFFLE(3, 1, 2, 0));
  }
  _mm_storeu_ps(d, dv);
  _mm_storeu_ps(m, mv);
#else
  for (int j = 0; j < 4; ++j) {
    const int g = qb_run_group<G>(p, j);
    d[j] = qb_group<G, IQ>(w.d, w.sd, g);
    m[j] = w.m ? qb_group<G, IQ>(w.m, w.sm, g) : qb_implied_m<BITS> * d[j];
  }
#endif
}

// out[r] = sum_k W[k] x_r[k] for one weight row and R <= 4 pair-ordered fp32 rows.
template <int BITS, int G, bool IQ, int R>
inline void qbf_dot_rows(const QbRow& w, const float* const* xr, int np, float* out) {
  QbAcc acc0[R], acc1[R];  // runs 0, 2 and runs 1, 3: two FMA chains a row
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = qb_zero();
  alignas(64) uint8_t buf[64];
  for (int p = 0; p < np; ++p) {
    const uint8_t* u = qb_pair_bytes<BITS>(w, p, buf);
    float d[4], m[4];
    qb_pair_dm<BITS, G, IQ>(w, p, d, m);
    for (int j = 0; j < 4; j += 2) {
      qb_run_fma<R>(qb_run<BITS>(w, p, j, u, d[j], m[j]), xr, 64 * p + 16 * j, acc0);
      qb_run_fma<R>(qb_run<BITS>(w, p, j + 1, u, d[j + 1], m[j + 1]), xr, 64 * p + 16 * j + 16,
                    acc1);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = qb_sum(acc0[r], acc1[r]);
}

template <int BITS, int G, bool IQ, typename T>
void qblock_float_rows_t(const float* x, int M, int K, const QbWeight& wt, int N, T* y) {
#pragma omp for schedule(static)
  for (int n = 0; n < N; ++n) {
    const QbRow w = wt.row<BITS, G, IQ>(K, n);
    for (int r0 = 0; r0 < M; r0 += 4) {
      const float* xr[4];
      float out[4];
      const int R = std::min(4, M - r0);
      for (int r = 0; r < R; ++r) xr[r] = x + static_cast<int64_t>(r0 + r) * K;
      switch (R) {
        case 4: qbf_dot_rows<BITS, G, IQ, 4>(w, xr, K / 64, out); break;
        case 3: qbf_dot_rows<BITS, G, IQ, 3>(w, xr, K / 64, out); break;
        case 2: qbf_dot_rows<BITS, G, IQ, 2>(w, xr, K / 64, out); break;
        default: qbf_dot_rows<BITS, G, IQ, 1>(w, xr, K / 64, out); break;
      }
      for (int r = 0; r < R; ++r) {
        T* dst = y + static_cast<int64_t>(r0 + r) * N + n;
        *dst = round_to(dst, out[r]);
      }
    }
  }
}

// ---- Dequantization of whole rows, natural order.
template <int BITS, int G, bool IQ, typename T>
inline void qb_dequantize_row(const QbRow& w, int K, T* out) {
  alignas(64) uint8_t buf[64];
  for (int p = 0; p < K / 64; ++p) {
    const uint8_t* u = qb_pair_bytes<BITS>(w, p, buf);
    float d[4], m[4];
    qb_pair_dm<BITS, G, IQ>(w, p, d, m);
    for (int j = 0; j < 4; ++j) qb_store(qb_run<BITS>(w, p, j, u, d[j], m[j]), out + qb_run_k(p, j));
  }
}

#if defined(SLUICE_ISA_AVX512)
// bf16 rows where the CPU has AVX512-BF16 (Zen 4 on, Cooper Lake on): one rounding
// instruction for 16 values where the portable sequence (qb_store) takes six. Large
// batches dequantize every weight each step for the dense GEMM, and that was
// compute-bound: SmolLM2's decoder tiles ~40% faster (benchmarks/weight_paths.py has the
// step). Rounding is the same (to nearest even); the instruction treats denormal
// inputs as zero, which d * u + m of fp16-scaled weights never produces.
#define SLUICE_NATIVE_BF16 __attribute__((target("avx512bf16")))
SLUICE_NATIVE_BF16 inline void qb_store_native(const QbRun& v, uint16_t* dst) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

template <int BITS, int G, bool IQ>
SLUICE_NATIVE_BF16 void qb_dequantize_row_native(const QbRow& w, int K, uint16_t* out) {
  alignas(64) uint8_t buf[64];
  for (int p = 0; p < K / 64; ++p) {
    const uint8_t* u = qb_pair_bytes<BITS>(w, p, buf);
    float d[4], m[4];
    qb_pair_dm<BITS, G, IQ>(w, p, d, m);
    for (int j = 0; j < 4; ++j) qb_store_native(qb_run<BITS>(w, p, j, u, d[j], m[j]), out + qb_run_k(p, j));
  }
}

inline bool qb_native_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}
#endif

// out[t] = W[rows[t]] for t < T (rows: null for 0..T-1); orphaned `omp for`.
template <int BITS, int G, bool IQ, typename T>
void qblock_gather_t(const int64_t* rows, int T_, const QbWeight& wt, int K, T* out) {
#if defined(SLUICE_ISA_AVX512)
  if constexpr (sizeof(T) == 2) {
    if (qb_native_bf16()) {
#pragma omp for schedule(static)
      for (int t = 0; t < T_; ++t) {
        const int64_t n = rows ? rows[t] : t;
        qb_dequantize_row_native<BITS, G, IQ>(wt.row<BITS, G, IQ>(K, n), K,
                                              out + static_cast<int64_t>(t) * K);
      }
      return;
    }
  }
#endif
#pragma omp for schedule(static)
  for (int t = 0; t < T_; ++t) {
    const int64_t n = rows ? rows[t] : t;
    qb_dequantize_row<BITS, G, IQ>(wt.row<BITS, G, IQ>(K, n), K, out + static_cast<int64_t>(t) * K);
  }
}

}  // namespace sluice
