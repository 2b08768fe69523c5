// The int8 GEMM (qblock_gemm.h) on AMX-INT8 tiles, for the row counts between the
// block kernel and the bf16 AMX kernel (a dozen streams decoding, a verifying step, a
// short prompt). The VNNI GEMM spends one vpdpbusd on 64 products; a tile multiply
// makes 16 x 16 x G of them (G = 16 or 32: one weight group, since each group has its
// own scale), so what is left per group is applying the scales to 16 x 16 int32 sums.
//
// The roles are the transpose of the VNNI GEMM's: the tile's rows are 16 weight rows
// (output columns), so the weight goes in as unpacked, in natural K order, with no
// transpose; the activations are what gets rearranged (once a call, into the tile's
// 4-byte interleave), and a sum tile's row is one output column for 16 activation
// rows. A group's scale d[n, g] is then one broadcast per sum row, and the activation
// rows' span scales and sums Q[r, g] are vectors shared by all 16 sum rows.
//
// Symmetric weights go in as signed values (u - 2^(bits-1)) and take the signed x
// signed multiply, which is the VNNI GEMM's u * q plus its implied * Q start, exactly;
// weights with offsets take unsigned x signed and their m * Q term. The integer sums
// are the VNNI GEMM's, and the float steps are applied in its order, so the two agree
// bit for bit (tests/test_qblock_kernels.py).
//
// Tiles (palette 1): 0-1 weights (16 rows x G values), 2-3 activations (G / 4 steps x
// 16 rows x 4 values), 4-5 sums (16 columns x 16 rows, int32); two groups in flight.
// Only the avx512 library has it (function target attributes), called where the caller
// holds the tile state on a CPU with AMX-INT8 (the `amx` level: sluice/kernels/cpu.py).
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "qblock_amx.h"
#include "qblock_gemm.h"

namespace sluice {

#if defined(SLUICE_AMX)
#define SLUICE_AMX_INT8_FN __attribute__((target("amx-tile,amx-int8")))

constexpr int kTileLanes = 16;    // activation rows of a block: the lanes of a sum row
constexpr int kTileWRows = 16;    // weight rows (output columns) of a pass
constexpr int kTileChunk = 256;   // K values of the weight unpacked at a time

constexpr AmxTileConfig amx_int8_config(int G) {
  AmxTileConfig c;
  for (int t = 0; t < 2; ++t) c.rows[t] = kTileWRows, c.colsb[t] = static_cast<uint16_t>(G);
  for (int t = 2; t < 4; ++t) c.rows[t] = static_cast<uint8_t>(G / 4), c.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) c.rows[t] = kTileWRows, c.colsb[t] = 64;
  return c;
}

// Constants in memory, as kAmxTileConfig (qblock_amx.h), one per group size.
inline constexpr AmxTileConfig kAmxInt8Config16 = amx_int8_config(16);
inline constexpr AmxTileConfig kAmxInt8Config32 = amx_int8_config(32);

// Calls that ran on the int8 tiles (per thread's share): a test's evidence.
inline std::atomic<int64_t> amx_int8_calls{0};

// a's rows in the tiles' order, per block b of 16 rows: tq [b][K / 4][16][4] (rows past
// M zero), and as 16-lane vectors per span and group: tdx [b][spans][16] and, for a
// weight with offsets, tqsum [b][groups][16] (every thread calls this; barrier at end).
inline void amx_int8_rows(int M, int K, bool symmetric, GemmActivations& a) {
  const int blocks = (M + kTileLanes - 1) / kTileLanes, steps = K / 64;
#pragma omp single
  {
    a.tq.resize(static_cast<size_t>(blocks) * K * kTileLanes);
    a.tdx.assign(static_cast<size_t>(blocks) * a.spans * kTileLanes, 0.f);
    if (!symmetric) a.tqsum.assign(static_cast<size_t>(blocks) * a.groups * kTileLanes, 0.f);
  }
#pragma omp for schedule(static)
  for (int t = 0; t < blocks * steps; ++t) {
    const int b = t / steps, k0 = t % steps * 64;
    __m512i v[16];  // row i's 64 values as 16 int32 lanes of 4
    for (int i = 0; i < 16; ++i) {
      const int r = b * kTileLanes + i;
      v[i] = r < M ? _mm512_loadu_si512(a.row(r) + k0) : _mm512_setzero_si512();
    }
    gemm_transpose16(v);  // v[j]: every row's values k0 + 4j .. k0 + 4j + 3
    int8_t* dst = a.tq.data() + (static_cast<int64_t>(b) * K + k0) * kTileLanes;
    for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + 64 * j, v[j]);
  }
