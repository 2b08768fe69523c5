// The compute-bound matmul of many activation rows by a qblock weight (prompts, many
// streams): int8 activations times the weight's own integer values, no float copy of
// the weight. The block kernel (qblock.h) keeps one weight row in the lanes of a vector
// and needs a float step per 64-value pair and activation row; here a panel of 32
// weight rows is unpacked once into the order vpdpbusd multiplies (4 consecutive K
// values of 16 rows in a vector, lane = output column), so an activation's 4 bytes,
// broadcast, meet 16 columns in one instruction and a group of G values costs G / 4
// of them before its one float step (the group's scale). A panel is reused by every
// activation row: at 512 rows its unpacking is a few percent of the work.
//
// Numbers: y[r, n] = sum over spans of dx[r, s] * sum over the span's groups g of
// (d[n, g] * S[r, n, g] + m[n, g] * Q[r, g]), S the int32 dot product of the group's
// values u and the row's int8 values q, Q the sum of those q. A span is the values one
// activation scale dx covers: 32, or 256 with integer scales (the K-quants), as the
// block kernel quantizes them. A symmetric weight's m is implied * d, so its term
// enters S as implied * Q, exactly, in int32 (the accumulator starts there).
//
// The AVX-512 path is the fast one (VNNI); the others compute the same sums with
// portable loops, for the tests and for callers that reach them (sluice sends few-row
// and AVX2 calls elsewhere: sluice/layers/block_quant.py).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "dtype.h"
#include "isa.h"
#include "qblock.h"
#include "side_prefetch.h"

