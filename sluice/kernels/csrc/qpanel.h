// A K-quant weight kept in the int8 GEMM's panel order (qblock_gemm.h) instead of
// row-major blocks: the GEMM unpacks 32 weight rows into vpdpbusd's order on every
// call (a third of a 16-row step, 8% of a 64-row one), and the block kernel, which
// keeps one weight row in a vector's lanes, spends two multiplies per 64 values and
// activation row (maddubs, then the group scales). Stored in panel order, a step of any
// number of rows broadcasts each activation row's 4 bytes against 16 weight rows' 4
// values (one vpdpbusd per 64 products), applies each group's scale once per 16
// columns, and unpacks nothing but nibbles (a mask or a shift). Its sums are the
// GEMM's, in the GEMM's order, so a row's result is the same whatever the batch and
// equal to qblock_gemm's on the row-major weight.
//
// Layout of a weight of N rows (a multiple of 32: kQpCols) by K (a multiple of 256),
// integer scales only (Q4_K: 4 bits, groups of 32, offsets; Q6_K: 6 bits, groups of 16,
// symmetric), panel P holding rows 32P .. 32P + 31, its parts contiguous:
//   packed [panels][K/64 pairs][2 halves][8][16 rows][4 bytes]: vector i of a half is 16
//     rows' natural k4 steps 2i (low nibbles) and 2i + 1 (high nibbles) of the pair;
//   hbits (6 bits) [panels][K/64][2][4][16][4]: vector j's bit pair q holds bits 4-5 of
//     step 4j + q;
//   d, m [panels][K/G][32] int8: group scales and offsets (m null: symmetric);
//   s [panels][K/256][32] fp16 multipliers of d, then (offsets) [K/256][32] of m.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "qblock_gemm.h"

namespace sluice {

constexpr int kQpCols = kGemmCols;  // weight rows of a panel

// Bytes of one panel's parts.
constexpr int64_t qp_packed_bytes(int K) { return static_cast<int64_t>(K) * kQpCols / 2; }
constexpr int64_t qp_hbits_bytes(int bits, int K) {
  return bits == 6 ? static_cast<int64_t>(K) * kQpCols / 4 : 0;
}

// One panel's pointers.
struct QpPanel {
  const uint8_t* w;
  const uint8_t* h;
  const int8_t* d;
  const int8_t* m;
  const uint16_t* sd;
  const uint16_t* sm;
};

template <int BITS, int G>
SLUICE_INLINE QpPanel qp_panel(const QbWeight& wt, int K, int64_t panel) {
  const int64_t groups = (K / G) * kQpCols, supers = (K / kQbSuper) * kQpCols;
  const bool offsets = wt.m != nullptr;
  const uint16_t* sd = wt.s + panel * supers * (offsets ? 2 : 1);
  return {wt.packed + panel * qp_packed_bytes(K),
          BITS == 6 ? wt.hbits + panel * qp_hbits_bytes(BITS, K) : nullptr,
          static_cast<const int8_t*>(wt.d) + panel * groups,
          offsets ? static_cast<const int8_t*>(wt.m) + panel * groups : nullptr, sd,
          offsets ? sd + supers : nullptr};
}

// Expert e's weight in one stacked from experts of N rows each (N a multiple of 32).
template <int BITS, int G>
QbWeight qp_expert_weight(const QbWeight& w, int K, int64_t first_row) {
  const QpPanel p = qp_panel<BITS, G>(w, K, first_row / kQpCols);
  return {p.w, p.h, p.d, p.m, p.sd};
}

// Rows n0 .. n0 + 31 of the row-major weight `src` (rows past N zero) as panel `panel`
// of `dst` (the layout above), through the GEMM's own unpacking (gemm_pack).
template <int BITS, int G>
void qp_repack_panel(const QbWeight& src, int K, int N, int n0, GemmPanel& scratch,
                     const QbWeight& dst, int64_t panel) {
  static_assert(BITS == 4 || BITS == 6);
  gemm_pack<BITS, G, true>(src, K, N, n0, scratch);
  const QpPanel out = qp_panel<BITS, G>(dst, K, panel);
  uint8_t* w = const_cast<uint8_t*>(out.w);
  uint8_t* h = const_cast<uint8_t*>(out.h);
  // scratch.u: [K/4 steps][2 halves][16 lanes][4 bytes], the values whole.
  auto u = [&](int step, int half, int i) {
    return scratch.u[(static_cast<int64_t>(step) * 2 + half) * 64 + i];
  };
  for (int p = 0; p < K / 64; ++p)
    for (int half = 0; half < 2; ++half) {
      for (int v = 0; v < 8; ++v)
        for (int i = 0; i < 64; ++i)
          w[((static_cast<int64_t>(p) * 2 + half) * 8 + v) * 64 + i] =
              static_cast<uint8_t>((u(16 * p + 2 * v, half, i) & 0x0F) |
                                   (u(16 * p + 2 * v + 1, half, i) & 0x0F) << 4);
      if constexpr (BITS == 6)
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 64; ++i) {
            int bits45 = 0;
            for (int q = 0; q < 4; ++q)
              bits45 |= ((u(16 * p + 4 * j + q, half, i) >> 4) & 3) << (2 * q);
            h[((static_cast<int64_t>(p) * 2 + half) * 4 + j) * 64 + i] =
                static_cast<uint8_t>(bits45);
          }
    }
  int8_t* d = const_cast<int8_t*>(out.d);
  int8_t* m = const_cast<int8_t*>(out.m);
  uint16_t* sd = const_cast<uint16_t*>(out.sd);
  uint16_t* sm = const_cast<uint16_t*>(out.sm);
  const int groups = K / G, supers = K / kQbSuper;
  for (int c = 0; c < kQpCols; ++c) {
    const bool live = n0 + c < N;
    const QbRow r = live ? src.row<BITS, G, true>(K, n0 + c) : QbRow{};
    for (int g = 0; g < groups; ++g) {
      d[g * kQpCols + c] = live ? static_cast<const int8_t*>(r.d)[g] : 0;
      if (m) m[g * kQpCols + c] = live ? static_cast<const int8_t*>(r.m)[g] : 0;
    }
    for (int s = 0; s < supers; ++s) {
      sd[s * kQpCols + c] = live ? r.sd[s] : 0;
      if (sm) sm[s * kQpCols + c] = live ? r.sm[s] : 0;
    }
  }
}

