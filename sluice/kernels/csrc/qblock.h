// Kernels of the qblock layouts: GGUF block-quantized weights kept quantized in memory
// (issue 13). W[n, k] = d[n, g] * u[n, k] + m[n, g], g = k / G, with u
// 4, 5, 6 or 8 bits, fp16 d and m per group of G = 16 or 32 values. A symmetric
// weight (Q4_0, Q5_0, Q8_0, Q6_K: the file stores no offsets) has no m: m =
// -2**(bits - 1) * d, its m pointer is null, and a float16 a group is saved.
//
// Integer scales (IQ; the K-quants, as their files hold them): d and m are int8 a
// group and each 256 values (a super-block: 8 groups of 32 or 16 of 16) add fp16
// multipliers, d[g] = sd[g * G / 256] * dq[g] and m[g] = sm[..] * mq[g] (exact in
// fp32). The super pointer s of a row holds sd [K / 256] then, unless symmetric, sm
// [K / 256]. Q4_K is then 4.625 bits a weight (5.0 with fp16 d and m; the file 4.5)
// and Q6_K 6.56 (7.0): 7% of the 1.5B model's bytes a decode step.
//
// 5 bits add a bit plane (bit i of a pair's uint64 is bit 4 of position i); 6 bits
// add 16 bytes a pair, byte i holding bits 4-5 of positions i, 16 + i, 32 + i and
// 48 + i in its bit pairs 0-1, 2-3, 4-5, 6-7: one run's high bits are one shift of
// the same 16 bytes, so every ISA level unpacks them with a shift and a mask.
//
// Along K the values sit in pairs of 32-blocks, 64 positions per pair, in four runs of
// 16: b0[0..15], b1[0..15], b0[16..31], b1[16..31] (the activations' order of
// quantize_rows, q4_matmul.h). A run is exactly one group of 16, or half a group of 32,
// so every run has one (d, m): run j of pair p is group 2p + (j & 1) when G = 32, and
// 4p + 2 * (j & 1) + (j >> 1) when G = 16.
//
// Entry points (qblock.cpp): matmul with int8 activations (a generalization of
// q4_rows: one weight pair is unpacked once and used by up to 12 activation rows, a
// pass over the weights per 12 rows beyond), matmul with unquantized
// activations (the output head), dequantization, and embedding rows.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dtype.h"
#include "isa.h"
#include "q4_matmul.h"
#include "side_prefetch.h"

namespace sluice {

// The (d, m) group of run j of pair p, and where run j starts along natural K.
template <int G>
constexpr int qb_run_group(int p, int j) {
  return G == 32 ? 2 * p + (j & 1) : 4 * p + 2 * (j & 1) + (j >> 1);
}
constexpr int qb_run_k(int p, int j) { return 64 * p + 32 * (j & 1) + 16 * (j >> 1); }

// Bytes of one row of `packed` for `bits`, and of `hbits` (5 and 6 bits only).
constexpr int64_t qb_row_bytes(int bits, int K) { return bits == 8 ? K : K / 2; }
constexpr int64_t qb_hbits_row_bytes(int bits, int K) {
  return bits == 5 ? K / 8 : bits == 6 ? K / 4 : 0;
}

// Row u (natural order, K unsigned values) into the pair positions of the layout:
// position 32 b + 16 a + c holds value 32 a + 16 b + c of each 64 (qb_run_k); hbits
// only for 5 and 6 bits.
inline void qb_pack_row(const uint8_t* u, int K, int bits, uint8_t* packed, uint8_t* hbits) {
  uint8_t pos[64];
  for (int p = 0; p < K / 64; ++p) {
    const uint8_t* v = u + 64 * p;
    for (int c = 0; c < 16; ++c)
      pos[c] = v[c], pos[16 + c] = v[32 + c], pos[32 + c] = v[16 + c], pos[48 + c] = v[48 + c];
    if (bits == 8) {
      std::memcpy(packed + 64 * p, pos, 64);
      continue;
    }
    for (int i = 0; i < 32; ++i)
      packed[32 * p + i] = static_cast<uint8_t>((pos[i] & 0x0F) | ((pos[32 + i] & 0x0F) << 4));
    if (bits == 5)
      for (int j = 0; j < 8; ++j) {
        uint8_t byte = 0;
        for (int i = 0; i < 8; ++i) byte |= static_cast<uint8_t>(((pos[8 * j + i] >> 4) & 1) << i);
        hbits[8 * p + j] = byte;
      }
    if (bits == 6)
      for (int i = 0; i < 16; ++i) {
        uint8_t byte = 0;
        for (int j = 0; j < 4; ++j) byte |= static_cast<uint8_t>(((pos[16 * j + i] >> 4) & 3) << (2 * j));
        hbits[16 * p + i] = byte;
      }
  }
}

// MXFP4's values (gpt-oss's experts): 4-bit codes stored as 4-bit values are, each
// naming an E2M1 number; doubled as ggml keeps them they are integers -12..12, so the
// kernels unpack a code to u = value + 16 (kQbE2M1Values, 4..28) by a table lookup
// (vpshufb) and treat the weight as a symmetric 5-bit one, offset -16 d: a power of
// two, as every implied offset is, so the block kernel's and the GEMM's sums agree
// bit for bit (an offset of -12 d rounded differently in the two). kQbE2M1 is the
// format's code where kernels take a bit count: not a width; every `BITS == 5 / 6 / 8`
// test leaves it on the 4-bit paths, the lookup added where they unpack.
constexpr int kQbE2M1 = 20;
constexpr uint8_t kQbE2M1Values[16] = {16, 17, 18, 19, 20, 22, 24, 28,
                                       16, 15, 14, 13, 12, 10, 8,  4};

// The offset factor of a symmetric weight: m = qb_implied_m<BITS> * d (qb_implied for
// a run-time bit count).
constexpr int qb_implied(int bits) { return bits == kQbE2M1 ? -16 : -(1 << (bits - 1)); }
template <int BITS>
constexpr float qb_implied_m = static_cast<float>(qb_implied(BITS));

// Values a super-block of integer scales covers, and its pairs.
constexpr int kQbSuper = 256;
constexpr int kQbSuperPairs = kQbSuper / 64;

inline float qb_half(uint16_t h) {
#if defined(SLUICE_ISA_AVX512) || defined(SLUICE_ISA_AVX2)
  return _cvtsh_ss(h);
#else
  return half_to_float(h);
#endif
}

// Activations quantized as for q4_rows, plus what qblock needs: dx8, each pair's block
// scales as [dx0 x4, dx1 x4] (the lane pattern of a pair's int32 dot products, loaded
// with one broadcast), and sx16, dx * sum(qx) per group of 16 in natural order. For a
// weight with integer scales the rows take one scale per 256 values (`integer`): the
// kernels then sum a super-block's products, its int8 scales applied, in int32 and
// touch floats once a super-block a row instead of once a pair (dx still holds a scale
// per 32-block, a super-block's repeated). llama.cpp pairs its K-quants with Q8_K
// activations, one scale per 256, for the same reason.
struct QBlockActivations : Q4Activations {
  std::vector<float> dx8, sx16;
  // group: that of the qblock weight these rows meet (16 or 32), which of the extras
  // to make: sx16 only for 16, dx8 for several rows of float scales, and for one only
  // at AVX2, whose one-row step loads it (spreading dx cost a permute a pair; AVX-512
  // and generic scale one row by dx); 0 for rows only the int4 and int8 kernels read.
#if defined(SLUICE_ISA_AVX2)
  static constexpr bool kOneRowDx8 = true;
#else
  static constexpr bool kOneRowDx8 = false;
#endif
  template <typename T>
  void quantize(const T* x, int M, int K, int group = 16, bool integer = false) {
    Q4Activations::quantize(x, M, K, integer ? kQbSuper : 32);
    const int nb = K / 32;
    if (group != 0 && !integer && (M > 1 || kOneRowDx8)) {
      dx8.resize(static_cast<size_t>(M) * nb * 4);
      for (int64_t i = 0; i < static_cast<int64_t>(dx8.size()); ++i) dx8[i] = dx[i / 4];
    }
    if (group == 16) {
      sx16.resize(static_cast<size_t>(M) * nb * 2);
      for (int64_t b = 0; b < static_cast<int64_t>(M) * nb; ++b) {
        // Block b's low 16 values, then its high 16, in pair order.
        const int8_t* qb = q.data() + (b / 2) * 64 + (b % 2) * 16;
        int lo = 0, hi = 0;
        for (int i = 0; i < 16; ++i) {
          lo += qb[i];
          hi += qb[32 + i];
        }
        sx16[2 * b] = dx[b] * static_cast<float>(lo);
        sx16[2 * b + 1] = dx[b] * static_cast<float>(hi);
      }
    }
    if (M > 1 && K % 512 == 0) pad_rows(M, K);
  }