#pragma omp for schedule(static)
  for (int r = 0; r < M; ++r) {
    const int b = r / kTileLanes, lane = r % kTileLanes;
    for (int s = 0; s < a.spans; ++s)
      a.tdx[(static_cast<size_t>(b) * a.spans + s) * kTileLanes + lane] =
          a.dx[static_cast<size_t>(r) * a.spans + s];
    for (int g = 0; !symmetric && g < a.groups; ++g)
      a.tqsum[(static_cast<size_t>(b) * a.groups + g) * kTileLanes + lane] =
          a.qsum[static_cast<size_t>(r) * a.groups + g];
  }
}

// One thread's unpacked chunk of 16 weight rows: values (signed for a symmetric
// weight), and the chunk's groups' d and m per row.
struct alignas(64) AmxInt8Chunk {
  int8_t w[kTileWRows][kTileChunk];
  float d[kTileWRows][16];
  float m[kTileWRows][16];
  int32_t sums[2][kTileWRows][kTileLanes];
};

// Ask for the cache lines from `p` through `bytes` on (a region a later pass reads).
SLUICE_INLINE void amx_int8_prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
}

// The scales and offsets of weight rows n .. n + 15 (a later pass's): 16 rows' worth of
// each is one short contiguous run.
template <int BITS, int G, bool IQ>
SLUICE_INLINE void amx_int8_prefetch_scales(const QbWeight& wt, int K, int64_t n) {
  const QbRow r = wt.row<BITS, G, IQ>(K, n);
  const int64_t bytes = static_cast<int64_t>(kTileWRows) * (K / G) * (IQ ? 1 : 2);
  amx_int8_prefetch(r.d, bytes);
  if (r.m) amx_int8_prefetch(r.m, bytes);
  if constexpr (IQ) amx_int8_prefetch(r.sd, kTileWRows * (K / kQbSuper) * (r.m ? 4 : 2));
}

// K values c0 .. c0 + len of the `live` rows w into c (rows past live stay as they were:
// zeroed by the caller). Each row's bytes two passes on (32 rows: with two threads
// taking passes in turn, usually this thread's next) are asked for as these are read;
// without it the unpacking waited on memory (perf: a third of the kernel's samples on
// the 1.5B's 16-stream steps): a row of a 1.5B linear is under a KB, so a row's own
// stream ends before the hardware prefetcher gets ahead of it. One pass ahead with a
// static schedule measured the same on single layers and left one thread waiting at
// the step's barriers (ad hoc).
template <int BITS, int G, bool IQ>
SLUICE_INLINE void amx_int8_unpack(const QbRow* w, int live, int K, int c0, int len,
                                   bool symmetric, AmxInt8Chunk& c) {
  const int p0 = c0 / 64, np = len / 64, ng = len / G;
  const __m512i offset = _mm512_set1_epi8(static_cast<char>(symmetric ? -qb_implied(BITS) : 0));
  const __mmask16 k = static_cast<__mmask16>((1u << ng) - 1);
  constexpr int pair_bytes = BITS == 8 ? 64 : 32, hpair_bytes = BITS == 5 ? 8 : 16;
  const int64_t ahead = 2 * kTileWRows * qb_row_bytes(BITS, K);
  const int64_t hahead = 2 * kTileWRows * qb_hbits_row_bytes(BITS, K);
  for (int i = 0; i < live; ++i) {
    amx_int8_prefetch(w[i].w + ahead + pair_bytes * p0, pair_bytes * np);
    if constexpr (BITS == 5 || BITS == 6)
      amx_int8_prefetch(w[i].h + hahead + hpair_bytes * p0, hpair_bytes * np);
    for (int p = p0; p < p0 + np; ++p) {
      const __m512i u = qb_unpack<BITS>(w[i], p);
      const __m512i natural = _mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 2, 0));
      _mm512_store_si512(c.w[i] + (p - p0) * 64, _mm512_sub_epi8(natural, offset));
    }
    _mm512_store_ps(c.d[i], qb_groups16<G, IQ>(w[i].d, w[i].sd, c0 / G, k));
    if (!symmetric) _mm512_store_ps(c.m[i], qb_groups16<G, IQ>(w[i].m, w[i].sm, c0 / G, k));
  }
}