// One weight row of a panel weight rebuilt in the row-major qblock layout (qblock.h),
// for the kernels that read single rows: the output head's second level reads its
// candidate tokens' rows (a few dozen a step) and their block-kernel dot product must
// be the row-major weight's, bit for bit. Reads the 4 bytes of the row's lane in each
// of the panel's vectors (half the panel's lines).
struct QpRowScratch {
  std::vector<uint8_t> u, w, h;
  std::vector<int8_t> d, m;
  std::vector<uint16_t> s;
};

template <int BITS, int G>
QbRow qp_row(const QbWeight& wt, int K, int64_t n, QpRowScratch& out) {
  static_assert(BITS == 4 || BITS == 6);
  const QpPanel p = qp_panel<BITS, G>(wt, K, n / kQpCols);
  const int c = static_cast<int>(n % kQpCols), half = c / 16, lane = c % 16;
  out.u.resize(K);  // the row's values in natural order, then packed as rows are
  for (int pair = 0; pair < K / 64; ++pair)
    for (int step = 0; step < 16; ++step) {  // values 64 pair + 4 step + 0..3
      const int64_t at = static_cast<int64_t>(pair) * 2 + half;
      const uint8_t* b = p.w + (at * 8 + step / 2) * 64 + 4 * lane;
      const uint8_t* hb = BITS == 6 ? p.h + (at * 4 + step / 4) * 64 + 4 * lane : nullptr;
      for (int j = 0; j < 4; ++j) {
        int v = step % 2 ? b[j] >> 4 : b[j] & 0x0F;
        if constexpr (BITS == 6) v |= ((hb[j] >> (2 * (step % 4))) & 3) << 4;
        out.u[64 * pair + 4 * step + j] = static_cast<uint8_t>(v);
      }
    }
  out.w.resize(static_cast<size_t>(K) / 2);
  out.h.resize(BITS == 6 ? static_cast<size_t>(K) / 4 : 0);
  qb_pack_row(out.u.data(), K, BITS, out.w.data(), out.h.data());
  const int groups = K / G, supers = K / kQbSuper;
  out.d.resize(groups);
  out.m.resize(p.m ? groups : 0);
  for (int g = 0; g < groups; ++g) {
    out.d[g] = p.d[g * kQpCols + c];
    if (p.m) out.m[g] = p.m[g * kQpCols + c];
  }
  out.s.resize(static_cast<size_t>(supers) * (p.m ? 2 : 1));
  for (int s0 = 0; s0 < supers; ++s0) {
    out.s[s0] = p.sd[s0 * kQpCols + c];
    if (p.m) out.s[supers + s0] = p.sm[s0 * kQpCols + c];
  }
  return {out.w.data(), BITS == 6 ? out.h.data() : nullptr, out.d.data(),
          p.m ? out.m.data() : nullptr, out.s.data(), p.m ? out.s.data() + supers : nullptr};
}