 private:
  // Row stride K + 64: rows 4 KiB apart (K = 4096: Llama-3-8B's, Mistral-7B's hidden
  // size) map to the same L1 sets, and a pass of R rows evicted its own rows (8 rows
  // over 18944 x 4096 Q4_K weights: 4% fewer cycles a pair padded, 2 cores of Zen 4).
  void pad_rows(int M, int K) {
    stride = K + 64;
    q.resize(static_cast<size_t>(M) * stride);
    for (int r = M - 1; r > 0; --r)  // back to front: a row moves only to later bytes
      std::memmove(q.data() + stride * r, q.data() + static_cast<int64_t>(K) * r, K);
  }
};

// One weight row's pointers.
struct QbRow {
  const uint8_t* w;    // packed
  const uint8_t* h;    // hbits (bits 5 and 6)
  const void* d;       // [K / G] fp16, or int8 with integer scales
  const void* m;       // [K / G] as d; null for a symmetric weight
  const uint16_t* sd;  // integer scales: [K / 256] fp16 multipliers of d
  const uint16_t* sm;  // ... and of m (null for a symmetric weight)
};

// A weight's pointers as the kernels take them: packed, hbits, d, m (see QbRow) and s,
// the integer scales' multipliers [N, 1 or 2, K / 256] (null for fp16 scales).
struct QbWeight {
  const uint8_t* packed;
  const uint8_t* hbits;
  const void* d;
  const void* m;
  const uint16_t* s;

  // Row n's pointers.
  template <int BITS, int G, bool IQ>
  QbRow row(int K, int64_t n) const {
    const int64_t hrow = qb_hbits_row_bytes(BITS, K);
    const int64_t off = n * (K / G) * (IQ ? 1 : 2);  // bytes into d and m
    const int64_t sup = K / kQbSuper;
    const uint16_t* sd = IQ ? s + n * sup * (m ? 2 : 1) : nullptr;
    return {packed + n * qb_row_bytes(BITS, K), hrow ? hbits + n * hrow : nullptr,
            static_cast<const uint8_t*>(d) + off,
            m ? static_cast<const uint8_t*>(m) + off : nullptr, sd, IQ && m ? sd + sup : nullptr};
  }
};

// Group g's scale (v = d, s = sd) or offset (v = m, s = sm) as fp32.
template <int G, bool IQ>
SLUICE_INLINE float qb_group(const void* v, const uint16_t* s, int g) {
  if constexpr (IQ)
    return qb_half(s[g / (kQbSuper / G)]) * static_cast<float>(static_cast<const int8_t*>(v)[g]);
  else
    return qb_half(static_cast<const uint16_t*>(v)[g]);
}

#if defined(SLUICE_ISA_AVX512) || defined(SLUICE_ISA_AVX2)
// v as computed: fast-math may not fold a multiplier of it into a later product
// (integer scales: for one activation row it merged sd into dx, for several it did
// not, and a row's result must not depend on the batch).
template <typename V>
SLUICE_INLINE V qb_keep(V v) {
  __asm__("" : "+x"(v));
  return v;
}

// The scales (or offsets) of pair p's groups in the low lanes: groups 2p, 2p + 1 (G =
// 32) or 4p .. 4p + 3 (G = 16). mult: the pair's super-block multiplier (integer
// scales; the matmuls read it once for the super-block's four pairs).
template <int G, bool IQ>
SLUICE_INLINE __m128 qb_pair_groups(const void* v, float mult, int p) {
  constexpr int n = 64 / G;  // groups a pair
  if constexpr (IQ) {
    int32_t raw = 0;
    std::memcpy(&raw, static_cast<const int8_t*>(v) + n * p, n);
    const __m128 q = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(raw)));
    return qb_keep(_mm_mul_ps(q, _mm_set1_ps(mult)));
  } else if constexpr (G == 32) {
    int32_t d2;
    std::memcpy(&d2, static_cast<const uint16_t*>(v) + 2 * p, sizeof(d2));
    return _mm_cvtph_ps(_mm_cvtsi32_si128(d2));
  } else {
    return _mm_cvtph_ps(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(v) + 4 * p)));
  }
}
#endif

// A pass of the int8-activation matmul (qb_rows_pass) streams every weight byte once:
// prefetch the packed bytes kQbPrefetchBytes ahead (past a row's end, the next row's,
// which the loop reads next). Each activation row adds instructions per weight byte,
// so fewer loads are in flight and the hardware prefetcher alone left the memory bus
// idle part of the time (the 1.5B model's decode step: -8%, a verifying step of 1-4
// drafts -10-15%; benchmarks/spec_cost.py).
constexpr int kQbPrefetchBytes = 1024;
template <int BITS>
constexpr int kQbPairBytes = BITS == 8 ? 64 : 32;  // packed bytes a pair
template <int BITS>
SLUICE_INLINE void qb_prefetch(const QbRow& w, int p) {
  const char* base = reinterpret_cast<const char*>(w.w) + kQbPairBytes<BITS> * p + kQbPrefetchBytes;
  __builtin_prefetch(base);
  if constexpr (BITS == 8) __builtin_prefetch(base + 64);
  // 6 bits' second stream, 16 bytes a pair: as far ahead in pairs as the packed bytes.
  if constexpr (BITS == 6) __builtin_prefetch(w.h + 16 * p + kQbPrefetchBytes / 2);
}

