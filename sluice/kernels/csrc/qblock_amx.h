// The many-row matmul of bf16 activations by a qblock weight on AMX tiles (Intel, from
// Sapphire Rapids): the weight dequantized to bf16 a panel of 32 rows at a time, in the
// pair order the tile multiply takes, and each panel applied to every activation row
// with fp32 sums that stay in the tiles over the whole of K. It computes what the dense
// path does (dequantized bf16 weight tiles + torch's bf16 GEMM, which oneDNN runs on
// the same tiles), without writing the dequantized weight to memory and without
// oneDNN repacking that weight on every call, which is where its time went here.
//
// Tiles (palette 1): 0-3 sums (row tile t, column vector v: 2t + v, 16 x 16 fp32),
// 4-5 activations (16 rows x 32 K values), 6-7 weights (16 K pairs x 16 columns x 2).
// A tile multiply covers 16 x 16 x 32 products (vpdpbf16ps: 16 x 2).
//
// Only the avx512 library has it (function target attributes, so nothing else in the
// build may use AMX), and sluice calls it only at the `amx` level, where the kernel has
// granted the process the tile state (sluice/kernels/cpu.py).
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>

#include "dtype.h"
#include "isa.h"
#include "qblock.h"
#include "qblock_float.h"
#include "qblock_gemm.h"  // gemm_transpose16

#if defined(SLUICE_ISA_AVX512) && (__GNUC__ >= 11 || __clang_major__ >= 12)
#define SLUICE_AMX 1
#define SLUICE_AMX_FN __attribute__((target("amx-tile,amx-bf16,avx512bf16")))