namespace sluice {

// Output columns of a panel (two vectors of 16 lanes) and activation rows of a block
// of accumulators: 4 rows x 2 vectors x (int32 group sums, span sums, totals) are 24
// of AVX-512's 32 registers.
constexpr int kGemmCols = 32;
constexpr int kGemmRows = 4;

// Whether activations carry the sums the avx2 panel kernel (qpanel.h: qp_rows) applies
// the group scales with in int16/int32: it has no vpdpbusd, so a group's products are
// summed in int16 by maddubs and scaled by vpmaddwd, exact, before one float step a
// super-block.
#if defined(SLUICE_ISA_AVX2)
constexpr bool kGemmInt16Sums = true;
#else
constexpr bool kGemmInt16Sums = false;
#endif

// Activation rows for the GEMM, quantized in natural K order.
struct GemmActivations {
  std::vector<int8_t> q;        // [M, stride]
  std::vector<float> dx;        // [M, K / span]
  std::vector<int32_t> qinit;   // [M, K / G]: implied * Q (symmetric weights)
  std::vector<float> qsum;      // [M, K / G]: Q as fp32 (weights with offsets)
  // kGemmInt16Sums only, two int16 in an int32: symmetric weights' implied * Q over the
  // group's K values k % 4 < 2 (low half) and k % 4 >= 2 (high), the halves maddubs
  // sums them in, [M, K / G]; with offsets, Q of groups 2j (low) and 2j + 1 at j of a
  // row (rows K / G apart, as qhalf's).
  std::vector<int32_t> qhalf, qpair;
  // The AMX-INT8 path's copies, per block of 16 rows (qblock_gemm_amx.h: amx_int8_rows).
  std::vector<int8_t> tq;
  std::vector<float> tdx, tqsum;
  int64_t stride = 0;
  int spans = 0, groups = 0;
  const int8_t* row(int r) const { return q.data() + stride * r; }
};

// Two int16 in an int32, lo in the low half.
SLUICE_INLINE int32_t gemm_int16_pair(int lo, int hi) {
  return static_cast<int32_t>(static_cast<uint16_t>(lo) | static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16);
}

// kGemmInt16Sums' sums of a row's quantized values q (GemmActivations' qhalf or qpair).
inline void gemm_int16_sums(const int8_t* q, int K, int G, int implied, bool symmetric,
                            int32_t* out) {
  for (int g0 = 0; g0 < K; g0 += G) {
    int half[2] = {0, 0};
    for (int i = g0; i < g0 + G; ++i) half[(i % 4) / 2] += q[i];
    if (symmetric)
      out[g0 / G] = gemm_int16_pair(implied * half[0], implied * half[1]);
    else if ((g0 / G) % 2 == 0)
      out[g0 / G / 2] = half[0] + half[1];  // the pair's low half, completed below
    else
      out[g0 / G / 2] = gemm_int16_pair(out[g0 / G / 2], half[0] + half[1]);
  }
}

// Row r of x (K values) quantized: a scale per span (absmax / 127, as quantize_rows
// makes them), and per group of G the sum of the int8 values, as the weight needs it.
template <typename T>
void gemm_quantize_row(const T* x, int K, int span, int G, int implied, bool symmetric,
                       int8_t* q, float* dx, int32_t* qinit, float* qsum) {
  for (int s0 = 0; s0 < K; s0 += span) {
    float amax = 0.f;
    for (int i = 0; i < span; ++i) amax = std::fmax(amax, std::fabs(to_float(x[s0 + i])));
    const float scale = amax / 127.f;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    dx[s0 / span] = scale;
    for (int g0 = s0; g0 < s0 + span; g0 += G) {
      int sum = 0;
      for (int i = g0; i < g0 + G; ++i) {
        const int v = static_cast<int>(std::nearbyint(to_float(x[i]) * inv));
        q[i] = static_cast<int8_t>(v);
        sum += v;
      }
      if (symmetric)
        qinit[g0 / G] = implied * sum;
      else
        qsum[g0 / G] = static_cast<float>(sum);
    }
  }
}

// The M rows of x as GemmActivations (every thread of a parallel region calls this;
// rows are shared out, barrier at the end).
template <typename T>
void gemm_quantize(const T* x, int M, int K, int span, int G, int implied, bool symmetric,
                   GemmActivations& a) {
#pragma omp single
  {
    // Row stride K + 64: rows 4 KiB apart share L1 sets (see QBlockActivations).
    a.stride = K + 64;
    a.spans = K / span;
    a.groups = K / G;
    a.q.resize(static_cast<size_t>(M) * a.stride);
    a.dx.resize(static_cast<size_t>(M) * a.spans);
    if (symmetric)
      a.qinit.resize(static_cast<size_t>(M) * a.groups);
    else
      a.qsum.resize(static_cast<size_t>(M) * a.groups);
    if (kGemmInt16Sums) (symmetric ? a.qhalf : a.qpair).resize(static_cast<size_t>(M) * a.groups);
  }  // implicit barrier: the buffers exist before any row is written
#pragma omp for schedule(static)
  for (int r = 0; r < M; ++r) {
    const int64_t gr = static_cast<int64_t>(r) * a.groups;
    gemm_quantize_row(x + static_cast<int64_t>(r) * K, K, span, G, implied, symmetric,
                      a.q.data() + a.stride * r, a.dx.data() + static_cast<int64_t>(r) * a.spans,
                      symmetric ? a.qinit.data() + gr : nullptr,
                      symmetric ? nullptr : a.qsum.data() + gr);
    if (kGemmInt16Sums)
      gemm_int16_sums(a.row(r), K, G, implied, symmetric,
                      (symmetric ? a.qhalf : a.qpair).data() + gr);
  }
}

// One thread's unpacked panel: u [K / 4][2][16][4] (k4 step, column vector, lane, byte),
// d and m [K / G][32] fp32 (m only for a weight with offsets). Columns past N are zero.
struct GemmPanel {
  std::vector<uint8_t> u;
  std::vector<float> d, m;
};

#if !defined(SLUICE_ISA_AVX512)
// Pair p of weight row w as 64 values in natural K order (pair order's 16-value runs
// are natural runs 0, 2, 1, 3: qblock.h).
template <int BITS>
void gemm_unpack_natural(const QbRow& w, int p, uint8_t* out) {
  const uint8_t* b = w.w + kQbPairBytes<BITS> * p;
  for (int i = 0; i < 64; ++i) {  // i: pair position
    int v = BITS == 8 ? b[i] : i < 32 ? (b[i] & 0x0F) : (b[i - 32] >> 4);
    if (BITS == kQbE2M1) v = kQbE2M1Values[v];
    if (BITS == 5) v |= static_cast<int>((w.h[8 * p + i / 8] >> (i % 8)) & 1) << 4;
    if (BITS == 6) v |= ((w.h[16 * p + i % 16] >> (2 * (i / 16))) & 3) << 4;
    out[qb_run_k(0, i / 16) + i % 16] = static_cast<uint8_t>(v);
  }
}
#endif

#if defined(SLUICE_ISA_AVX512)
// 16 vectors of 16 int32 transposed in place: v[i] lane j <- v[j] lane i.
SLUICE_INLINE void gemm_transpose16(__m512i* v) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 4) {
    const __m512i a = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    const __m512i b = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    const __m512i c = _mm512_unpacklo_epi32(v[i + 2], v[i + 3]);
    const __m512i d = _mm512_unpackhi_epi32(v[i + 2], v[i + 3]);
    // Within each 128-bit lane l: t[i + j] holds element 4l + j of v[i .. i + 3].
    t[i] = _mm512_unpacklo_epi64(a, c);
    t[i + 1] = _mm512_unpackhi_epi64(a, c);
    t[i + 2] = _mm512_unpacklo_epi64(b, d);
    t[i + 3] = _mm512_unpackhi_epi64(b, d);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i a = _mm512_shuffle_i32x4(t[j], t[4 + j], 0x88);   // lanes 0, 2 of each
    const __m512i b = _mm512_shuffle_i32x4(t[j], t[4 + j], 0xDD);   // lanes 1, 3
    const __m512i c = _mm512_shuffle_i32x4(t[8 + j], t[12 + j], 0x88);
    const __m512i d = _mm512_shuffle_i32x4(t[8 + j], t[12 + j], 0xDD);
    v[j] = _mm512_shuffle_i32x4(a, c, 0x88);       // element j of every input
    v[8 + j] = _mm512_shuffle_i32x4(a, c, 0xDD);   // element 8 + j
    v[4 + j] = _mm512_shuffle_i32x4(b, d, 0x88);   // element 4 + j
    v[12 + j] = _mm512_shuffle_i32x4(b, d, 0xDD);  // element 12 + j
  }
}
#endif