// A row pass's prefetch: qb_prefetch's into L1, and kQbFarPrefetchBytes ahead into L2
// only. Where an activation row is long (a down projection's K of 18944 values: 19 KB
// of int8 and its scales), it and the weight stream no longer fit L1 together, and
// the near prefetches' misses alone did not keep the bus busy: Qwen2.5-7B's down
// projections read at ~75% of the bandwidth the gate/up ones did. From L2 they read as
// fast as those, a 7B decode step ~14% faster (2 cores of Zen 4, ad hoc); K of 3584,
// the 1.5B, OLMoE and the AVX2 level were unchanged.
constexpr int kQbFarPrefetchBytes = 8192;
template <int BITS>
SLUICE_INLINE void qb_stream_prefetch(const QbRow& w, int p) {
  qb_prefetch<BITS>(w, p);
  const char* far = reinterpret_cast<const char*>(w.w) + kQbPairBytes<BITS> * p + kQbFarPrefetchBytes;
  __builtin_prefetch(far, 0, 2);  // locality 2: prefetcht1, into L2
  if constexpr (BITS == 8) __builtin_prefetch(far + 64, 0, 2);
  if constexpr (BITS == 6) __builtin_prefetch(w.h + 16 * p + kQbFarPrefetchBytes / 2, 0, 2);
}

// ---- Integer dot products: out[r] = sum_k W[k] x_r[k] for one weight row and R <= kQbRowBlock
// activation rows, minimum terms included. The per-row arithmetic does not depend on
// R, so a row's result is the same in any batch.

// R activation rows: pair-ordered int8 values, dx8, and dx * sum(qx) per weight group.
template <int R>
struct QbActRows {
  const int8_t* x[R];
  const float* dx[R];
  const float* dx8[R];
  const float* sx[R];
};

#if defined(SLUICE_ISA_AVX512)
// Pair p's 64 values u, byte i = position i.
template <int BITS>
SLUICE_INLINE __m512i qb_unpack(const QbRow& w, int p) {
  if constexpr (BITS == 8) {
    return _mm512_loadu_si512(w.w + 64 * p);
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.w + 32 * p));
    __m512i u = _mm512_and_si512(
        _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1),
        _mm512_set1_epi8(0x0F));
    if constexpr (BITS == kQbE2M1) {
      const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kQbE2M1Values));
      u = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(table), u);
    } else if constexpr (BITS == 5) {
      uint64_t hb;
      std::memcpy(&hb, w.h + 8 * p, sizeof(hb));
      u = _mm512_mask_add_epi8(u, static_cast<__mmask64>(hb), u, _mm512_set1_epi8(16));
    } else if constexpr (BITS == 6) {
      // Run j (128-bit lane j) takes bit pair j of the pair's 16 bytes, moved to bits 4-5.
      const __m512i hb = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.h + 16 * p)));
      const __m512i shift = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
      const __m512i high = _mm512_slli_epi32(_mm512_srlv_epi32(hb, shift), 4);
      u = _mm512_ternarylogic_epi32(u, high, _mm512_set1_epi8(0x30), 0xF8);  // u | (high & 0x30)
    }
    return u;
  }
}

// Pair p's d per int32 lane (four lanes a run); float scales.
template <int G>
SLUICE_INLINE __m512 qb_pair_d(const QbRow& w, int p) {
  // G = 32: runs 0..3 are groups 2p, 2p+1, 2p, 2p+1; G = 16: 4p, 4p+2, 4p+1, 4p+3.
  const __m512i lanes = G == 32 ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                                : _mm512_set_epi32(3, 3, 3, 3, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(qb_pair_groups<G, false>(w.d, 0.f, p)));
}

// Pair p's d * dx per lane, for one activation row (dx: its block scales).
template <int G>
SLUICE_INLINE __m512 qb_pair_scale(const QbRow& w, const float* dx, int p) {
  const __m128 dx2 = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dx + 2 * p)));
  const __m128 d = qb_pair_groups<G, false>(w.d, 0.f, p);
  if constexpr (G == 32) {
    const __m512i lanes = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_mul_ps(d, dx2)));
  } else {  // groups 4p..4p+3 belong to blocks 2p, 2p, 2p+1, 2p+1
    const __m512i lanes = _mm512_set_epi32(3, 3, 3, 3, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0, 0);
    const __m128 s = _mm_mul_ps(d, _mm_permute_ps(dx2, _MM_SHUFFLE(1, 1, 0, 0)));
    return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(s));
  }
}

// acc[r] += pair p's share of row r (float scales).
template <int BITS, int G, int R>
SLUICE_INLINE void qb_pair_step(const QbRow& w, const QbActRows<R>& a, int p, __m512* acc) {
  const __m512i u = qb_unpack<BITS>(w, p);
  if constexpr (R == 1) {  // decode: d * dx on 2 or 4 lanes, then spread (the same products)
    const __m512 dot = _mm512_cvtepi32_ps(
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(a.x[0] + 64 * p)));
    acc[0] = _mm512_fmadd_ps(dot, qb_pair_scale<G>(w, a.dx[0], p), acc[0]);
    return;
  }
  const __m512 dv = qb_pair_d<G>(w, p);
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
    const __m512i x = _mm512_loadu_si512(a.x[r] + 64 * p);
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x));
    const __m512 dx = _mm512_broadcast_f32x8(_mm256_loadu_ps(a.dx8[r] + 8 * p));
    acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, dx), acc[r]);
  }
}

// Rows up to which qb_eight_pairs runs (each row's 16 scales hold a register beside its
// two accumulators).
constexpr int kQbEightPairsRows = 2;

// acc0/acc1[r] += pairs p .. p + 7's shares of R activation rows (float scales in groups
// of 32). Each row's 16 groups' d * dx are formed at once and each pair picks its four
// lanes' (groups 2i, 2i + 1, 2i, 2i + 1) with one permute: the same products and the
// same fused multiply-adds, in the same order, as qb_pair_step's, so the sums are bit
// for bit those of any other row count. Per pair that is three vector ops fewer at one
// row (and more at two) than building each pair's scales alone, which held 4-bit
// weights of float scales (MXFP4's E2M1 codes, Q4_0) below the bandwidth at one row:
// 26 GB/s against Q8_0's 32 on 2 cores of Zen 4.
template <int BITS, int R, bool PREFETCH>
SLUICE_INLINE void qb_eight_pairs(const QbRow& w, const QbActRows<R>& a, int p, __m512* acc0,
                                  __m512* acc1) {
  const __m512 d = _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w.d) + 2 * p)));
  __m512 scales[R];
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) scales[r] = _mm512_mul_ps(d, _mm512_loadu_ps(a.dx[r] + 2 * p));
  const __m512i base = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int i = 0; i < 8; ++i) {
    if constexpr (PREFETCH) {
      if (i % 2 == 0) qb_stream_prefetch<BITS>(w, p + i);
    }
    const __m512i u = qb_unpack<BITS>(w, p + i);
    const __m512i lanes = _mm512_add_epi32(base, _mm512_set1_epi32(2 * i));
    __m512* acc = i % 2 == 0 ? acc0 : acc1;
    SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(
          _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(a.x[r] + 64 * (p + i))));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_permutexvar_ps(lanes, scales[r]), acc[r]);
    }
  }
}