// Group h (0 or 1 of the pair just stored) of the chunk into the span sums sp; at a
// span's end, acc[i] += sp[i] * dx (acc: [16 columns][16 rows]).
template <int G, int SPAN_GROUPS, bool SYM>
SLUICE_INLINE void amx_int8_scale(const AmxInt8Chunk& c, const GemmActivations& a, int b,
                                  int gl, int g, int h, __m512* sp, float* acc) {
  const bool first = g % SPAN_GROUPS == 0;
  for (int i = 0; i < kTileWRows; ++i) {
    const __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(c.sums[h][i]));
    const __m512 d = _mm512_set1_ps(c.d[i][gl]);
    sp[i] = first ? _mm512_mul_ps(s, d) : _mm512_fmadd_ps(s, d, sp[i]);
  }
  if constexpr (!SYM) {
    const __m512 q = _mm512_loadu_ps(a.tqsum.data() + (static_cast<int64_t>(b) * a.groups + g) * kTileLanes);
    for (int i = 0; i < kTileWRows; ++i) sp[i] = _mm512_fmadd_ps(_mm512_set1_ps(c.m[i][gl]), q, sp[i]);
  }
  if (g % SPAN_GROUPS == SPAN_GROUPS - 1) {
    const int s = g / SPAN_GROUPS;
    const __m512 dx = _mm512_loadu_ps(a.tdx.data() + (static_cast<int64_t>(b) * a.spans + s) * kTileLanes);
    for (int i = 0; i < kTileWRows; ++i) {
      float* ai = acc + i * kTileLanes;
      _mm512_storeu_ps(ai, _mm512_fmadd_ps(sp[i], dx, _mm512_loadu_ps(ai)));
    }
  }
}

// Row block b's products with the chunk at K value c0 (len values) into acc, two
// groups at a time (len / G is even: len is a multiple of 64).
template <int G, int SPAN_GROUPS, bool SYM>
SLUICE_AMX_INT8_FN SLUICE_INLINE void amx_int8_block(AmxInt8Chunk& c, const GemmActivations& a,
                                                     int b, int K, int c0, int len, float* acc) {
  const int8_t* xt = a.tq.data() + (static_cast<int64_t>(b) * K + c0) * kTileLanes;
  __m512 sp[kTileWRows];
  for (int gl = 0; gl < len / G; gl += 2) {
    SLUICE_AMX_FENCE();
    _tile_loadd(0, c.w[0] + gl * G, kTileChunk);
    _tile_loadd(2, xt + gl * G * kTileLanes, 64);
    _tile_loadd(1, c.w[0] + (gl + 1) * G, kTileChunk);
    _tile_loadd(3, xt + (gl + 1) * G * kTileLanes, 64);
    _tile_zero(4);
    _tile_zero(5);
    if constexpr (SYM) {
      _tile_dpbssd(4, 0, 2);
      _tile_dpbssd(5, 1, 3);
    } else {
      _tile_dpbusd(4, 0, 2);
      _tile_dpbusd(5, 1, 3);
    }
    _tile_stored(4, c.sums[0], 64);
    _tile_stored(5, c.sums[1], 64);
    SLUICE_AMX_FENCE();
    const int g = c0 / G + gl;
    amx_int8_scale<G, SPAN_GROUPS, SYM>(c, a, b, gl, g, 0, sp, acc);
    amx_int8_scale<G, SPAN_GROUPS, SYM>(c, a, b, gl + 1, g + 1, 1, sp, acc);
  }
}