#if defined(SLUICE_ISA_AVX512)
// A panel read from memory (its first block of rows; the others find it in L1 or L2):
// each step's lines 1 KB ahead into L1 and 8 KB ahead into L2, as the block kernel's
// row passes prefetch theirs (qb_stream_prefetch); the high bits at half the distance.
// Without it a one-row step read experts that were not in the cache at half the
// bandwidth the block kernel reaches.
template <int BITS>
SLUICE_INLINE void qp_stream_prefetch(const uint8_t* vp, const uint8_t* hp) {
  for (const int half : {0, 512}) {
    __builtin_prefetch(vp + half + kQbPrefetchBytes, 0, 3);
    __builtin_prefetch(vp + half + kQbFarPrefetchBytes, 0, 2);
  }
  if constexpr (BITS == 6)
    for (const int half : {0, 256}) {
      __builtin_prefetch(hp + half + kQbPrefetchBytes / 2, 0, 3);
      __builtin_prefetch(hp + half + kQbFarPrefetchBytes / 2, 0, 2);
    }
}

// 16 int8 group scales (or offsets) at v times their multipliers, as fp32 (kept as
// computed, qb_keep: a row's result must not depend on the batch).
SLUICE_INLINE __m512 qp_scales16(const int8_t* v, __m512 mult) {
  const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v)));
  return qb_keep(_mm512_mul_ps(_mm512_cvtepi32_ps(q), mult));
}

// Nibbles u with bits 4-5 of h (shifted into place) added: 6-bit values.
SLUICE_INLINE __m512i qp_high(__m512i u, __m512i h) {
  return _mm512_ternarylogic_epi32(u, h, _mm512_set1_epi8(0x30), 0xF8);
}