// 4- and 6-bit pairs of 16 weight rows straight into the panel's order, their packed
// bytes transposed before they are unpacked: a pair's 32 bytes are 8 dwords a row, and
// dword e's low nibbles are 4 consecutive K values (natural k4 step e, or 4 + e for
// e >= 4: the pair order's runs), its high nibbles the values 32 positions on (step 4 +
// e, or 8 + e). An 8-dword transpose of raw bytes and a mask or shift a step is a third
// of the shuffles of unpacking each row to 64 bytes and transposing 16 dwords (timed
// alone, before gemm_prefetch_panel, a 16-stream step did not move beyond the noise:
// the packing waited on memory). 6 bits' 16 high-bit bytes are 4 dwords a row, each
// byte's bit pair j the run-j value's bits 4-5 (qblock.h).
#if defined(SLUICE_ISA_AVX512)
// t[e] lane i = row i's dword e (e < 8) of its 32 bytes at src + i * stride; rows past
// `live` zero.
SLUICE_INLINE void gemm_transpose16x8(const uint8_t* src, int64_t stride, int live, __m512i* t) {
  __m512i z[8];
  for (int k = 0; k < 8; ++k) {
    // Halves rows k' and k' + 4 (k' = k, or k + 4 past 3): the 128-bit lanes of the last
    // shuffle then come out in row order.
    const int a = k < 4 ? k : k + 4, b = a + 4;
    const __m256i lo = a < live ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + a * stride))
                                : _mm256_setzero_si256();
    const __m256i hi = b < live ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + b * stride))
                                : _mm256_setzero_si256();
    z[k] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  __m512i s[8];
  for (int k = 0; k < 8; k += 4) {  // an 8 x 8 transpose in each 256-bit half, to 128 bits
    const __m512i a = _mm512_unpacklo_epi32(z[k], z[k + 1]);
    const __m512i b = _mm512_unpackhi_epi32(z[k], z[k + 1]);
    const __m512i c = _mm512_unpacklo_epi32(z[k + 2], z[k + 3]);
    const __m512i d = _mm512_unpackhi_epi32(z[k + 2], z[k + 3]);
    s[k] = _mm512_unpacklo_epi64(a, c);      // dwords 0 | 4 of four rows
    s[k + 1] = _mm512_unpackhi_epi64(a, c);  // 1 | 5
    s[k + 2] = _mm512_unpacklo_epi64(b, d);  // 2 | 6
    s[k + 3] = _mm512_unpackhi_epi64(b, d);  // 3 | 7
  }
  for (int e = 0; e < 4; ++e) {
    t[e] = _mm512_shuffle_i32x4(s[e], s[4 + e], 0x88);
    t[4 + e] = _mm512_shuffle_i32x4(s[e], s[4 + e], 0xDD);
  }
}

