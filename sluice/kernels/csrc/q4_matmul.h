// 4-bit weight x 8-bit activation matmul for small batches (decode), with a path for
// each instruction-set level (isa.h): AVX-512 VNNI, AVX2 and portable C++.
//
// Weights: asymmetric 4-bit in blocks of 32 along the input dimension, w = d * q + m,
// q in 0..15, fp16 d and m per block (11 bits of precision where bf16 has 8; the
// scales are a sixth of the bytes a decode step reads, so fp32 would cost ~10%). Block
// byte j holds q[j] in its low nibble and q[j + 16] in its high nibble (the GGUF Q4_1
// order). Rows of packed bytes are K/2 long.
//
// Activations are quantized per call to int8 in blocks of 32 (scale dx = absmax / 127),
// so that integer dot products do the multiply-adds:
//   sum_i w_i x_i  ~=  d * dx * sum_i q_i qx_i  +  m * dx * sum_i qx_i.
// Blocks are handled in pairs. A pair's 32 weight bytes unpack to [b0 low, b1 low] (the
// low nibbles) and [b0 high, b1 high] (the high ones); the activation bytes are stored
// in that order once per call, [b0 low, b1 low, b0 high, b1 high], so the hot loop has
// no shuffles of activations on any path: AVX-512 multiplies all 64 in one vpdpbusd,
// AVX2 in two maddubs (their int16 pair sums cannot saturate: 2 * 15 * 127 < 2^15).
//
// Decoding reads every weight once per step: the loop over weight rows is outermost and
// parallel, each row's bytes stay in L1 while all activation rows use them.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dtype.h"
#include "isa.h"
#include "side_prefetch.h"

namespace sluice {

// x [M, K] -> int8 in pair-permuted order, per-block scales dx and dx * sum(qx).
// span: values under one scale, 32 or 256 (the integer-scale qblock kernels sum a
// whole 256-value super-block in int32, so its 8 blocks share their largest's scale;
// dx and sx stay per 32-block, dx then repeating a super-block's scale 8 times).
template <typename T>
void quantize_rows(const T* x, int M, int K, int8_t* xq, float* dx, float* sx, int span = 32) {
  const int nb = K / 32, per = span / 32;
  for (int r = 0; r < M; ++r) {
    const T* xr = x + static_cast<int64_t>(r) * K;
    int8_t* qr = xq + static_cast<int64_t>(r) * K;
    for (int b0 = 0; b0 < nb; b0 += per) {
      float v[256], amax = 0.f;  // the span's values, converted once
      for (int i = 0; i < span; ++i) {
        v[i] = to_float(xr[b0 * 32 + i]);
        amax = std::fmax(amax, std::fabs(v[i]));
      }
      const float scale = amax / 127.f;
      const float inv = scale > 0.f ? 1.f / scale : 0.f;
      for (int b = b0; b < b0 + per; ++b) {
        // Block b is the first (0) or second (1) of its pair; its low 16 values go to
        // bytes [16*half, +16) of the pair, its high 16 to [32 + 16*half, +16).
        int8_t* pair = qr + (b / 2) * 64;
        const int half = b % 2;
        const float* vb = v + (b - b0) * 32;
        int sum = 0;
        for (int i = 0; i < 32; ++i) {
          const int q = static_cast<int>(std::nearbyint(vb[i] * inv));
          sum += q;
          pair[(i < 16 ? 0 : 32) + 16 * half + (i % 16)] = static_cast<int8_t>(q);
        }
        dx[static_cast<int64_t>(r) * nb + b] = scale;
        sx[static_cast<int64_t>(r) * nb + b] = scale * static_cast<float>(sum);
      }
    }
  }
}

// Activation rows quantized by quantize_rows, for one call of q4_rows / q8_rows.
struct Q4Activations {
  std::vector<int8_t> q;
  std::vector<float> dx, sx;
  // Bytes from one row of q to the next (K; QBlockActivations may pad it).
  int64_t stride = 0;
  const int8_t* row(int r) const { return q.data() + stride * r; }
  template <typename T>
  void quantize(const T* x, int M, int K, int span = 32) {
    stride = K;
    q.resize(static_cast<size_t>(M) * K);
    dx.resize(static_cast<size_t>(M) * (K / 32));
    sx.resize(dx.size());
    quantize_rows(x, M, K, q.data(), dx.data(), sx.data(), span);
  }
};

// One weight row . R activation rows: out[r] = sum_b d_b dx_b sum(q qx) + sum_b m_b sx_b.
// wr: K/2 packed bytes; dr, mr: nb fp16; each row's K pair-ordered int8, nb dx and sx.
// Each row's sum is the same chain whatever R, so a row's result does not depend on
// its batch; R rows share the weight's unpacking and interleave R chains, which one
// row alone leaves waiting on latency.
template <int R>
struct Q4RowPtrs {
  const int8_t* x[R];
  const float* dx[R];
  const float* sx[R];
};
#if defined(SLUICE_ISA_AVX512)
// Per-lane scale d * dx of the block each lane of pair p belongs to.
inline __m512 q4_pair_scale(const uint16_t* dr, const float* dxr, int p, __m512i lanes) {
  int32_t d2;
  std::memcpy(&d2, dr + 2 * p, sizeof(d2));
  const __m128 s2 =
      _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(d2)),
                 _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dxr + 2 * p))));
  return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(s2));
}