// out[r][c] for activation rows r0 .. r0 + R and the panel's 32 columns: gemm_rows'
// arithmetic, the weight read from the panel instead of a packed copy.
template <int BITS, int G, bool SYM, int R>
SLUICE_INLINE void qp_rows(const QpPanel& w, const GemmActivations& a, int r0, int K,
                           float (*out)[kQpCols], bool ahead) {
  constexpr int kSpanGroups = kQbSuper / G;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int ng = K / G;
  // The totals in `out` (touched once a super-block): registers for the group and span
  // sums of up to kQpRows rows.
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out[r], _mm512_setzero_ps());
    _mm512_storeu_ps(out[r] + 16, _mm512_setzero_ps());
  }
  const int8_t* x[R];
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) x[r] = a.row(r0 + r);
  for (int s0 = 0; s0 < K / kQbSuper; ++s0) {
    const auto* sd = reinterpret_cast<const __m256i*>(w.sd + s0 * kQpCols);
    const __m512 sd0 = _mm512_cvtph_ps(_mm256_loadu_si256(sd));
    const __m512 sd1 = _mm512_cvtph_ps(_mm256_loadu_si256(sd + 1));
    __m512 sm0 = sd0, sm1 = sd1;
    if constexpr (!SYM) {
      const auto* sm = reinterpret_cast<const __m256i*>(w.sm + s0 * kQpCols);
      sm0 = _mm512_cvtph_ps(_mm256_loadu_si256(sm));
      sm1 = _mm512_cvtph_ps(_mm256_loadu_si256(sm + 1));
    }
    __m512 span[R][2];
    for (int gi = 0; gi < kSpanGroups; ++gi) {
      const int g = s0 * kSpanGroups + gi;
      __m512i isum[R][2];
      SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
        const int64_t at = static_cast<int64_t>(r0 + r) * ng + g;
        const __m512i init = SYM ? _mm512_set1_epi32(a.qinit[at]) : _mm512_setzero_si512();
        isum[r][0] = isum[r][1] = init;
      }
#pragma GCC unroll 4
      for (int i = 0; i < G / 8; ++i) {  // two k4 steps a vector
        const int step = g * (G / 4) + 2 * i, p = step / 16, in_pair = step % 16;
        const uint8_t* vp = w.w + (static_cast<int64_t>(p) * 16 + in_pair / 2) * 64;
        const uint8_t* hp =
            BITS == 6 ? w.h + (static_cast<int64_t>(p) * 8 + in_pair / 4) * 64 : nullptr;
        if (ahead) qp_stream_prefetch<BITS>(vp, hp);
        const __m512i b0 = _mm512_loadu_si512(vp), b1 = _mm512_loadu_si512(vp + 512);
        __m512i lo0 = _mm512_and_si512(b0, low4), lo1 = _mm512_and_si512(b1, low4);
        __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(b0, 4), low4);
        __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(b1, 4), low4);
        if constexpr (BITS == 6) {  // steps 4j + q, q = 0 or 2 (lo) and q + 1 (hi)
          const __m512i h0 = _mm512_loadu_si512(hp), h1 = _mm512_loadu_si512(hp + 256);
          if (in_pair % 4 == 0) {
            lo0 = qp_high(lo0, _mm512_slli_epi32(h0, 4));
            lo1 = qp_high(lo1, _mm512_slli_epi32(h1, 4));
            hi0 = qp_high(hi0, _mm512_slli_epi32(h0, 2));
            hi1 = qp_high(hi1, _mm512_slli_epi32(h1, 2));
          } else {
            lo0 = qp_high(lo0, h0);
            lo1 = qp_high(lo1, h1);
            hi0 = qp_high(hi0, _mm512_srli_epi32(h0, 2));
            hi1 = qp_high(hi1, _mm512_srli_epi32(h1, 2));
          }
        }
        SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
          const __m512i xa = broadcast4x16(x[r] + 4 * step);
          const __m512i xb = broadcast4x16(x[r] + 4 * step + 4);
          isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], lo0, xa);
          isum[r][1] = _mm512_dpbusd_epi32(isum[r][1], lo1, xa);
          isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], hi0, xb);
          isum[r][1] = _mm512_dpbusd_epi32(isum[r][1], hi1, xb);
        }
      }
      const int8_t* dg = w.d + static_cast<int64_t>(g) * kQpCols;
      const int8_t* mg = SYM ? nullptr : w.m + static_cast<int64_t>(g) * kQpCols;
      if (ahead) {  // the scales' streams: 32 bytes a group each
        __builtin_prefetch(dg + kQbFarPrefetchBytes / 8, 0, 2);
        if constexpr (!SYM) __builtin_prefetch(mg + kQbFarPrefetchBytes / 8, 0, 2);
      }
      const __m512 d0 = qp_scales16(dg, sd0), d1 = qp_scales16(dg + 16, sd1);
      SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
        const __m512 s0 = _mm512_cvtepi32_ps(isum[r][0]), s1 = _mm512_cvtepi32_ps(isum[r][1]);
        span[r][0] = gi == 0 ? _mm512_mul_ps(s0, d0) : _mm512_fmadd_ps(s0, d0, span[r][0]);
        span[r][1] = gi == 0 ? _mm512_mul_ps(s1, d1) : _mm512_fmadd_ps(s1, d1, span[r][1]);
      }
      if constexpr (!SYM) {
        const __m512 m0 = qp_scales16(mg, sm0), m1 = qp_scales16(mg + 16, sm1);
        SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
          const __m512 qs = _mm512_set1_ps(a.qsum[static_cast<int64_t>(r0 + r) * ng + g]);
          span[r][0] = _mm512_fmadd_ps(m0, qs, span[r][0]);
          span[r][1] = _mm512_fmadd_ps(m1, qs, span[r][1]);
        }
      }
    }
    SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(a.dx[static_cast<int64_t>(r0 + r) * a.spans + s0]);
      _mm512_storeu_ps(out[r], _mm512_fmadd_ps(span[r][0], dx, _mm512_loadu_ps(out[r])));
      _mm512_storeu_ps(out[r] + 16,
                       _mm512_fmadd_ps(span[r][1], dx, _mm512_loadu_ps(out[r] + 16)));
    }
  }
}
#endif

#if defined(SLUICE_ISA_AVX2)
// 8 int8 at v as int16 pairs (v[i], v[i]) in lane i: a group scale for vpmaddwd.
SLUICE_INLINE __m256i qp_scale_pairs(const int8_t* v) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(v));
  return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(b, b));
}