// Integer scales: pair p's int8 scales as int16 lanes of its maddubs pair sums (int16
// lane i holds positions 2i, 2i + 1: run i / 8), for vpdpwssd to multiply them by.
template <int G>
SLUICE_INLINE __m512i qb_pair_scales_i16(const QbRow& w, int p) {
  constexpr int n = 64 / G;  // groups a pair
  int32_t raw = 0;
  std::memcpy(&raw, static_cast<const int8_t*>(w.d) + n * p, n);
  const __m512i s = _mm512_castsi128_si512(_mm_cvtepi8_epi16(_mm_cvtsi32_si128(raw)));
  // Each int32 lane names one int16 source twice. Run j's group within the pair:
  // G = 32: j & 1; G = 16: 2 * (j & 1) + (j >> 1).
  constexpr int g1 = 0x10001, g2 = 0x20002, g3 = 0x30003;
  const __m512i idx = G == 32 ? _mm512_set_epi32(g1, g1, g1, g1, 0, 0, 0, 0, g1, g1, g1, g1, 0, 0, 0, 0)
                              : _mm512_set_epi32(g3, g3, g3, g3, g1, g1, g1, g1, g2, g2, g2, g2, 0, 0, 0, 0);
  return _mm512_permutexvar_epi16(idx, s);
}

// Integer scales, rows of one scale per super-block: pairs p .. p + 3's products in
// int32, each run's sums times its int8 scale (maddubs, then vpdpwssd; |lane| <= 4
// pairs * 2 * 16002 * 128 < 2**24); the caller scales once by sd * dx.
template <int BITS, int G, int R, bool PREFETCH>
SLUICE_INLINE void qb_super_step(const QbRow& w, const QbActRows<R>& a, int p, __m512i* isum) {
  static_assert(BITS != 8, "no 8-bit layout has integer scales (maddubs takes u unsigned 7-bit)");
  for (int i = p; i < p + kQbSuperPairs; ++i) {
    if constexpr (PREFETCH) {
      if (i % 2 == 0) qb_stream_prefetch<BITS>(w, i);
    }
    const __m512i u = qb_unpack<BITS>(w, i);
    const __m512i sc = qb_pair_scales_i16<G>(w, i);
    SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
      const __m512i prod = _mm512_maddubs_epi16(u, _mm512_loadu_si512(a.x[r] + 64 * i));
      isum[r] = _mm512_dpwssd_epi32(isum[r], prod, sc);
    }
  }
}

// Groups g .. g + 15 (k: those in range) of d or m (s: sd or sm) as fp32.
template <int G, bool IQ>
SLUICE_INLINE __m512 qb_groups16(const void* v, const uint16_t* s, int g, __mmask16 k) {
  if constexpr (IQ) {
    const __m128i q = _mm_maskz_loadu_epi8(k, static_cast<const int8_t*>(v) + g);
    const __m512 u = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
    if constexpr (G == 16) return qb_keep(_mm512_mul_ps(u, _mm512_set1_ps(qb_half(s[g / 16]))));
    // G = 32: groups g .. g+7 and g+8 .. g+15 are super-blocks g / 8 and g / 8 + 1
    // (the second read only where it is in range).
    const __m128 s2 = _mm_cvtph_ps(_mm_maskz_loadu_epi16(k >> 8 ? 3 : 1, s + g / 8));
    const __m512i lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return qb_keep(_mm512_mul_ps(u, _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(s2))));
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(v) + g));
  }
}

// The vectors qb_dot_rows (below, shared by the SIMD levels) accumulates in.
using QbFloats = __m512;
using QbInts = __m512i;
SLUICE_INLINE __m512 qb_fzero() { return _mm512_setzero_ps(); }
SLUICE_INLINE __m512i qb_izero() { return _mm512_setzero_si512(); }
// acc + isum * scale, the scale kept as computed (qb_keep).
SLUICE_INLINE __m512 qb_scaled_add(__m512i isum, float scale, __m512 acc) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), qb_keep(_mm512_set1_ps(scale)), acc);
}

// out[r]: the pairs' sums (acc0 + acc1) plus the minimum terms.
template <int BITS, int G, bool IQ, int R>
SLUICE_INLINE void qb_finish(const QbRow& w, const QbActRows<R>& a, int ng, const __m512* acc0,
                             const __m512* acc1, float* out) {
  // The minimum terms: sum_g m_g * sx_g, 16 groups at a time; a symmetric weight's
  // m_g is implied * d_g, so it sums d_g * sx_g and scales once.
  const void* ms = w.m ? w.m : w.d;
  const uint16_t* mss = w.m ? w.sm : w.sd;
  __m512 macc[R];
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) macc[r] = _mm512_setzero_ps();
  for (int g = 0; g < ng; g += 16) {
    const __mmask16 k = ng - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (ng - g)) - 1);
    const __m512 mv = qb_groups16<G, IQ>(ms, mss, g, k);
    SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) macc[r] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(k, a.sx[r] + g), macc[r]);
  }
  const __m512 mscale = _mm512_set1_ps(w.m ? 1.f : qb_implied_m<BITS>);
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r)
    out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc0[r], acc1[r]), _mm512_mul_ps(macc[r], mscale)));
}
#elif defined(SLUICE_ISA_AVX2)
// Pair p's values as two halves: positions 0..31 (runs 0, 1) and 32..63 (runs 2, 3).
// 8 bits come back as signed u - 128 (for maddubs' sign trick; the 128 * sum(qx)
// it drops is folded into the minimum term).
template <int BITS>
SLUICE_INLINE void qb_unpack(const QbRow& w, int p, __m256i& lo, __m256i& hi) {
  if constexpr (BITS == 8) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    lo = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.w + 64 * p)), flip);
    hi = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.w + 64 * p + 32)),
                          flip);
  } else {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.w + 32 * p));
    lo = _mm256_and_si256(raw, nibble);
    hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
    if constexpr (BITS == kQbE2M1) {
      const __m256i table = _mm256_broadcastsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(kQbE2M1Values)));
      lo = _mm256_shuffle_epi8(table, lo);
      hi = _mm256_shuffle_epi8(table, hi);
    } else if constexpr (BITS == 5) {
      // Each byte tests its own bit of the 32 bits covering its half.
      const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                              2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
      const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
      const __m256i sixteen = _mm256_set1_epi8(16);
      uint32_t h2[2];
      std::memcpy(h2, w.h + 8 * p, sizeof(h2));
      for (int half = 0; half < 2; ++half) {
        const __m256i b = _mm256_and_si256(
            _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(h2[half])), spread), bit);
        const __m256i add = _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), sixteen);
        (half ? hi : lo) = _mm256_or_si256(half ? hi : lo, add);
      }
    } else if constexpr (BITS == 6) {
      // Positions 0-15 / 16-31 / 32-47 / 48-63: bit pairs 0-1 / 2-3 / 4-5 / 6-7 of the
      // pair's 16 bytes, moved to bits 4-5.
      const __m256i hb = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.h + 16 * p)));
      // One shift each: left by 4 - 2j for bit pairs 0-1 and 2-3, right by 2j - 4 for
      // 4-5 and 6-7 (other bits shifted in are masked off).
      const __m256i two = _mm256_set1_epi8(0x30);
      const __m256i hlo = _mm256_sllv_epi32(hb, _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2));
      const __m256i hhi = _mm256_srlv_epi32(hb, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
      lo = _mm256_or_si256(lo, _mm256_and_si256(hlo, two));
      hi = _mm256_or_si256(hi, _mm256_and_si256(hhi, two));
    }
  }
}