template <int R>
inline void q4_rows_dot(const uint8_t* wr, const uint16_t* dr, const uint16_t* mr,
                        const Q4RowPtrs<R>& x, int nb, float* out) {
  const int np = nb / 2;
  const __m512i lanes = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  // Two accumulators a row: consecutive pairs do not wait on each other's FMA.
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  // Pair p into accumulator a (p's parity, unrolled by two so both stay in registers).
  auto pair = [&](int p, int a) __attribute__((always_inline)) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + 32 * p));
    const __m512i q = _mm512_and_si512(
        _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1),
        _mm512_set1_epi8(0x0F));
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(x.x[r] + 64 * p);
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv));
      acc[r][a] = _mm512_fmadd_ps(dot, q4_pair_scale(dr, x.dx[r], p, lanes), acc[r][a]);
    }
  };
  int p = 0;
  for (; p + 1 < np; p += 2) {
    pair(p, 0);
    pair(p + 1, 1);
  }
  if (p < np) pair(p, 0);
  for (int r = 0; r < R; ++r) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][1]);
  // The blocks' minimum terms: sum_b m_b * dx_b * sum(qx_b), 16 blocks at a time.
  for (int b = 0; b < nb; b += 16) {
    const __mmask16 k = nb - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nb - b)) - 1);
    const __m512 mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mr + b));
    for (int r = 0; r < R; ++r)
      acc[r][0] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, x.sx[r] + b), acc[r][0]);
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r][0]);
}
constexpr int kQ4Rows = 4;
#elif defined(SLUICE_ISA_AVX2)
// Lanes 0-3 get a, lanes 4-7 get b: the two blocks of a pair after maddubs + madd.
inline __m256 pair_lanes(__m128 ab) {
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(ab),
                                  _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
}