// t[e] lane i = row i's dword e (e < 4) of its 16 bytes at src + i * stride; rows past
// `live` zero.
SLUICE_INLINE void gemm_transpose16x4(const uint8_t* src, int64_t stride, int live, __m512i* t) {
  __m512i y[4];
  for (int k = 0; k < 4; ++k) {  // 128-bit lane l: row k + 4l
    __m512i v = _mm512_setzero_si512();
    for (int l = 0; l < 4; ++l)
      if (k + 4 * l < live)
        v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + (k + 4 * l) * stride)), l);
    y[k] = v;
  }
  const __m512i a = _mm512_unpacklo_epi32(y[0], y[1]), b = _mm512_unpackhi_epi32(y[0], y[1]);
  const __m512i c = _mm512_unpacklo_epi32(y[2], y[3]), d = _mm512_unpackhi_epi32(y[2], y[3]);
  t[0] = _mm512_unpacklo_epi64(a, c);
  t[1] = _mm512_unpackhi_epi64(a, c);
  t[2] = _mm512_unpacklo_epi64(b, d);
  t[3] = _mm512_unpackhi_epi64(b, d);
}

// Pair p of 16 rows (w[i], i < live, none read past it; a weight's rows are evenly
// spaced) as the panel's 16 k4 steps at dst (128 bytes apart).
template <int BITS>
SLUICE_INLINE void gemm_pack_pair_nibbles(const QbRow* w, int live, int p, uint8_t* dst) {
  static_assert(BITS == 4 || BITS == 6);
  if (p % 2 == 0)
    for (int i = 0; i < live; ++i) qb_prefetch<BITS>(w[i], p);
  const int64_t stride = live > 1 ? w[1].w - w[0].w : 0;
  __m512i t[8];
  gemm_transpose16x8(live > 0 ? w[0].w + kQbPairBytes<BITS> * p : nullptr, stride, live, t);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512i u[16];
  for (int e = 0; e < 4; ++e) {
    u[e] = _mm512_and_si512(t[e], low4);
    u[4 + e] = _mm512_and_si512(_mm512_srli_epi16(t[e], 4), low4);
    u[8 + e] = _mm512_and_si512(t[4 + e], low4);
    u[12 + e] = _mm512_and_si512(_mm512_srli_epi16(t[4 + e], 4), low4);
  }
  if constexpr (BITS == 6) {
    __m512i h[4];
    gemm_transpose16x4(live > 0 ? w[0].h + 16 * p : nullptr, live > 1 ? w[1].h - w[0].h : 0,
                       live, h);
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    for (int e = 0; e < 4; ++e) {  // run j's steps: e, 8 + e, 4 + e, 12 + e (j = 0..3)
      u[e] = _mm512_ternarylogic_epi32(u[e], _mm512_slli_epi32(h[e], 4), bits45, 0xF8);
      u[8 + e] = _mm512_ternarylogic_epi32(u[8 + e], _mm512_slli_epi32(h[e], 2), bits45, 0xF8);
      u[4 + e] = _mm512_ternarylogic_epi32(u[4 + e], h[e], bits45, 0xF8);
      u[12 + e] = _mm512_ternarylogic_epi32(u[12 + e], _mm512_srli_epi32(h[e], 2), bits45, 0xF8);
    }
  }
  for (int s = 0; s < 16; ++s) _mm512_storeu_si512(dst + s * 128, u[s]);
}
#endif