// d per int32 lane of the low half's (runs 0, 1) and high half's (runs 2, 3) dots
// (float scales).
template <int G>
SLUICE_INLINE void qb_pair_d(const QbRow& w, int p, __m256& dlo, __m256& dhi) {
  const __m128 d = qb_pair_groups<G, false>(w.d, 0.f, p);
  if constexpr (G == 32) {
    dlo = dhi = pair_lanes(d);
  } else {
    const __m256 d4 = _mm256_castps128_ps256(d);
    dlo = _mm256_permutevar8x32_ps(d4, _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0));  // 4p, 4p+2
    dhi = _mm256_permutevar8x32_ps(d4, _mm256_set_epi32(3, 3, 3, 3, 1, 1, 1, 1));  // 4p+1, 4p+3
  }
}

// int16 pair sums of u * x for one half (never saturating: 2 * 63 * 127 for 4-6 bits,
// 2 * 128 * 127 with the sign trick for 8).
template <int BITS>
SLUICE_INLINE __m256i qb_maddubs(__m256i u, __m256i x) {
  if constexpr (BITS == 8) return _mm256_maddubs_epi16(_mm256_abs_epi8(u), _mm256_sign_epi8(x, u));
  return _mm256_maddubs_epi16(u, x);
}

// acc[r] += pair p's share of row r (float scales).
template <int BITS, int G, int R>
SLUICE_INLINE void qb_pair_step(const QbRow& w, const QbActRows<R>& a, int p, __m256* acc) {
  __m256i lo, hi;
  qb_unpack<BITS>(w, p, lo, hi);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 dlo, dhi;
  qb_pair_d<G>(w, p, dlo, dhi);
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.x[r] + 64 * p));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.x[r] + 64 * p + 32));
    const __m256i plo = qb_maddubs<BITS>(lo, x0), phi = qb_maddubs<BITS>(hi, x1);
    const __m256 dx = _mm256_loadu_ps(a.dx8[r] + 8 * p);
    __m256 t;
    if constexpr (G == 32 && BITS != 8) {  // both halves share their blocks' d
      t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_add_epi16(plo, phi), ones)), dlo);
    } else if constexpr (G == 32) {
      const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(plo, ones), _mm256_madd_epi16(phi, ones));
      t = _mm256_mul_ps(_mm256_cvtepi32_ps(s), dlo);
    } else {
      t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(plo, ones)), dlo,
                          _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(phi, ones)), dhi));
    }
    acc[r] = _mm256_fmadd_ps(t, dx, acc[r]);
  }
}

// Integer scales: pair p's int8 scales as int16 lanes of the low half's maddubs pair
// sums (runs 0, 1: int16 lanes 0-7, 8-15) and the high half's (runs 2, 3), for madd
// to multiply them by. Run j's group: G = 32: 2p + (j & 1); G = 16: 4p + 2 (j & 1) + (j >> 1).
template <int G>
SLUICE_INLINE void qb_pair_scales_i16(const QbRow& w, int p, __m256i& slo, __m256i& shi) {
  constexpr int n = 64 / G;  // groups a pair
  int32_t raw = 0;
  std::memcpy(&raw, static_cast<const int8_t*>(w.d) + n * p, n);
  const __m128i s16 = _mm_cvtepi8_epi16(_mm_cvtsi32_si128(raw));
  const __m256i dup = _mm256_castsi128_si256(_mm_unpacklo_epi16(s16, s16));  // s_j s_j a lane
  if constexpr (G == 32) {
    slo = shi = _mm256_permutevar8x32_epi32(dup, _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
  } else {
    slo = _mm256_permutevar8x32_epi32(dup, _mm256_set_epi32(2, 2, 2, 2, 0, 0, 0, 0));
    shi = _mm256_permutevar8x32_epi32(dup, _mm256_set_epi32(3, 3, 3, 3, 1, 1, 1, 1));
  }
}

// Integer scales, rows of one scale per super-block: pairs p .. p + 3's products in
// int32, each run's int16 pair sums times its int8 scale in madd (|lane| <= 4 pairs *
// 2 halves * 2 * 16002 * 128 < 2**25); the caller scales once by sd * dx.
template <int BITS, int G, int R, bool PREFETCH>
SLUICE_INLINE void qb_super_step(const QbRow& w, const QbActRows<R>& a, int p, __m256i* isum) {
  static_assert(BITS != 8, "no 8-bit layout has integer scales");
  for (int i = p; i < p + kQbSuperPairs; ++i) {
    if constexpr (PREFETCH) {
      if (i % 2 == 0) qb_stream_prefetch<BITS>(w, i);
    }
    __m256i lo, hi, slo, shi;
    qb_unpack<BITS>(w, i, lo, hi);
    qb_pair_scales_i16<G>(w, i, slo, shi);
    SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.x[r] + 64 * i));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.x[r] + 64 * i + 32));
      const __m256i plo = _mm256_maddubs_epi16(lo, x0), phi = _mm256_maddubs_epi16(hi, x1);
      if constexpr (G == 32)  // both halves' runs share groups: add first (|.| <= 4 * 31 * 127)
        isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_add_epi16(plo, phi), slo));
      else
        isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(plo, slo),
                                                             _mm256_madd_epi16(phi, shi)));
    }
  }
}

// Groups g .. g + 7 of d or m (s: sd or sm) as fp32 (never two super-blocks: g is a
// multiple of 8, and 8 groups are 128 or 256 values).
template <int G, bool IQ>
SLUICE_INLINE __m256 qb_groups8(const void* v, const uint16_t* s, int g) {
  if constexpr (IQ) {
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(v) + g));
    return qb_keep(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                                 _mm256_set1_ps(qb_half(s[g / (kQbSuper / G)]))));
  } else {
    return _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(v) + g)));
  }
}

// The vectors qb_dot_rows (below, shared by the SIMD levels) accumulates in.
using QbFloats = __m256;
using QbInts = __m256i;
SLUICE_INLINE __m256 qb_fzero() { return _mm256_setzero_ps(); }
SLUICE_INLINE __m256i qb_izero() { return _mm256_setzero_si256(); }
// acc + isum * scale, the scale kept as computed (qb_keep).
SLUICE_INLINE __m256 qb_scaled_add(__m256i isum, float scale, __m256 acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), qb_keep(_mm256_set1_ps(scale)), acc);
}