template <int R>
inline void q4_rows_dot(const uint8_t* wr, const uint16_t* dr, const uint16_t* mr,
                        const Q4RowPtrs<R>& x, int nb, float* out) {
  const int np = nb / 2;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int p = 0; p < np; ++p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + 32 * p));
    const __m256i lo = _mm256_and_si256(raw, nibble);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
    int32_t d2;
    std::memcpy(&d2, dr + 2 * p, sizeof(d2));
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(d2));
    for (int r = 0; r < R; ++r) {
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.x[r] + 64 * p));
      const __m256i x1 =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.x[r] + 64 * p + 32));
      const __m256i s16 =
          _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
      const __m128 s2 = _mm_mul_ps(
          d, _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(x.dx[r] + 2 * p))));
      acc[r][p & 1] = _mm256_fmadd_ps(dot, pair_lanes(s2), acc[r][p & 1]);
    }
  }
  __m256 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm256_add_ps(acc[r][0], acc[r][1]);
  int b = 0;
  for (; b + 8 <= nb; b += 8) {
    const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mr + b)));
    for (int r = 0; r < R; ++r) total[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(x.sx[r] + b), total[r]);
  }
  for (int r = 0; r < R; ++r) {
    float sum = hsum8(total[r]);
    for (int t = b; t < nb; ++t) sum += _cvtsh_ss(mr[t]) * x.sx[r][t];
    out[r] = sum;
  }
}
constexpr int kQ4Rows = 4;
#else
// One row a call: the compiler vectorizes a plain loop its own way, which a loop over
// several rows might not repeat. (nb is even: K is a multiple of 64.)
template <int R>
inline void q4_rows_dot(const uint8_t* wr, const uint16_t* dr, const uint16_t* mr,
                        const Q4RowPtrs<R>& x, int nb, float* out) {
  static_assert(R == 1);
  float sum = 0.f;
  for (int p = 0; p < nb / 2; ++p) {
    // A pair's two blocks (b0: bytes 0-15, b1: 16-31; low nibbles meet x 0-31, high
    // 32-63) in one loop of int16 products: compilers make it widening multiply-adds
    // (SSE2 pmaddwd, NEON smlal), where a loop a block stayed about 5x slower.
    const uint8_t* w = wr + 32 * p;
    const int8_t* xp = x.x[0] + 64 * p;
    int32_t dot[2] = {0, 0};
    for (int j = 0; j < 16; ++j)
      for (int h = 0; h < 2; ++h)
        dot[h] += static_cast<int16_t>(w[16 * h + j] & 0x0F) * int16_t{xp[16 * h + j]} +
                  static_cast<int16_t>(w[16 * h + j] >> 4) * int16_t{xp[32 + 16 * h + j]};
    for (int h = 0; h < 2; ++h) {
      const int b = 2 * p + h;
      sum += half_to_float(dr[b]) * x.dx[0][b] * static_cast<float>(dot[h]) +
             half_to_float(mr[b]) * x.sx[0][b];
    }
  }
  out[0] = sum;
}
constexpr int kQ4Rows = 1;
#endif

// f(std::integral_constant<int, R>{}, r) over rows r0 .. M - 1 in blocks of R rows:
// MAX at a time, then at most one block each of MAX / 2, MAX / 4 .. 1 (MAX a power of
// two): the row-block loop of the weight-only kernels.
template <int MAX, typename F>
SLUICE_INLINE void for_row_blocks(int r0, int M, F&& f) {
  int r = r0;
  for (; r + MAX <= M; r += MAX) f(std::integral_constant<int, MAX>{}, r);
  if constexpr (MAX > 1) for_row_blocks<MAX / 2>(r, M, f);
}

// Activation rows r0 .. r0 + R - 1 against weight row n.
template <int R, typename T>
void q4_row_block(const Q4Activations& xa, int r0, int nb, const uint8_t* wr, const uint16_t* dr,
                  const uint16_t* mr, int N, int n, T* y) {
  Q4RowPtrs<R> x;
  for (int r = 0; r < R; ++r) {
    x.x[r] = xa.row(r0 + r);
    x.dx[r] = xa.dx.data() + static_cast<int64_t>(r0 + r) * nb;
    x.sx[r] = xa.sx.data() + static_cast<int64_t>(r0 + r) * nb;
  }
  float sums[R];
  q4_rows_dot<R>(wr, dr, mr, x, nb, sums);
  for (int r = 0; r < R; ++r) {
    T* dst = y + static_cast<int64_t>(r0 + r) * N + n;
    *dst = sluice::round_to(dst, sums[r]);
  }
}

// y [M, N] = x @ w.T for quantized x; the weight rows are shared out by an orphaned
// `omp for` (every thread of an enclosing parallel region calls this; barrier at end).
template <typename T>
void q4_rows(const Q4Activations& xa, int M, int K, const uint8_t* qw, const uint16_t* d,
             const uint16_t* m, int N, T* y) {
  const int nb = K / 32;
  SidePrefetch queue = side_prefetch_queue;
#pragma omp for schedule(static)
  for (int n = 0; n < N; ++n) {
    side_prefetch_step(queue);
    const uint8_t* wr = qw + static_cast<int64_t>(n) * (K / 2);
    const uint16_t* dr = d + static_cast<int64_t>(n) * nb;
    const uint16_t* mr = m + static_cast<int64_t>(n) * nb;
    for_row_blocks<kQ4Rows>(0, M, [&](auto rows, int r0) {
      q4_row_block<decltype(rows)::value>(xa, r0, nb, wr, dr, mr, N, n, y);
    });
  }
  side_prefetch_queue = queue;
}

}  // namespace sluice