// Columns n0 .. n0 + 31 of the weight into `panel`.
template <int BITS, int G, bool IQ>
void gemm_pack(const QbWeight& wt, int K, int N, int n0, GemmPanel& panel) {
  const int ng = K / G, np = K / 64;
  panel.u.resize(static_cast<size_t>(K) * kGemmCols);
  panel.d.assign(static_cast<size_t>(ng) * kGemmCols, 0.f);
  const bool offsets = wt.m != nullptr;
  if (offsets) panel.m.assign(panel.d.size(), 0.f);
#if defined(SLUICE_ISA_AVX512)
  // 16 groups of 16 columns at a time: each column's as a vector, transposed.
  for (int v = 0; v < 2; ++v) {
    const int c0 = 16 * v, live = std::max(0, std::min(16, N - n0 - c0));
    for (int g0 = 0; g0 < ng; g0 += 16) {
      const int count = std::min(16, ng - g0);
      const __mmask16 k = static_cast<__mmask16>((1u << count) - 1);
      for (int which = 0; which < (offsets ? 2 : 1); ++which) {
        __m512i cols[16];
        for (int i = 0; i < 16; ++i) {
          if (i >= live) {
            cols[i] = _mm512_setzero_si512();
            continue;
          }
          const QbRow w = wt.row<BITS, G, IQ>(K, n0 + c0 + i);
          const __m512 f = which ? qb_groups16<G, IQ>(w.m, w.sm, g0, k) : qb_groups16<G, IQ>(w.d, w.sd, g0, k);
          cols[i] = _mm512_castps_si512(f);
        }
        gemm_transpose16(cols);
        float* dst = (which ? panel.m : panel.d).data() + static_cast<int64_t>(g0) * kGemmCols + c0;
        for (int j = 0; j < count; ++j) _mm512_storeu_si512(dst + j * kGemmCols, cols[j]);
      }
    }
  }
#else
  for (int c = 0; c < kGemmCols && n0 + c < N; ++c) {
    const QbRow w = wt.row<BITS, G, IQ>(K, n0 + c);
    for (int g = 0; g < ng; ++g) {
      panel.d[static_cast<size_t>(g) * kGemmCols + c] = qb_group<G, IQ>(w.d, w.sd, g);
      if (offsets) panel.m[static_cast<size_t>(g) * kGemmCols + c] = qb_group<G, IQ>(w.m, w.sm, g);
    }
  }
#endif
  for (int v = 0; v < 2; ++v) {
    const int c0 = 16 * v;
    const int live = std::max(0, std::min(16, N - n0 - c0));  // rows past N stay zero
    QbRow w[16];
    for (int i = 0; i < live; ++i) w[i] = wt.row<BITS, G, IQ>(K, n0 + c0 + i);
#if defined(SLUICE_ISA_AVX512)
    // Pair p of the 16 rows: k4 step 16p + j of vector v holds in lane i column c0 + i's
    // values 4j .. 4j + 3. The 16 rows are 16 streams through memory, so each is
    // prefetched ahead (reading them pair by pair without it waited on memory).
    for (int p = 0; p < np; ++p) {
      uint8_t* dst = panel.u.data() + (static_cast<int64_t>(16) * p * 2 + v) * 64;
      if constexpr (BITS == 4 || BITS == 6) {
        gemm_pack_pair_nibbles<BITS>(w, live, p, dst);
      } else {  // unpacked into registers and transposed there (from a scratch: a trip via L2)
        __m512i rows[16];
        for (int i = 0; i < 16; ++i) {
          if (i < live) {
            if (p % 2 == 0) qb_prefetch<BITS>(w[i], p);
            const __m512i u = qb_unpack<BITS>(w[i], p);
            rows[i] = _mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 2, 0));  // natural order
          } else {
            rows[i] = _mm512_setzero_si512();
          }
        }
        gemm_transpose16(rows);
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + j * 128, rows[j]);
      }
    }
#else
    alignas(64) uint8_t nat[16][64] = {};
    for (int p = 0; p < np; ++p) {
      for (int i = 0; i < live; ++i) gemm_unpack_natural<BITS>(w[i], p, nat[i]);
      uint8_t* dst = panel.u.data() + (static_cast<int64_t>(16) * p * 2 + v) * 64;
      for (int j = 0; j < 16; ++j)
        for (int i = 0; i < 16; ++i) std::memcpy(dst + j * 128 + 4 * i, nat[i] + 4 * j, 4);
    }
#endif
  }
}