// 8 int8 at a and at b as int16 pairs (a[i], b[i]) in lane i.
SLUICE_INLINE __m256i qp_scale_pairs(const int8_t* a, const int8_t* b) {
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a));
  const __m128i y = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
  return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(x, y));
}

SLUICE_INLINE __m256 qp_multipliers8(const uint16_t* s) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
}

// qp_rows at avx2, which has no vpdpbusd: a vector is 8 columns (a half of the panel's
// 64-byte vectors) and maddubs multiplies 4 values a lane into two int16 sums, which add
// up in int16 over the group (or over `kChunk` steps where that could overflow: 6 bits
// with offsets); vpmaddwd then multiplies each by the column's int8 group scale and adds
// the halves in int32, so a super-block's sum over its groups is exact in int32 and
// takes one float step: y += dx * (sd * T_d + sm * T_m), T_m the offsets' sum over the
// groups of m * Q (vpmaddwd on group pairs). A symmetric weight's implied * Q starts the
// int16 sums (qhalf): its values then sum to at most 8 * 32 * 127 a half, in range. Its
// sums are not the int8 GEMM's (whose float steps are a group's), so a row's result is
// the same at every row count because every row count runs here.
template <int BITS, int G, bool SYM, int R>
SLUICE_INLINE void qp_rows(const QpPanel& w, const GemmActivations& a, int r0, int K,
                           float (*out)[kQpCols], bool ahead) {
  constexpr int kSpanGroups = kQbSuper / G, kSteps = G / 4;
  // Steps summed in int16 before vpmaddwd: a step adds up to 2 * 63 * 127 a half.
  constexpr int kChunk = BITS == 6 && !SYM ? 2 : kSteps;
  // Vectors of 8 columns a pass (16 registers): the panel's four for one row, so its
  // lines stream in order; a 64-byte line's two for two rows; one for more.
  constexpr int CV = R == 1 ? 4 : R == 2 ? 2 : 1;
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  const int ng = K / G;
  const int8_t* x[R];
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) x[r] = a.row(r0 + r);
  for (int s0 = 0; s0 < K / kQbSuper; ++s0) {
    for (int v0 = 0; v0 < kQpCols / 8; v0 += CV) {  // columns 8 v0 on
      __m256i td[R][CV];
      SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) for (int c = 0; c < CV; ++c) td[r][c] = _mm256_setzero_si256();
      for (int gi = 0; gi < kSpanGroups; ++gi) {
        const int g = s0 * kSpanGroups + gi;
        const int8_t* dg = w.d + static_cast<int64_t>(g) * kQpCols;
        if (ahead && v0 == 0) {  // the scales' streams: 32 bytes a group each
          __builtin_prefetch(dg + kQbFarPrefetchBytes / 8, 0, 2);
          if constexpr (!SYM) __builtin_prefetch(w.m + (dg - w.d) + kQbFarPrefetchBytes / 8, 0, 2);
        }
        __m256i scale[CV];
        for (int c = 0; c < CV; ++c) scale[c] = qp_scale_pairs(dg + 8 * (v0 + c));
#pragma GCC unroll 4
        for (int c0 = 0; c0 < kSteps; c0 += kChunk) {
          __m256i s16[R][CV];
          SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
            const __m256i init = SYM ? _mm256_set1_epi32(a.qhalf[static_cast<int64_t>(r0 + r) * ng + g])
                                     : _mm256_setzero_si256();
            for (int c = 0; c < CV; ++c) s16[r][c] = init;
          }
#pragma GCC unroll 4
          for (int i = c0; i < c0 + kChunk; i += 2) {  // two k4 steps a load
            const int step = g * kSteps + i, p = step / 16, in_pair = step % 16;
            __m256i lo[CV], hi[CV];
            for (int c = 0; c < CV; ++c) {  // column vector v0 + c: half (v0 + c) / 2's bytes 32 ((v0 + c) % 2) on
              const int half = (v0 + c) / 2, at = 32 * ((v0 + c) % 2);
              const uint8_t* vp = w.w + ((static_cast<int64_t>(p) * 2 + half) * 8 + in_pair / 2) * 64;
              const uint8_t* hp =
                  BITS == 6 ? w.h + ((static_cast<int64_t>(p) * 2 + half) * 4 + in_pair / 4) * 64 : nullptr;
              if (ahead && at == 0) {  // this line, ahead
                __builtin_prefetch(vp + kQbPrefetchBytes, 0, 3);
                __builtin_prefetch(vp + kQbFarPrefetchBytes, 0, 2);
                if constexpr (BITS == 6)
                  if (in_pair % 4 == 0) {
                    __builtin_prefetch(hp + kQbPrefetchBytes / 2, 0, 3);
                    __builtin_prefetch(hp + kQbFarPrefetchBytes / 2, 0, 2);
                  }
              }
              const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp + at));
              lo[c] = _mm256_and_si256(b, low4);
              hi[c] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
              if constexpr (BITS == 6) {  // bit pairs q and q + 1 (q = in_pair % 4) to bits 4-5
                const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hp + at));
                const bool q2 = in_pair % 4 != 0;
                lo[c] = _mm256_or_si256(lo[c], _mm256_and_si256(q2 ? h : _mm256_slli_epi32(h, 4), bits45));
                hi[c] = _mm256_or_si256(
                    hi[c], _mm256_and_si256(q2 ? _mm256_srli_epi32(h, 2) : _mm256_slli_epi32(h, 2), bits45));
              }
            }
            SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
              const __m256i xa = broadcast4x8(x[r] + 4 * step), xb = broadcast4x8(x[r] + 4 * step + 4);
              for (int c = 0; c < CV; ++c) {
                s16[r][c] = _mm256_add_epi16(s16[r][c], _mm256_maddubs_epi16(lo[c], xa));
                s16[r][c] = _mm256_add_epi16(s16[r][c], _mm256_maddubs_epi16(hi[c], xb));
              }
            }
          }
          SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) for (int c = 0; c < CV; ++c)
            td[r][c] = _mm256_add_epi32(td[r][c], _mm256_madd_epi16(s16[r][c], scale[c]));
        }
      }
      for (int c = 0; c < CV; ++c) {
        const int v = v0 + c;
        const __m256 sd = qp_multipliers8(w.sd + s0 * kQpCols + 8 * v);
        __m256 span[R];
        SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r)
          span[r] = _mm256_mul_ps(sd, _mm256_cvtepi32_ps(td[r][c]));
        if constexpr (!SYM) {  // T_m: the offsets by Q, two groups a vpmaddwd
          __m256i tm[R];
          SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) tm[r] = _mm256_setzero_si256();
          for (int j = 0; j < kSpanGroups / 2; ++j) {
            const int g = s0 * kSpanGroups + 2 * j;
            const int8_t* mg = w.m + static_cast<int64_t>(g) * kQpCols + 8 * v;
            const __m256i m = qp_scale_pairs(mg, mg + kQpCols);
            SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
              const __m256i q = _mm256_set1_epi32(a.qpair[static_cast<int64_t>(r0 + r) * ng + g / 2]);
              tm[r] = _mm256_add_epi32(tm[r], _mm256_madd_epi16(m, q));
            }
          }
          const __m256 sm = qp_multipliers8(w.sm + s0 * kQpCols + 8 * v);
          SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r)
            span[r] = _mm256_fmadd_ps(sm, _mm256_cvtepi32_ps(tm[r]), span[r]);
        }
        SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
          const __m256 dx = _mm256_set1_ps(a.dx[static_cast<int64_t>(r0 + r) * a.spans + s0]);
          float* o = out[r] + 8 * v;
          const __m256 prev = s0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(o);
          _mm256_storeu_ps(o, _mm256_fmadd_ps(span[r], dx, prev));
        }
      }
    }
  }
}
#endif