namespace sluice {

constexpr int kAmxCols = 32;      // output columns of a panel: two tiles of 16
constexpr int kAmxTileRows = 16;  // activation rows of a tile
constexpr int kAmxK = 32;         // K values of one tile multiply
constexpr int kAmxChunk = 256;    // K values dequantized at a time (a super-block)

struct alignas(64) AmxTileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr AmxTileConfig amx_tile_config() {
  AmxTileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = kAmxTileRows, c.colsb[t] = 64;
  return c;
}

// A constant in memory: the load instruction is inline assembly that declares only its
// first 8 bytes as read, so a configuration built on the stack could lose the stores
// of the rest (llama.cpp's AMX path died of that: its PR #26954).
inline constexpr AmxTileConfig kAmxTileConfig = amx_tile_config();

// The tile instructions are inline assembly without a memory clobber: plain loads and
// stores of what they read or write must not move across them.
#define SLUICE_AMX_FENCE() __asm__ volatile("" ::: "memory")

// Calls that ran on the tiles (per thread's share): a test's evidence that the path ran.
inline std::atomic<int64_t> amx_calls{0};

// The bf16 activations in the order the tiles load them: tile t of 16 rows, K step s
// (32 values) at x[(t * K / 32 + s) * 512], its 16 rows of 32 values contiguous (1 KB a
// tile load, one stream, where rows of the caller's layout were 16 streams a load);
// rows past M up to a multiple of 16 are zeros.
struct AmxActivations {
  std::unique_ptr<uint16_t[]> x;  // uninitialized: every row is written (copied or zeroed)
  int steps = 0;                  // K / 32
  uint16_t* tile(int t, int s) const {
    return x.get() + (static_cast<int64_t>(t) * steps + s) * kAmxTileRows * kAmxK;
  }
};

inline void amx_copy_rows(const uint16_t* x, int M, int K, AmxActivations& a) {
  const int padded = (M + kAmxTileRows - 1) / kAmxTileRows * kAmxTileRows;
#pragma omp single
  {
    a.steps = K / kAmxK;
    a.x.reset(new uint16_t[static_cast<size_t>(padded) * K]);
  }  // implicit barrier: the buffer exists before any row is copied
#pragma omp for schedule(static)
  for (int r = 0; r < padded; ++r) {
    for (int s = 0; s < a.steps; ++s) {
      uint16_t* dst = a.tile(r / kAmxTileRows, s) + (r % kAmxTileRows) * kAmxK;
      if (r < M)
        std::memcpy(dst, x + static_cast<int64_t>(r) * K + s * kAmxK, sizeof(uint16_t) * kAmxK);
      else
        std::memset(dst, 0, sizeof(uint16_t) * kAmxK);
    }
  }
}

// Pairs p0 .. p0 + count of weight row w in natural order as bf16 (round to nearest
// even, as the dense path's dequantization rounds).
template <int BITS, int G, bool IQ>
SLUICE_AMX_FN SLUICE_INLINE void amx_dequantize_pairs(const QbRow& w, int p0, int count,
                                                      uint16_t* out) {
  alignas(64) uint8_t buf[64];
  for (int p = p0; p < p0 + count; ++p) {
    const uint8_t* u = qb_pair_bytes<BITS>(w, p, buf);
    float d[4], m[4];
    qb_pair_dm<BITS, G, IQ>(w, p, d, m);
    for (int j = 0; j < 4; ++j) {
      const __m512 v = qb_run<BITS>(w, p, j, u, d[j], m[j]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + qb_run_k(p - p0, j)),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    }
  }
}

// Columns n0 .. n0 + 31 of the weight as bf16 in the tiles' order: K pair k2 of column
// vector v at panel[(k2 * 2 + v) * 32 ..], 16 columns x (K value 2 k2, 2 k2 + 1).
// Columns past N are zeros.
template <int BITS, int G, bool IQ>
SLUICE_AMX_FN void amx_pack(const QbWeight& wt, int K, int N, int n0, uint16_t* panel) {
  alignas(64) uint16_t rows[kAmxCols][kAmxChunk];
  uint32_t* dst = reinterpret_cast<uint32_t*>(panel);
  for (int k0 = 0; k0 < K; k0 += kAmxChunk) {
    const int len = std::min(kAmxChunk, K - k0);  // a multiple of 64
    for (int c = 0; c < kAmxCols; ++c) {
      if (n0 + c < N)
        amx_dequantize_pairs<BITS, G, IQ>(wt.row<BITS, G, IQ>(K, n0 + c), k0 / 64, len / 64, rows[c]);
      else
        std::fill_n(rows[c], len, uint16_t{0});
    }
    // 16 columns x 16 pairs at a time: each column's pairs a vector, transposed.
    for (int v = 0; v < 2; ++v) {
      for (int j0 = 0; j0 < len; j0 += 32) {
        __m512i t[16];
        for (int i = 0; i < 16; ++i) t[i] = _mm512_loadu_si512(rows[16 * v + i] + j0);
        gemm_transpose16(t);
        const int k2 = (k0 + j0) / 2;
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (static_cast<int64_t>(k2 + i) * 2 + v) * 16, t[i]);
      }
    }
  }
}