// out[r][c] for rows r0 .. r0 + R and the panel's 32 columns.
#if defined(SLUICE_ISA_AVX512)
template <int G, int SPAN_GROUPS, bool SYM, int R>
SLUICE_INLINE void gemm_rows(const GemmPanel& panel, const GemmActivations& a, int r0, int K,
                             float (*out)[kGemmCols], SidePrefetch& ahead) {
  __m512 total[R][2];
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm512_setzero_ps();
  const int8_t* x[R];
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) x[r] = a.row(r0 + r);
  const int ng = K / G;
  for (int g0 = 0; g0 < ng; g0 += SPAN_GROUPS) {
    __m512 span[R][2];
    for (int gi = 0; gi < SPAN_GROUPS; ++gi) {
      const int g = g0 + gi;
      __m512i isum[R][2];
      SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
        const __m512i init = SYM ? _mm512_set1_epi32(a.qinit[static_cast<int64_t>(r0 + r) * ng + g])
                                 : _mm512_setzero_si512();
        isum[r][0] = isum[r][1] = init;
      }
      const uint8_t* wp = panel.u.data() + static_cast<int64_t>(g) * (G / 4) * 128;
#pragma GCC unroll 8
      for (int s = 0; s < G / 4; ++s) {
        side_prefetch_step(ahead);
        const __m512i w0 = _mm512_loadu_si512(wp + 128 * s);
        const __m512i w1 = _mm512_loadu_si512(wp + 128 * s + 64);
        SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
          const __m512i xb = broadcast4x16(x[r] + g * G + 4 * s);
          isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], w0, xb);
          isum[r][1] = _mm512_dpbusd_epi32(isum[r][1], w1, xb);
        }
      }
      const float* dg = panel.d.data() + static_cast<int64_t>(g) * kGemmCols;
      const __m512 d0 = _mm512_loadu_ps(dg), d1 = _mm512_loadu_ps(dg + 16);
      SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
        const __m512 s0 = _mm512_cvtepi32_ps(isum[r][0]), s1 = _mm512_cvtepi32_ps(isum[r][1]);
        span[r][0] = gi == 0 ? _mm512_mul_ps(s0, d0) : _mm512_fmadd_ps(s0, d0, span[r][0]);
        span[r][1] = gi == 0 ? _mm512_mul_ps(s1, d1) : _mm512_fmadd_ps(s1, d1, span[r][1]);
      }
      if constexpr (!SYM) {
        const float* mg = panel.m.data() + static_cast<int64_t>(g) * kGemmCols;
        const __m512 m0 = _mm512_loadu_ps(mg), m1 = _mm512_loadu_ps(mg + 16);
        SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
          const __m512 qs = _mm512_set1_ps(a.qsum[static_cast<int64_t>(r0 + r) * ng + g]);
          span[r][0] = _mm512_fmadd_ps(m0, qs, span[r][0]);
          span[r][1] = _mm512_fmadd_ps(m1, qs, span[r][1]);
        }
      }
    }
    SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(a.dx[static_cast<int64_t>(r0 + r) * a.spans + g0 / SPAN_GROUPS]);
      total[r][0] = _mm512_fmadd_ps(span[r][0], dx, total[r][0]);
      total[r][1] = _mm512_fmadd_ps(span[r][1], dx, total[r][1]);
    }
  }
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out[r], total[r][0]);
    _mm512_storeu_ps(out[r] + 16, total[r][1]);
  }
}
#else
template <int G, int SPAN_GROUPS, bool SYM, int R>
void gemm_rows(const GemmPanel& panel, const GemmActivations& a, int r0, int K,
               float (*out)[kGemmCols], SidePrefetch&) {
  const int ng = K / G;
  for (int r = 0; r < R; ++r) {
    const int8_t* x = a.row(r0 + r);
    const int64_t gr = static_cast<int64_t>(r0 + r) * ng;
    for (int c = 0; c < kGemmCols; ++c) {
      const int v = c / 16, lane = c % 16;
      float total = 0.f;
      for (int g0 = 0; g0 < ng; g0 += SPAN_GROUPS) {
        float span = 0.f;
        for (int g = g0; g < g0 + SPAN_GROUPS; ++g) {
          int32_t s = SYM ? a.qinit[gr + g] : 0;
          for (int k = g * G; k < (g + 1) * G; ++k)
            s += panel.u[((static_cast<int64_t>(k / 4) * 2 + v) * 16 + lane) * 4 + k % 4] * x[k];
          span += static_cast<float>(s) * panel.d[static_cast<int64_t>(g) * kGemmCols + c];
          if (!SYM) span += panel.m[static_cast<int64_t>(g) * kGemmCols + c] * a.qsum[gr + g];
        }
        total += span * a.dx[static_cast<int64_t>(r0 + r) * a.spans + g0 / SPAN_GROUPS];
      }
      out[r][c] = total;
    }
  }
}
#endif