// The panel unpacked into the GEMM's own (qblock_gemm.h's GemmPanel: values as bytes in
// vpdpbusd's order, d and m as fp32, the products qp_rows forms): from kQpUnpackRows
// rows on, every block of rows then reads bytes instead of unpacking nibbles and high
// bits again. Without it 6 bits at 64 rows took 1.2x the GEMM's time; with it, 24 rows
// took ~1.15x what unpacking per block of rows did, 64 rows ~0.9x (the 1.5B's gate/up
// and down shapes, 2 cores of Zen 4, ad hoc).
constexpr int kQpUnpackRows = 40;
// Activation rows one pass of qp_rows serves (the GEMM's kGemmRows is 4): a verifying
// step of 4 drafts (5 rows) then unpacks each panel once instead of twice. 5 rows on a
// 7B gate/up-sized Q4_K weight took 2.96 -> 2.66 ms, on its Q6_K down 2.2-2.6 -> 1.8 ms;
// 16 rows about the same (2 cores of Zen 4, ad hoc). The group and span sums of 8 rows
// take all 32 registers; the totals live in `out`.
// At avx2 too, though its 16 registers hold the int16 and int32 sums of 4 rows: 8 a
// pass (some sums in memory, touched once a group) unpack the nibbles half as often,
// 256 rows on the 1.5B's Q4_K gate/up 36.7 -> 35.1 ms, on its Q6_K down 31.0 -> 29.2
// (best of 3 alternating runs; 6 rows between).
constexpr int kQpRows = 8;