// out[r]: the pairs' sums (acc0 + acc1) plus the minimum terms.
template <int BITS, int G, bool IQ, int R>
SLUICE_INLINE void qb_finish(const QbRow& w, const QbActRows<R>& a, int ng, const __m256* acc0,
                             __m256* acc1, float* out) {
  // The minimum terms sum_g m_g * sx_g; for 8 bits also the sign trick's offset,
  // 128 * d_g * sx_g.
  // A symmetric weight's m is a multiple of d: (implied + 128) * d for 8 bits is 0.
  const float dfactor = (BITS == 8 ? 128.f : 0.f) + (w.m ? 0.f : qb_implied_m<BITS>);
  int g = 0;
  for (; g + 8 <= ng && (w.m || dfactor != 0.f); g += 8) {
    __m256 mv = w.m ? qb_groups8<G, IQ>(w.m, w.sm, g) : _mm256_setzero_ps();
    if (dfactor != 0.f) mv = _mm256_fmadd_ps(qb_groups8<G, IQ>(w.d, w.sd, g), _mm256_set1_ps(dfactor), mv);
    SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) acc1[r] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(a.sx[r] + g), acc1[r]);
  }
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) out[r] = hsum8(_mm256_add_ps(acc0[r], acc1[r]));
  for (; g < ng && (w.m || dfactor != 0.f); ++g) {
    const float mg = (w.m ? qb_group<G, IQ>(w.m, w.sm, g) : 0.f) + dfactor * qb_group<G, IQ>(w.d, w.sd, g);
    SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) out[r] += mg * a.sx[r][g];
  }
}

#else
// Pair p's 64 values u in position order.
template <int BITS>
SLUICE_INLINE void qb_unpack(const QbRow& w, int p, uint8_t* u) {
  if constexpr (BITS == 8) {
    std::memcpy(u, w.w + 64 * p, 64);
  } else {
    const uint8_t* b = w.w + 32 * p;
    for (int j = 0; j < 32; ++j) {
      u[j] = b[j] & 0x0F;
      u[32 + j] = b[j] >> 4;
    }
    if constexpr (BITS == kQbE2M1) {
      for (int i = 0; i < 64; ++i) u[i] = kQbE2M1Values[u[i]];
    } else if constexpr (BITS == 5) {
      uint64_t hb;
      std::memcpy(&hb, w.h + 8 * p, sizeof(hb));
      for (int i = 0; i < 64; ++i) u[i] |= static_cast<uint8_t>(((hb >> i) & 1) << 4);
    } else if constexpr (BITS == 6) {
      const uint8_t* hb = w.h + 16 * p;
      for (int i = 0; i < 64; ++i)
        u[i] |= static_cast<uint8_t>(((hb[i % 16] >> (2 * (i / 16))) & 3) << 4);
    }
  }
}

// One row's share of a pair: out of line, so that fast-math cannot vectorize or
// reorder it differently for different R (a row's result must not depend on R).
__attribute__((noinline)) inline float qb_pair_dot(const uint8_t* u, const float* d,
                                                   const int8_t* x, const float* dx) {
  float sum = 0.f;
  for (int j = 0; j < 4; ++j) {
    int32_t dot = 0;
    for (int i = 0; i < 16; ++i) dot += u[16 * j + i] * x[16 * j + i];
    sum += d[j] * dx[j & 1] * static_cast<float>(dot);
  }
  return sum;
}

// sum_g m_g sx_g: the minimum terms (m_g = implied * d_g for a symmetric weight).
template <int BITS, int G, bool IQ>
__attribute__((noinline)) inline float qb_min_dot(const QbRow& w, const float* sx, int ng) {
  float sum = 0.f;
  for (int g = 0; g < ng; ++g)
    sum += (w.m ? qb_group<G, IQ>(w.m, w.sm, g) : qb_group<G, IQ>(w.d, w.sd, g)) * sx[g];
  return w.m ? sum : qb_implied_m<BITS> * sum;
}

// Integer scales: one row's int32 sum over a pair, each run's dot times its int8 scale.
inline int32_t qb_pair_idot(const uint8_t* u, const int32_t* s, const int8_t* x) {
  int32_t sum = 0;
  for (int j = 0; j < 4; ++j) {
    int32_t dot = 0;
    for (int i = 0; i < 16; ++i) dot += u[16 * j + i] * x[16 * j + i];
    sum += s[j] * dot;
  }
  return sum;
}

// A super-block's int32 sum times sd * dx (out of line: one rounding order for any R).
__attribute__((noinline)) inline float qb_super_term(int32_t isum, float sd, float dx) {
  return static_cast<float>(isum) * (sd * dx);
}

template <int BITS, int G, bool IQ, int R, bool PREFETCH = false>
inline void qb_dot_rows(const QbRow& w, const QbActRows<R>& a, int np, int ng, float* out) {
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) out[r] = 0.f;
  uint8_t u[64];
  if constexpr (IQ) {  // rows of one scale per super-block: its products sum in int32
    for (int p0 = 0; p0 < np; p0 += kQbSuperPairs) {
      int32_t isum[R] = {};
      for (int p = p0; p < p0 + kQbSuperPairs; ++p) {
        qb_unpack<BITS>(w, p, u);
        int32_t s[4];
        for (int j = 0; j < 4; ++j) s[j] = static_cast<const int8_t*>(w.d)[qb_run_group<G>(p, j)];
        SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) isum[r] += qb_pair_idot(u, s, a.x[r] + 64 * p);
      }
      const float sd = qb_half(w.sd[p0 / kQbSuperPairs]);
      SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) out[r] += qb_super_term(isum[r], sd, a.dx[r][2 * p0]);
    }
  } else {
    for (int p = 0; p < np; ++p) {
      qb_unpack<BITS>(w, p, u);
      float d[4];
      for (int j = 0; j < 4; ++j) d[j] = qb_group<G, false>(w.d, nullptr, qb_run_group<G>(p, j));
      SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) out[r] += qb_pair_dot(u, d, a.x[r] + 64 * p, a.dx[r] + 2 * p);
    }
  }
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) out[r] += qb_min_dot<BITS, G, IQ>(w, a.sx[r], ng);
}
#endif