// y [M, N] = x @ W.T on the tiles, x's M rows quantized into `a` (gemm_quantize_for; every
// thread of a parallel region calls this; blocks of 16 weight rows are shared out,
// each thread unpacking its own). y fp32 or bf16, chosen where each block is stored
// (QbOut): the format's instances serve both types, as the block kernel's do.
template <int BITS, int G, bool IQ>
SLUICE_AMX_INT8_FN void qblock_gemm_amx_t(int M, int K, const QbWeight& wt, int N, QbOut y,
                                          GemmActivations& a) {
  constexpr int span = IQ ? kQbSuper : 32;
  const bool sym = wt.m == nullptr;
  amx_int8_rows(M, K, sym, a);
  amx_int8_calls.fetch_add(1, std::memory_order_relaxed);
  _tile_loadconfig(G == 16 ? &kAmxInt8Config16 : &kAmxInt8Config32);
  const int blocks = (M + kTileLanes - 1) / kTileLanes;
  std::vector<float> acc(static_cast<size_t>(blocks) * kTileWRows * kTileLanes);
  AmxInt8Chunk c;
#pragma omp for schedule(dynamic, 1)
  for (int n0 = 0; n0 < N; n0 += kTileWRows) {
    const int live = std::min(kTileWRows, N - n0);
    QbRow w[kTileWRows];
    for (int i = 0; i < live; ++i) w[i] = wt.row<BITS, G, IQ>(K, n0 + i);
    if (n0 + 2 * kTileWRows < N)
      amx_int8_prefetch_scales<BITS, G, IQ>(wt, K, n0 + 2 * kTileWRows);
    if (live < kTileWRows) std::memset(&c, 0, sizeof(c));  // rows past N: zeros
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int c0 = 0; c0 < K; c0 += kTileChunk) {
      const int len = std::min(kTileChunk, K - c0);
      amx_int8_unpack<BITS, G, IQ>(w, live, K, c0, len, sym, c);
      for (int b = 0; b < blocks; ++b) {
        float* ab = acc.data() + static_cast<int64_t>(b) * kTileWRows * kTileLanes;
        if (sym)
          amx_int8_block<G, span / G, true>(c, a, b, K, c0, len, ab);
        else
          amx_int8_block<G, span / G, false>(c, a, b, K, c0, len, ab);
      }
    }
    for (int r = 0; r < M; ++r) {
      const float* ar = acc.data() + static_cast<int64_t>(r / kTileLanes) * kTileWRows * kTileLanes;
      const int lane = r % kTileLanes;
      y.typed(static_cast<int64_t>(r) * N + n0, [&](auto* yr) {
        for (int i = 0; i < live; ++i) yr[i] = round_to(yr + i, ar[i * kTileLanes + lane]);
      });
    }
  }
  _tile_release();
}

// y [M, N] = x @ W.T on the tiles for the runtime format, x quantized first (every
// thread of a parallel region calls this). The format's instances of the tile loop do
// not depend on x's type either: one copy, in qblock_gemm.cpp, for the GEMM and the
// output head (qblock.cpp).
template <typename T>
void qblock_gemm_amx(const T* x, int M, int K, int bits, int group, const QbWeight& w, int N,
                     QbOut y, GemmActivations& a) {
  gemm_quantize_for(x, M, K, bits, group, w, a);
  SLUICE_QB_DISPATCH(bits, group, w.s != nullptr,
                     (qblock_gemm_amx_t<B, G, IQ>(M, K, w, N, y, a)))
}
#endif  // SLUICE_AMX

// y [M, N] = x @ W.T for many rows: on the AMX-INT8 tiles where `tiles` (the caller
// holds the tile state on a CPU with AMX-INT8) and this library has them, else the
// VNNI / portable GEMM; the same sums either way (every thread of a parallel region
// calls this).
template <typename T>
void qblock_gemm_on(bool tiles, const T* x, int M, int K, int bits, int group,
                    const QbWeight& w, int N, QbOut y, GemmActivations& a) {
#if defined(SLUICE_AMX)
  if (tiles) return qblock_gemm_amx(x, M, K, bits, group, w, N, y, a);
#else
  (void)tiles;
#endif
  qblock_gemm(x, M, K, bits, group, w, N, y, a);
}

// One compiled copy, in qblock_gemm.cpp (as SLUICE_QBLOCK_INSTANCES, qblock.h).
#define SLUICE_QBLOCK_GEMM_INSTANCES(prefix, T)                                          \
  prefix template void qblock_gemm_on<T>(bool, const T*, int, int, int, int,             \
                                         const QbWeight&, int, QbOut, GemmActivations&);
SLUICE_QBLOCK_GEMM_INSTANCES(extern, float)
SLUICE_QBLOCK_GEMM_INSTANCES(extern, uint16_t)
#if defined(SLUICE_AMX)
#define SLUICE_QBLOCK_GEMM_AMX_INSTANCES(prefix, T)                                      \
  prefix template void qblock_gemm_amx<T>(const T*, int, int, int, int, const QbWeight&,  \
                                          int, QbOut, GemmActivations&);
SLUICE_QBLOCK_GEMM_AMX_INSTANCES(extern, float)
SLUICE_QBLOCK_GEMM_AMX_INSTANCES(extern, uint16_t)
#endif

}  // namespace sluice