template <int BITS, int G>
void qp_unpack(const QpPanel& w, int K, GemmPanel& out) {
  const int ng = K / G;
  out.u.resize(static_cast<size_t>(K) * kQpCols);
  out.d.resize(static_cast<size_t>(ng) * kQpCols);
  if (w.m) out.m.resize(out.d.size());
  for (int64_t v = 0; v < static_cast<int64_t>(K) / 4; ++v) {  // 2 steps of 16 rows a vector
    const int64_t p = v / 16, half = (v / 8) % 2, i = v % 8;    // of pair p's half
    const uint8_t* b = w.w + v * 64;
    uint8_t* lo = out.u.data() + ((16 * p + 2 * i) * 2 + half) * 64;
    uint8_t* hi = lo + 128;
    const uint8_t* h = BITS == 6 ? w.h + ((p * 2 + half) * 4 + i / 2) * 64 : nullptr;
    const int q = 2 * (i % 2);  // the low step's bit pair in h
#if defined(SLUICE_ISA_AVX512)
    const __m512i low4 = _mm512_set1_epi8(0x0F), bv = _mm512_loadu_si512(b);
    __m512i l = _mm512_and_si512(bv, low4), u = _mm512_and_si512(_mm512_srli_epi16(bv, 4), low4);
    if constexpr (BITS == 6) {  // as qp_rows: bit pairs q and q + 1 to bits 4-5
      const __m512i hv = _mm512_loadu_si512(h);
      l = qp_high(l, q ? hv : _mm512_slli_epi32(hv, 4));
      u = qp_high(u, q ? _mm512_srli_epi32(hv, 2) : _mm512_slli_epi32(hv, 2));
    }
    _mm512_storeu_si512(lo, l);
    _mm512_storeu_si512(hi, u);
#else
    for (int j = 0; j < 64; ++j) {
      lo[j] = static_cast<uint8_t>(b[j] & 0x0F);
      hi[j] = static_cast<uint8_t>(b[j] >> 4);
      if (BITS == 6) {
        lo[j] |= static_cast<uint8_t>(((h[j] >> (2 * q)) & 3) << 4);
        hi[j] |= static_cast<uint8_t>(((h[j] >> (2 * q + 2)) & 3) << 4);
      }
    }
#endif
  }
  for (int g = 0; g < ng; ++g)
    for (int c = 0; c < kQpCols; ++c) {
      const int at = g * kQpCols + c, sat = g / (kQbSuper / G) * kQpCols + c;
      out.d[at] = qb_half(w.sd[sat]) * static_cast<float>(w.d[at]);
      if (w.m) out.m[at] = qb_half(w.sm[sat]) * static_cast<float>(w.m[at]);
    }
}