#if defined(SLUICE_ISA_AVX512) || defined(SLUICE_ISA_AVX2)
// out[r] = weight row w . activation row r over np pairs (ng groups), at either SIMD
// level (its vectors and steps above).
template <int BITS, int G, bool IQ, int R, bool PREFETCH = false>
SLUICE_INLINE void qb_dot_rows(const QbRow& w, const QbActRows<R>& a, int np, int ng, float* out) {
  // Two accumulators a row: consecutive pairs do not wait on each other's FMA.
  QbFloats acc0[R], acc1[R];
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = qb_fzero();
  if constexpr (IQ) {  // one float step a super-block a row: sd * dx (dx the super-block's)
    for (int p = 0; p < np; p += kQbSuperPairs) {
      QbInts isum[R];
      SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) isum[r] = qb_izero();
      qb_super_step<BITS, G, R, PREFETCH>(w, a, p, isum);
      const float sd = qb_half(w.sd[p / kQbSuperPairs]);
      SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) acc0[r] = qb_scaled_add(isum[r], sd * a.dx[r][2 * p], acc0[r]);
    }
  } else {
    int p = 0;
#if defined(SLUICE_ISA_AVX512)
    if constexpr (R <= kQbEightPairsRows && G == 32)
      for (; p + 8 <= np; p += 8) qb_eight_pairs<BITS, R, PREFETCH>(w, a, p, acc0, acc1);
#endif  // (at avx2 the same step measured 16-23% slower: 16 registers)
    for (; p + 1 < np; p += 2) {
      if constexpr (PREFETCH) qb_stream_prefetch<BITS>(w, p);
      qb_pair_step<BITS, G, R>(w, a, p, acc0);
      qb_pair_step<BITS, G, R>(w, a, p + 1, acc1);
    }
    if (p < np) qb_pair_step<BITS, G, R>(w, a, p, acc0);
  }
  qb_finish<BITS, G, IQ, R>(w, a, ng, acc0, acc1, out);
}
#endif

// ---- Matmul with int8 activations.

// Activation rows one pass of a weight row serves: AVX-512's 32 registers hold 12 rows'
// accumulators (the output head's two levels of 6 positions: a verifying step of up to
// 5 drafts reads the 1.5B model's head once; 16 rows' two accumulators each would take
// all 32). AVX2's 16 registers and the portable loop take 4. Past 5 rows this relies
// on SLUICE_UNROLL_ROWS.
#if defined(SLUICE_ISA_AVX512)
constexpr int kQbRowBlock = 12;
#else
constexpr int kQbRowBlock = 4;
#endif

// f(std::integral_constant<int, R>) for the runtime R in 1 .. MAX (the block kernel's
// kQbRowBlock, or another kernel's row block: qblock_gemm.h).
template <int MAX = kQbRowBlock, int R = 1, typename F>
SLUICE_INLINE void qb_with_rows(int rows, F&& f) {
  if constexpr (R < MAX) {
    if (rows > R) return qb_with_rows<MAX, R + 1>(rows, f);
  }
  f(std::integral_constant<int, R>{});
}

template <int G, int R>
QbActRows<R> qb_act_rows(const QBlockActivations& xa, int r0, int K) {
  QbActRows<R> a;
  const float* sx = G == 16 ? xa.sx16.data() : xa.sx.data();
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
    a.x[r] = xa.row(r0 + r);
    a.dx[r] = xa.dx.data() + static_cast<int64_t>(r0 + r) * (K / 32);
    a.dx8[r] = xa.dx8.data() + static_cast<int64_t>(r0 + r) * (K / 8);
    a.sx[r] = sx + static_cast<int64_t>(r0 + r) * (K / G);
  }
  return a;
}

// out[r] = row w . activation row r, over the whole of K, in one run of pairs on every
// path (a row's result must not depend on the batch: a verifying step's rows equal the
// decode steps they replace). Long rows were once summed in chunks of 2048 values, each
// reduced and added, so R rows of a chunk stayed in L1 across weight rows; the chunks'
// reductions and partial sums cost more than L2 reads of the rows do now. Unchunked,
// Qwen2.5-7B's down projection (Q6_K, 3584 x 18944) took 18% fewer cycles at 8 and 16
// rows, 10-16% at 3-5, 1-5% at one, and its Q4_K gate (K = 3584) 25% fewer at one row
// (2 cores of Zen 4, avx512; at avx2 20-35% at 3-16 rows, one and two rows alike).
template <int BITS, int G, bool IQ, int R, bool PREFETCH = false>
SLUICE_INLINE void qb_dot_row(const QbRow& w, const QbActRows<R>& a, int K, float* out) {
  qb_dot_rows<BITS, G, IQ, R, PREFETCH>(w, a, K / 64, K / G, out);
}

template <typename T, int R>
SLUICE_INLINE void qb_store(T* y, int N, int64_t n, const float* out) {
  SLUICE_UNROLL_ROWS for (int r = 0; r < R; ++r) {
    T* dst = y + static_cast<int64_t>(r) * N + n;
    *dst = round_to(dst, out[r]);
  }
}

// The rows a pass writes: fp32, or bf16 (uint16_t). A run-time choice, made once a
// weight row beside that row's K loop, so one compiled pass serves both types: the
// pass's instances (11 formats x 12 row counts, once per type) were half of
// qblock.cpp's object, the build's largest.
struct QbOut {
  void* y;
  bool bf16;

  // The same rows from row r0 of N values on.
  QbOut from_row(int64_t r0, int N) const {
    return {static_cast<char*>(y) + r0 * N * (bf16 ? 2 : 4), bf16};
  }

  // f(p), p the typed pointer to value `at` (a stored run's start).
  template <typename F>
  SLUICE_INLINE void typed(int64_t at, F&& f) const {
    if (bf16)
      f(static_cast<uint16_t*>(y) + at);
    else
      f(static_cast<float*>(y) + at);
  }
};
inline QbOut qb_out(float* y) { return {y, false}; }
inline QbOut qb_out(uint16_t* y) { return {y, true}; }

template <int R>
SLUICE_INLINE void qb_store(const QbOut& y, int N, int64_t n, const float* out) {
  y.typed(0, [&](auto* yt) {
    qb_store<std::remove_pointer_t<decltype(yt)>, R>(yt, N, n, out);
  });
}

// Rows r0 .. r0 + R (R <= kQbRowBlock) of y: every weight row times all R rows, in one
// orphaned `omp for`. `wait` false leaves out the barrier at the end (every thread must
// pass the same), where no thread reads what another writes before the region's end:
// the experts' groups write disjoint rows of y.
template <int BITS, int G, bool IQ, int R>
void qb_rows_pass(const QBlockActivations& xa, int r0, int K, const QbWeight& wt, int N,
                  QbOut y, bool wait = true) {
  const QbActRows<R> a = qb_act_rows<G, R>(xa, r0, K);
  y = y.from_row(r0, N);
  SidePrefetch queue = side_prefetch_queue;
#pragma omp for schedule(static) nowait
  for (int n = 0; n < N; ++n) {
    float out[R];
    side_prefetch_step(queue);
    qb_dot_row<BITS, G, IQ, R, true>(wt.row<BITS, G, IQ>(K, n), a, K, out);
    qb_store<R>(y, N, n, out);
  }
  side_prefetch_queue = queue;
  if (wait) {
#pragma omp barrier
  }
}

