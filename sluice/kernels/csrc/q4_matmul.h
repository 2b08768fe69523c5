// 4-bit weight x 8-bit activation matmul for small batches (decode) on AVX-512 VNNI.
//
// Weights: asymmetric 4-bit in blocks of 32 along the input dimension, w = d * q + m,
// q in 0..15, fp16 d and m per block (11 bits of precision where bf16 has 8; the
// scales are a sixth of the bytes a decode step reads, so fp32 would cost ~10%). Block byte j holds q[j] in its low nibble and
// q[j + 16] in its high nibble (the GGUF Q4_1 order). Rows of packed bytes are K/2 long.
//
// Activations are quantized per call to int8 in blocks of 32 (scale dx = absmax / 127),
// so that one vpdpbusd multiplies 64 weight/activation pairs:
//   sum_i w_i x_i  ~=  d * dx * sum_i q_i qx_i  +  m * dx * sum_i qx_i.
// Two blocks are processed per 512-bit register. Their 16-byte nibble halves unpack to
// [b0 low, b1 low, b0 high, b1 high]; the activation bytes are stored permuted the same
// way once per call, so the hot loop has no shuffles of activations.
//
// Decoding reads every weight once per step: the loop over weight rows is outermost and
// parallel, each row's bytes stay in L1 while all activation rows use them.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtype.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define SLUICE_Q4_VNNI 1
#endif

namespace sluice {

#if SLUICE_Q4_VNNI
// x [M, K] -> int8 in pair-permuted order, per-block scales dx and dx * sum(qx).
template <typename T>
void quantize_rows(const T* x, int M, int K, int8_t* xq, float* dx, float* sx) {
  const int nb = K / 32;
  for (int r = 0; r < M; ++r) {
    const T* xr = x + static_cast<int64_t>(r) * K;
    int8_t* qr = xq + static_cast<int64_t>(r) * K;
    for (int b = 0; b < nb; ++b) {
      float v[32], amax = 0.f;
      for (int i = 0; i < 32; ++i) {
        v[i] = to_float(xr[b * 32 + i]);
        amax = std::fmax(amax, std::fabs(v[i]));
      }
      const float scale = amax / 127.f;
      const float inv = scale > 0.f ? 1.f / scale : 0.f;
      // Block b is the first (0) or second (1) of its pair; its low 16 values go to
      // bytes [16*half, +16) of the pair, its high 16 to [32 + 16*half, +16).
      int8_t* pair = qr + (b / 2) * 64;
      const int half = b % 2;
      int sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int q = static_cast<int>(std::nearbyint(v[i] * inv));
        sum += q;
        pair[(i < 16 ? 0 : 32) + 16 * half + (i % 16)] = static_cast<int8_t>(q);
      }
      dx[static_cast<int64_t>(r) * nb + b] = scale;
      sx[static_cast<int64_t>(r) * nb + b] = scale * static_cast<float>(sum);
    }
  }
}

// The 16 int32 partial dot products of block pair p (lanes: b0, b1, b0, b1 by fours).
inline __m512 pair_dot(const uint8_t* wr, const int8_t* xr, int p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + 32 * p));
  const __m512i both =
      _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
  const __m512i q = _mm512_and_si512(both, _mm512_set1_epi8(0x0F));
  const __m512i xv = _mm512_loadu_si512(xr + 64 * p);
  return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv));
}

// Per-lane scale d * dx of the block each lane of pair p belongs to.
inline __m512 pair_scale(const uint16_t* dr, const float* dxr, int p, __m512i lanes) {
  int32_t d2;
  std::memcpy(&d2, dr + 2 * p, sizeof(d2));
  const __m128 s2 =
      _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(d2)),
                 _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dxr + 2 * p))));
  return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(s2));
}

// Activation rows quantized by quantize_rows, for one call of q4_rows.
struct Q4Activations {
  std::vector<int8_t> q;
  std::vector<float> dx, sx;
  template <typename T>
  void quantize(const T* x, int M, int K) {
    q.resize(static_cast<size_t>(M) * K);
    dx.resize(static_cast<size_t>(M) * (K / 32));
    sx.resize(dx.size());
    quantize_rows(x, M, K, q.data(), dx.data(), sx.data());
  }
};

// y [M, N] = x @ w.T for quantized x; the weight rows are shared out by an orphaned
// `omp for` (every thread of an enclosing parallel region calls this; barrier at end).
template <typename T>
void q4_rows(const Q4Activations& xa, int M, int K, const uint8_t* qw, const uint16_t* d,
             const uint16_t* m, int N, T* y) {
  const int nb = K / 32, np = K / 64;
  const int8_t* xq = xa.q.data();
  const float* dx = xa.dx.data();
  const float* sx = xa.sx.data();
  const __m512i lanes = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
#pragma omp for schedule(static)
  for (int n = 0; n < N; ++n) {
    const uint8_t* wr = qw + static_cast<int64_t>(n) * (K / 2);
    const uint16_t* dr = d + static_cast<int64_t>(n) * nb;
    const uint16_t* mr = m + static_cast<int64_t>(n) * nb;
    for (int r = 0; r < M; ++r) {
      const int8_t* xr = xq + static_cast<int64_t>(r) * K;
      const float* dxr = dx + static_cast<int64_t>(r) * nb;
      // Two accumulators: consecutive pairs do not wait on each other's FMA.
      __m512 acc = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
      int p = 0;
      for (; p + 1 < np; p += 2) {
        acc = _mm512_fmadd_ps(pair_dot(wr, xr, p), pair_scale(dr, dxr, p, lanes), acc);
        acc2 = _mm512_fmadd_ps(pair_dot(wr, xr, p + 1), pair_scale(dr, dxr, p + 1, lanes), acc2);
      }
      if (p < np) acc = _mm512_fmadd_ps(pair_dot(wr, xr, p), pair_scale(dr, dxr, p, lanes), acc);
      acc = _mm512_add_ps(acc, acc2);
      // The blocks' minimum terms: sum_b m_b * dx_b * sum(qx_b), 16 blocks at a time.
      const float* sxr = sx + static_cast<int64_t>(r) * nb;
      for (int b = 0; b < nb; b += 16) {
        const __mmask16 k = nb - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nb - b)) - 1);
        const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mr + b));
        acc = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, sxr + b), acc);
      }
      T* dst = y + static_cast<int64_t>(r) * N + n;
      *dst = sluice::round_to(dst, _mm512_reduce_add_ps(acc));
    }
  }
}
#endif

}  // namespace sluice