// y rows first .. first + M (N values each) = a's rows first .. first + M times the
// panel weight; the panels are shared out by an orphaned `omp for` (every thread of a
// parallel region calls this; `wait` false: no barrier at its end).
template <int BITS, int G>
void qpanel_rows_t(const GemmActivations& a, int M, int K, const QbWeight& wt, int N, QbOut y,
                   int first = 0, bool wait = true) {
  const bool sym = wt.m == nullptr;
  const int panels = (N + kQpCols - 1) / kQpCols;
  alignas(64) float out[kQpRows][kQpCols];
#if defined(SLUICE_ISA_AVX512)
  const bool unpack = M >= kQpUnpackRows;
#elif defined(SLUICE_ISA_AVX2)
  const bool unpack = false;  // its sums are its own: every row count runs qp_rows
#else
  const bool unpack = true;  // the portable level runs the GEMM's own loop on every panel
#endif
  GemmPanel unpacked;
  auto body = [&](int p) {
    const QpPanel w = qp_panel<BITS, G>(wt, K, p);
    const int n0 = p * kQpCols, cols = std::min(kQpCols, N - n0);
    SidePrefetch next{};  // the thread's next panel (static schedule: p + 1), into L2
    if (unpack) {
      qp_unpack<BITS, G>(w, K, unpacked);
      if (p + 1 < panels)
        next = side_prefetch_runs(w.w + qp_packed_bytes(K), qp_packed_bytes(K),
                                  w.h ? w.h + qp_hbits_bytes(BITS, K) : nullptr,
                                  qp_hbits_bytes(BITS, K));
    }
    constexpr int kSpanGroups = kQbSuper / G;
    const int block = unpack ? kGemmRows : kQpRows;
    const int passes = (M + block - 1) / block;
    for (int i = 0, r0 = 0; i < passes; ++i) {
      // Passes of equal rows (12 rows: two of 6 on the panel, three of 4 unpacked).
      const int rows = (M - r0 + passes - i - 1) / (passes - i);
      qb_with_rows<kQpRows>(rows, [&](auto R) {
        if constexpr (R <= kGemmRows) {
          if (unpack) {
            if (sym)
              gemm_rows<G, kSpanGroups, true, R>(unpacked, a, first + r0, K, out, next);
            else
              gemm_rows<G, kSpanGroups, false, R>(unpacked, a, first + r0, K, out, next);
            return;
          }
        }
#if defined(SLUICE_ISA_AVX512) || defined(SLUICE_ISA_AVX2)
        if (sym)
          qp_rows<BITS, G, true, R>(w, a, first + r0, K, out, r0 == 0);
        else
          qp_rows<BITS, G, false, R>(w, a, first + r0, K, out, r0 == 0);
#endif
      });
      for (int r = 0; r < rows; ++r)
        y.typed(static_cast<int64_t>(first + r0 + r) * N + n0, [&](auto* yr) {
          for (int c = 0; c < cols; ++c) yr[c] = round_to(yr + c, out[r][c]);
        });
      r0 += rows;
    }
  };
  if (wait) {
#pragma omp for schedule(static)
    for (int p = 0; p < panels; ++p) body(p);
  } else {
#pragma omp for schedule(static) nowait
    for (int p = 0; p < panels; ++p) body(p);
  }
}

// The panel formats: Q4_K (4 bits, groups of 32) and Q6_K (6 bits, groups of 16).
#define SLUICE_QP_DISPATCH(bits, group, call)                          \
  switch ((bits) * 100 + (group)) {                                    \
    case 432: { constexpr int B = 4, G = 32; call; } break;            \
    case 616: { constexpr int B = 6, G = 16; call; } break;            \
    default: break; /* the bindings reject other formats */            \
  }

inline bool qp_format(int bits, int group) {
  return (bits == 4 && group == 32) || (bits == 6 && group == 16);
}

// y [M, N] = x @ W.T on the panel weight (every thread of a parallel region calls it;
// x quantized into `a` first, as qblock_gemm quantizes it).
template <typename T>
void qpanel_matmul(const T* x, int M, int K, int bits, int group, const QbWeight& w, int N,
                   QbOut y, GemmActivations& a) {
  gemm_quantize(x, M, K, kQbSuper, group, qb_implied(bits), w.m == nullptr, a);
  SLUICE_QP_DISPATCH(bits, group, (qpanel_rows_t<B, G>(a, M, K, w, N, y)))
}

// Stacked experts of N rows each (a multiple of 32) in panel order: group j's rows
// start[j] .. start[j + 1] of `a` (quantized) and y times expert[j]'s weight, the
// groups' panels shared out without barriers between them; barrier at the end.
// Defined in qpanel.cpp, as are qpanel_matmul's instances (below).
void qpanel_experts(const GemmActivations& a, int K, int bits, int group, const QbWeight& w,
                    int N, int num_groups, const int64_t* start, const int64_t* expert,
                    QbOut y);

// One compiled copy of the entry points decode_stack.cpp calls too, in qpanel.cpp (as
// SLUICE_QBLOCK_INSTANCES, qblock.h): the stack's file then compiles none of the panel
// kernel's instances (they had added a quarter to its compile time).
#define SLUICE_QPANEL_INSTANCES(prefix, T)                                                \
  prefix template void qpanel_matmul<T>(const T*, int, int, int, int, const QbWeight&, int, \
                                        QbOut, GemmActivations&);
SLUICE_QPANEL_INSTANCES(extern, float)
SLUICE_QPANEL_INSTANCES(extern, uint16_t)

}  // namespace sluice