// Sums of a panel's 32 columns over K values k0 .. k1 for rows r0 .. r0 + 16 * RT (the
// padding past M included), added to acc[r0 ..][32] fp32 (`first`: written instead).
template <int RT>
SLUICE_AMX_FN SLUICE_INLINE void amx_rows(const uint16_t* panel, const AmxActivations& a, int r0,
                                          int k0, int k1, bool first, float* acc) {
  const int t0 = r0 / kAmxTileRows;
  float* c0 = acc + static_cast<int64_t>(r0) * kAmxCols;
  float* c1 = c0 + kAmxTileRows * kAmxCols;
  constexpr int cs = kAmxCols * 4;  // bytes from one row of sums to the next
  SLUICE_AMX_FENCE();
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (RT == 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, c0, cs);
    _tile_loadd(1, c0 + 16, cs);
    if constexpr (RT == 2) {
      _tile_loadd(2, c1, cs);
      _tile_loadd(3, c1 + 16, cs);
    }
  }
  for (int k = k0; k < k1; k += kAmxK) {
    const uint16_t* wp = panel + static_cast<int64_t>(k) * kAmxCols;  // pair k / 2
    _tile_loadd(6, wp, 128);
    _tile_loadd(7, wp + 32, 128);
    _tile_loadd(4, a.tile(t0, k / kAmxK), kAmxK * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) {
      _tile_loadd(5, a.tile(t0 + 1, k / kAmxK), kAmxK * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c0, cs);
  _tile_stored(1, c0 + 16, cs);
  if constexpr (RT == 2) {
    _tile_stored(2, c1, cs);
    _tile_stored(3, c1 + 16, cs);
  }
  SLUICE_AMX_FENCE();
}

// Panels a thread takes at a time. The activations are what the tiles wait for: each
// panel streams all of them (a 512-row prompt through Qwen2.5-7B's down projection: 19
// MB, from L3), so a thread's panels take each block of them in turn while it is in
// L2. Where K is long (> kAmxSliceOver), a pass covers kAmxSlice values of K, so the
// block (32 rows x 1024 values, 64 KB) stays there across the group. On that down
// projection 4 panels and slices of 1024 took about two thirds of one panel's time;
// slices on the 7B's gate projection (K 3584) gained nothing measurable.
constexpr int kAmxGroup = 4;
constexpr int kAmxSlice = 1024;
constexpr int kAmxSliceOver = 4096;

// y [M, N] = x @ W.T, bf16 (every thread of a parallel region calls this; groups of
// panels are shared out, each thread dequantizing its own).
template <int BITS, int G, bool IQ>
SLUICE_AMX_FN void qblock_amx_t(const uint16_t* x, int M, int K, const QbWeight& wt, int N,
                                uint16_t* y, AmxActivations& a) {
  amx_copy_rows(x, M, K, a);
  amx_calls.fetch_add(1, std::memory_order_relaxed);
  _tile_loadconfig(&kAmxTileConfig);
  const int padded = (M + kAmxTileRows - 1) / kAmxTileRows * kAmxTileRows;
  const int slice = K > kAmxSliceOver ? kAmxSlice : K;
  const int64_t panel_size = static_cast<int64_t>(K) * kAmxCols;
  const int64_t acc_size = static_cast<int64_t>(padded) * kAmxCols;
  // Scratch, written before it is read (a zero-filled vector cost a pass over 5 MB).
  const std::unique_ptr<uint16_t[]> panels(new uint16_t[panel_size * kAmxGroup]);
  const std::unique_ptr<float[]> acc(new float[acc_size * kAmxGroup]);
  constexpr int span = kAmxGroup * kAmxCols;
#pragma omp for schedule(dynamic, 1)
  for (int g0 = 0; g0 < N; g0 += span) {
    const int count = std::min(kAmxGroup, (N - g0 + kAmxCols - 1) / kAmxCols);
    SLUICE_AMX_FENCE();
    for (int p = 0; p < count; ++p)
      amx_pack<BITS, G, IQ>(wt, K, N, g0 + p * kAmxCols, panels.get() + p * panel_size);
    for (int k0 = 0; k0 < K; k0 += slice) {
      const int k1 = std::min(K, k0 + slice);
      for (int r0 = 0; r0 < M; r0 += 2 * kAmxTileRows) {
        for (int p = 0; p < count; ++p) {
          const uint16_t* panel = panels.get() + p * panel_size;
          float* pacc = acc.get() + p * acc_size;
          if (M - r0 > kAmxTileRows)
            amx_rows<2>(panel, a, r0, k0, k1, k0 == 0, pacc);
          else
            amx_rows<1>(panel, a, r0, k0, k1, k0 == 0, pacc);
        }
      }
    }
    for (int p = 0; p < count; ++p) {
      const int n0 = g0 + p * kAmxCols, cols = std::min(kAmxCols, N - n0);
      for (int r = 0; r < M; ++r) {
        uint16_t* yr = y + static_cast<int64_t>(r) * N + n0;
        const float* ar = acc.get() + p * acc_size + static_cast<int64_t>(r) * kAmxCols;
        for (int c = 0; c < cols; ++c) yr[c] = round_to(yr + c, ar[c]);
      }
    }
  }
  _tile_release();
}

}  // namespace sluice
#endif