// A pass over the weights per kQbRowBlock rows. Reusing each weight row from L1 across
// row blocks instead (the tiled loop this replaced) measured slower on 2 cores of Zen 5:
// the 1.5B's head at 16 rows 22.2 against 14.6 ms, at 9 rows 13.4 against 12.3.
// Rows first .. first + M of xa and y (the experts' matmul runs a group of rows at a
// time, each in the passes a call of its M rows alone would make: the same results);
// `wait` false: no barrier after the passes (see qb_rows_pass).
template <int BITS, int G, bool IQ>
void qblock_rows_t(const QBlockActivations& xa, int M, int K, const QbWeight& wt, int N,
                   QbOut y, int first = 0, bool wait = true) {
  const int passes = (M + kQbRowBlock - 1) / kQbRowBlock;
  const int per_pass = (M + passes - 1) / passes;  // as even as they go: 16 rows as 8 + 8
  for (int r0 = 0; r0 < M; r0 += per_pass)
    qb_with_rows(std::min(per_pass, M - r0), [&](auto R) {
      qb_rows_pass<BITS, G, IQ, R>(xa, first + r0, K, wt, N, y, wait);
    });
}

// The runtime format (bits, group; integer scales where the weight has multipliers s)
// as the constants B, G and IQ inside `call`. Integer scales come with the K-quants'
// layouts only: Q4_K 4/32, Q5_K 5/32, Q6_K (and what is widened to it) 6/16. MXFP4's
// codes are kQbE2M1 in groups of 32.
#define SLUICE_QB_DISPATCH(bits, group, iq, call)                                      \
  switch ((bits) * 100 + (group) + ((iq) ? 1000 : 0)) {                                \
    case 432: { constexpr int B = 4, G = 32; constexpr bool IQ = false; call; } break;  \
    case 416: { constexpr int B = 4, G = 16; constexpr bool IQ = false; call; } break;  \
    case 532: { constexpr int B = 5, G = 32; constexpr bool IQ = false; call; } break;  \
    case 516: { constexpr int B = 5, G = 16; constexpr bool IQ = false; call; } break;  \
    case 632: { constexpr int B = 6, G = 32; constexpr bool IQ = false; call; } break;  \
    case 616: { constexpr int B = 6, G = 16; constexpr bool IQ = false; call; } break;  \
    case 832: { constexpr int B = 8, G = 32; constexpr bool IQ = false; call; } break;  \
    case 816: { constexpr int B = 8, G = 16; constexpr bool IQ = false; call; } break;  \
    case 1432: { constexpr int B = 4, G = 32; constexpr bool IQ = true; call; } break;  \
    case 1532: { constexpr int B = 5, G = 32; constexpr bool IQ = true; call; } break;  \
    case 1616: { constexpr int B = 6, G = 16; constexpr bool IQ = true; call; } break;  \
    case 2032: { constexpr int B = ::sluice::kQbE2M1, G = 32; constexpr bool IQ = false; call; } break; \
    default: break; /* the bindings reject other formats */                            \
  }

// y [M, N] = x @ W.T for quantized x; the weight rows are shared out by orphaned `omp
// for`s (every thread of an enclosing parallel region calls this; barrier at the end).
// bits in {4, 5, 6, 8}, group in {16, 32}; hbits only for 5 and 6 bits, m null for a
// symmetric weight, s null unless the scales are integers.
template <typename T>
void qblock_rows(const QBlockActivations& xa, int M, int K, int bits, int group,
                 const QbWeight& wt, int N, T* y) {
  SLUICE_QB_DISPATCH(bits, group, wt.s != nullptr,
                     (qblock_rows_t<B, G, IQ>(xa, M, K, wt, N, qb_out(y))))
}

// Expert e's weight in one stacked from experts of N rows each: rows e * N .. (e + 1) * N,
// its pointers (the integer scales' multipliers s too) moved to row e * N, no copy.
template <int BITS, int G, bool IQ>
QbWeight qblock_expert_weight(const QbWeight& w, int K, int64_t first_row) {
  const QbRow r = w.row<BITS, G, IQ>(K, first_row);
  return {r.w, r.h, r.d, r.m, r.sd};
}

// Group j's rows start[j] .. start[j + 1] of y times expert[j]'s weight, each group as
// qblock_matmul on those rows alone (the same passes, so the same results); an empty
// group is skipped (by every thread alike: they meet the same worksharing loops). No
// barrier between passes: they write disjoint rows of y and read only what was there
// before the region, so a thread goes on to the next expert's rows. A decode step's
// top-8 on 2 cores (Qwen3-30B-A3B's shapes, paired runs against the barriers): 0-2%
// faster on a quiet machine, up to 2x where another process took a core and every
// barrier waited for the preempted thread. No barrier at the end either: a caller
// that reads y next passes one.
// skip_from > 0: groups of that many rows or more are left out (the decode stack's
// experts that take the int8 GEMM).
template <int BITS, int G, bool IQ>
void qblock_experts_t(const QBlockActivations& xa, int K, const QbWeight& w, int N,
                      int num_groups, const int64_t* start, const int64_t* expert, QbOut y,
                      int skip_from = 0) {
  for (int j = 0; j < num_groups; ++j) {
    const int r0 = static_cast<int>(start[j]), rows = static_cast<int>(start[j + 1] - start[j]);
    if (rows == 0 || (skip_from > 0 && rows >= skip_from)) continue;
    const QbWeight we = qblock_expert_weight<BITS, G, IQ>(w, K, expert[j] * N);
    qblock_rows_t<BITS, G, IQ>(xa, rows, K, we, N, y, r0, /*wait=*/false);
  }
}

// qblock_experts_t for the runtime format (every thread of a parallel region calls it).
template <typename T>
void qblock_experts(const QBlockActivations& xa, int K, int bits, int group, const QbWeight& w,
                    int N, int num_groups, const int64_t* start, const int64_t* expert, T* y,
                    int skip_from = 0) {
  SLUICE_QB_DISPATCH(bits, group, w.s != nullptr,
                     (qblock_experts_t<B, G, IQ>(xa, K, w, N, num_groups, start, expert,
                                                 qb_out(y), skip_from)))
}

// One compiled copy of each entry point that several files call: qblock.cpp defines
// the instances (SLUICE_QBLOCK_INSTANCES(, T)) and the others (decode_stack.cpp) link
// to them instead of compiling their own. Those copies were most of decode_stack.cpp's
// object and of its compile time (it took 56 s at the avx512 level, ~11 s without).
#define SLUICE_QBLOCK_INSTANCES(prefix, T)                                                    \
  prefix template void qblock_rows<T>(const QBlockActivations&, int, int, int, int,           \
                                      const QbWeight&, int, T*);                              \
  prefix template void qblock_experts<T>(const QBlockActivations&, int, int, int,             \
                                         const QbWeight&, int, int, const int64_t*,           \
                                         const int64_t*, T*, int);
SLUICE_QBLOCK_INSTANCES(extern, float)
SLUICE_QBLOCK_INSTANCES(extern, uint16_t)

// qblock_expert_weight for the runtime format.
inline QbWeight qblock_expert_weight(const QbWeight& w, int K, int bits, int group,
                                     int64_t first_row) {
  QbWeight out = w;
  SLUICE_QB_DISPATCH(bits, group, w.s != nullptr,
                     (out = qblock_expert_weight<B, G, IQ>(w, K, first_row)))
  return out;
}

}  // namespace sluice