// x's M rows into `a` as the GEMMs of the runtime format read them (every thread of a
// parallel region calls this): a scale per 256 values for integer scales, per 32 else.
template <typename T>
void gemm_quantize_for(const T* x, int M, int K, int bits, int group, const QbWeight& w,
                       GemmActivations& a) {
  gemm_quantize(x, M, K, w.s != nullptr ? kQbSuper : 32, group, qb_implied(bits),
                w.m == nullptr, a);
}

// The panel from column n0 on, as it will be read: its scales now (a few lines a row),
// its packed and high bits queued, a line per k4 step of the panel before it (a line a
// group left a third to half of a 16-row step's next panel unfetched). The
// packing reads a panel's 16-row halves as 16 streams at once, and started cold it
// waited on memory most of its time (16 streams' steps, 2 cores of Zen 4); the queue
// has it in L2 when the packing starts.
template <int BITS, int G, bool IQ>
SidePrefetch gemm_prefetch_panel(const QbWeight& wt, int K, int N, int n0) {
  if (n0 >= N) return {};
  const int64_t rows = std::min(kGemmCols, N - n0);
  const int64_t scale_bytes = (K / G) * (IQ ? 1 : 2);  // a row's d (and m)
  auto lines = [](const void* p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(static_cast<const char*>(p) + i, 0, 2);
  };
  const QbRow r = wt.row<BITS, G, IQ>(K, n0);
  lines(r.d, rows * scale_bytes);
  if (r.m) lines(r.m, rows * scale_bytes);
  if (IQ) lines(r.sd, rows * (K / kQbSuper) * (r.m ? 2 : 1) * 2);
  return side_prefetch_runs(r.w, rows * qb_row_bytes(BITS, K), r.h,
                            rows * qb_hbits_row_bytes(BITS, K));
}

// y [M, N] = x @ W.T, x's M rows quantized into `a` (gemm_quantize_for; every thread of
// a parallel region calls this; the panels are shared out, each thread unpacking its
// own). y fp32 or bf16, chosen per stored row (QbOut): the format's instances serve
// every input and output type.
template <int BITS, int G, bool IQ>
void qblock_gemm_t(int M, int K, const QbWeight& wt, int N, QbOut y, GemmActivations& a) {
  constexpr int span = IQ ? kQbSuper : 32;
  constexpr int kSpanGroups = span / G;
  const bool sym = wt.m == nullptr;
  GemmPanel panel;
  alignas(64) float out[kGemmRows][kGemmCols];
  // Panels dealt round-robin, so a thread knows its next one (gemm_prefetch_panel).
  const int stride = kGemmCols * omp_get_num_threads();
#pragma omp for schedule(static, 1)
  for (int n0 = 0; n0 < N; n0 += kGemmCols) {
    gemm_pack<BITS, G, IQ>(wt, K, N, n0, panel);
    SidePrefetch ahead = gemm_prefetch_panel<BITS, G, IQ>(wt, K, N, n0 + stride);
    const int cols = std::min(kGemmCols, N - n0);
    for (int r0 = 0; r0 < M; r0 += kGemmRows) {
      const int rows = std::min(kGemmRows, M - r0);
      qb_with_rows<kGemmRows>(rows, [&](auto R) {
        if (sym)
          gemm_rows<G, kSpanGroups, true, R>(panel, a, r0, K, out, ahead);
        else
          gemm_rows<G, kSpanGroups, false, R>(panel, a, r0, K, out, ahead);
      });
      for (int r = 0; r < rows; ++r) {
        y.typed(static_cast<int64_t>(r0 + r) * N + n0, [&](auto* yr) {
          for (int c = 0; c < cols; ++c) yr[c] = round_to(yr + c, out[r][c]);
        });
      }
    }
  }
}

// qblock_gemm_t for the runtime format, x quantized first (every thread of a parallel
// region calls it); y fp32 or bf16 whatever x is (the output head's first level is fp32).
template <typename T>
void qblock_gemm(const T* x, int M, int K, int bits, int group, const QbWeight& w, int N, QbOut y,
                 GemmActivations& a) {
  gemm_quantize_for(x, M, K, bits, group, w, a);
  SLUICE_QB_DISPATCH(bits, group, w.s != nullptr,
                     (qblock_gemm_t<B, G, IQ>(M, K, w, N, y, a)))
}

}  // namespace sluice
