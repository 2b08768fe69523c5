// C entry points of the qblock kernels (qblock.h, qblock_float.h). Every one takes the
// weight as (bits, group, packed, hbits, d, m, s): hbits is null unless bits is 5 or 6,
// m null for a symmetric weight, s (the multipliers of integer scales) null for fp16
// scales.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "q8_matmul.h"
#include "qblock.h"
#include "qblock_float.h"
#include "qblock_gemm_amx.h"
#include "qpanel.h"

namespace {

using sluice::QbWeight;

template <typename T>
void matmul(const T* x, int M, int K, int bits, int group, const QbWeight& w, int N, T* y) {
  sluice::QBlockActivations xa;
  xa.quantize(x, M, K, group, w.s != nullptr);
#pragma omp parallel
  sluice::qblock_rows(xa, M, K, bits, group, w, N, y);
}

// What x's int8 blocks (`coarse`, its first level) leave out, x - dx * q, in natural
// order: row r at out + r * stride.
template <typename T>
void residual_rows(const T* x, const sluice::QBlockActivations& coarse, int M, int K,
                   float* out, int64_t stride) {
  for (int r = 0; r < M; ++r) {
    const T* xr = x + static_cast<int64_t>(r) * K;
    float* rest = out + r * stride;
    const int8_t* q = coarse.row(r);  // pair positions
    const float* dx = coarse.dx.data() + static_cast<int64_t>(r) * (K / 32);
    for (int p = 0; p < K / 64; ++p)
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 16; ++i) {
          const int k = sluice::qb_run_k(p, j) + i;
          const float step = dx[k / 32] * static_cast<float>(q[64 * p + 16 * j + i]);
          rest[k] = sluice::to_float(xr[k]) - step;
        }
  }
}

// Row r of x becomes rows 2r (x) and 2r + 1 (its residual, itself quantized in blocks of
// a scale ~254 times finer; blocks of 256 values for a weight with integer scales, of 32
// else): the int8 kernel then sees each value to ~15 bits where one level keeps 8, and a
// weight pair unpacked once serves both rows. The output head's logits decide greedy
// picks among near-ties, so it needs more than int8; this gets that at the int8
// kernel's bandwidth instead of the float kernel's instruction count (its 6-bit head
// was compute-bound).
template <typename T>
std::vector<float> with_residuals(const T* x, int M, int K, bool integer) {
  sluice::QBlockActivations coarse;
  coarse.quantize(x, M, K, 0, integer);
  std::vector<float> out(static_cast<size_t>(2) * M * K);
  for (int r = 0; r < M; ++r)
    for (int k = 0; k < K; ++k)
      out[static_cast<int64_t>(2 * r) * K + k] = sluice::to_float(x[static_cast<int64_t>(r) * K + k]);
  residual_rows(x, coarse, M, K, out.data() + K, 2 * static_cast<int64_t>(K));
  return out;
}

template <typename T>
void matmul_residual(const T* x, int M, int K, int bits, int group, const QbWeight& w, int N,
                     T* y) {
  const bool integer = w.s != nullptr;
  const std::vector<float> x2 = with_residuals(x, M, K, integer);
  sluice::QBlockActivations xa;
  xa.quantize(x2.data(), 2 * M, K, group, integer);
  std::vector<float> both(static_cast<size_t>(2) * M * N);  // the two levels' products
  float* y2 = both.data();
#pragma omp parallel
  {
    sluice::qblock_rows(xa, 2 * M, K, bits, group, w, N, y2);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < static_cast<int64_t>(M) * N; ++i) {
      const int64_t r = i / N, n = i % N;
      y[i] = sluice::round_to(y + i, y2[2 * r * N + n] + y2[(2 * r + 1) * N + n]);
    }
  }
}

// Tokens a step of the head's scan and refinement takes (the coarse logits of a tile
// stay in L1 between the two loops).
constexpr int kHeadTile = 2048;

// Ask for weight row n's bytes at once: the candidates' rows are scattered over the
// head and cold, and reading one after another waited on memory for each (~1 us a row).
template <int BITS, int G, bool IQ>
void prefetch_row(const QbWeight& w, int K, int n) {
  const sluice::QbRow row = w.row<BITS, G, IQ>(K, n);
  const auto lines = [](const void* p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
  };
  lines(row.w, sluice::qb_row_bytes(BITS, K));
  if (row.h) lines(row.h, sluice::qb_hbits_row_bytes(BITS, K));
  lines(row.d, (K / G) * (IQ ? 1 : 2));
  if (row.m) lines(row.m, (K / G) * (IQ ? 1 : 2));
}

// y = the first level's logits (coarse), and for the tokens that may be row r's greedy
// pick the second level's term added, one dot product each. Token n's second-level
// term is at most rnorm[n] * s[r] (Cauchy-Schwarz; s: the residual's L2 norm, rnorm:
// weight row n's), so a token whose coarse logit plus that bound stays under
// cutoff[r] (the best lower bound of any token, less two bf16 steps of the largest
// magnitude) can neither be the pick nor round to the pick's value. first: where
// coarse came from the int8 GEMM (not the block kernel), the first level's activations,
// whose block-kernel product a candidate's logit takes instead (a second dot product),
// so candidates stay bit for bit the two-level kernel's.
// panels: w is in panel order (qpanel.h), each candidate's row rebuilt row-major.
template <int BITS, int G, bool IQ, typename T>
void head_refine_t(const float* coarse, const sluice::QBlockActivations& rest,
                   const sluice::QBlockActivations* first, int M, int K, const QbWeight& w,
                   int N, const float* rnorm, const float* s, const float* cutoff, bool panels,
                   T* y) {
  constexpr bool kPanelFormat = IQ && (BITS == 4 || BITS == 6);
  std::vector<int64_t> picked;  // this thread's candidates, as r * N + n
  sluice::QpRowScratch scratch;
  auto row_of = [&](int n) {
    if constexpr (kPanelFormat)
      if (panels) return sluice::qp_row<BITS, G>(w, K, n, scratch);
    return w.row<BITS, G, IQ>(K, n);
  };
#pragma omp for schedule(static)
  for (int n0 = 0; n0 < N; n0 += kHeadTile) {
    const int n1 = std::min(N, n0 + kHeadTile);
    picked.clear();
    for (int r = 0; r < M; ++r) {
      const float* c = coarse + static_cast<int64_t>(r) * N;
      T* yr = y + static_cast<int64_t>(r) * N;
      for (int n = n0; n < n1; ++n) yr[n] = sluice::round_to(yr + n, c[n]);
      for (int n = n0; n < n1; ++n)
        if (c[n] + rnorm[n] * s[r] >= cutoff[r]) picked.push_back(static_cast<int64_t>(r) * N + n);
    }
    if (!panels)
      for (const int64_t i : picked) prefetch_row<BITS, G, IQ>(w, K, static_cast<int>(i % N));
    for (const int64_t i : picked) {
      const int r = static_cast<int>(i / N), n = static_cast<int>(i % N);
      const sluice::QbRow row = row_of(n);
      float out, one = coarse[i];
      sluice::qb_dot_row<BITS, G, IQ, 1>(row, sluice::qb_act_rows<G, 1>(rest, r, K), K, &out);
      if (first)
        sluice::qb_dot_row<BITS, G, IQ, 1>(row, sluice::qb_act_rows<G, 1>(*first, r, K), K, &one);
      y[i] = sluice::round_to(y + i, one + out);
    }
  }
}

// The L2 norm of each row's residual, as the kernels see it (dx times its int8 values).
// With the weight rows' norms it bounds the second level's term (Cauchy-Schwarz), where
// the largest |W| times the residual's L1 norm, the bound before, left ~6% of the 1.5B's
// tokens as candidates on 16 streams' hidden states and this ~0.01% (ad hoc).
std::vector<float> residual_norm(const sluice::QBlockActivations& rest, int M, int K) {
  std::vector<float> s(M, 0.f);
  for (int r = 0; r < M; ++r) {
    const int8_t* q = rest.row(r);
    const float* dx = rest.dx.data() + static_cast<int64_t>(r) * (K / 32);
    double sum = 0;  // (positions are pair-ordered, but dx holds one scale per 32 of them)
    for (int k = 0; k < K; ++k) {
      const double v = static_cast<double>(dx[k / 32]) * q[k];
      sum += v * v;
    }
    s[r] = static_cast<float>(std::sqrt(sum) * (1 + 1e-5));  // the fp32 sums' rounding too
  }
  return s;
}

// Where the head's first level comes from (sluice_qblock_matmul_head's `first`).
enum HeadFirstLevel { kHeadBlocks = 0, kHeadGemm = 1, kHeadTiles = 2, kHeadPanels = 3 };

// The first level's logits of every token into coarse: the block kernel on xw, or the
// int8 GEMM on x (the same int8 values, summed in another order), on AMX-INT8 tiles for
// kHeadTiles where this library has them, or the panel kernel (the GEMM's sums) on a
// weight in panel order (every thread of a parallel region calls this).
template <typename T>
void head_first_level(int first, const T* x, const sluice::QBlockActivations& xw, int M, int K,
                      int bits, int group, const QbWeight& w, int N, float* coarse,
                      sluice::GemmActivations& ga) {
  if (first == kHeadPanels)
    return sluice::qpanel_matmul(x, M, K, bits, group, w, N, sluice::qb_out(coarse), ga);
  if (first != kHeadBlocks)
    return sluice::qblock_gemm_on(first == kHeadTiles, x, M, K, bits, group, w, N,
                                  sluice::qb_out(coarse), ga);
  sluice::qblock_rows(xw, M, K, bits, group, w, N, coarse);
}

// The output head: matmul_residual's logits for every token that may be the greedy
// pick (bit for bit), the first level's for the rest. The second level then costs a
// dot product per candidate (~500 of Qwen's 151,936 tokens, a few thousand at most)
// instead of a kernel row per position: the head reads its weights once for up to 12
// positions, not 6. first: the first level from the int8 GEMM (head_first_level), and
// then candidates' first level again on the block kernel.
template <typename T>
void matmul_head(const T* x, int M, int K, int bits, int group, const QbWeight& w, int N,
                 const float* rnorm, int first, T* y) {
  const bool integer = w.s != nullptr;
  sluice::QBlockActivations xw, xr;  // the first level (as qblock_matmul's), the second
  xw.quantize(x, M, K, group, integer);
  std::vector<float> rest(static_cast<size_t>(M) * K);
  residual_rows(x, xw, M, K, rest.data(), K);
  xr.quantize(rest.data(), M, K, group, integer);
  const std::vector<float> s = residual_norm(xr, M, K);
  std::vector<float> coarse(static_cast<size_t>(M) * N);
  std::vector<float> lo(M, -INFINITY), hi(M, -INFINITY), cutoff(M);
  sluice::GemmActivations ga;  // the GEMM's rows (shared: one thread sizes it)
#pragma omp parallel
  {
    head_first_level(first, x, xw, M, K, bits, group, w, N, coarse.data(), ga);
    std::vector<float> lo_t(M, -INFINITY), hi_t(M, -INFINITY);  // this thread's
#pragma omp for schedule(static) nowait
    for (int n0 = 0; n0 < N; n0 += kHeadTile) {
      const int n1 = std::min(N, n0 + kHeadTile);
      for (int r = 0; r < M; ++r) {
        const float* c = coarse.data() + static_cast<int64_t>(r) * N;
        float l = lo_t[r], h = hi_t[r];
        for (int n = n0; n < n1; ++n) {
          l = std::max(l, c[n] - rnorm[n] * s[r]);
          h = std::max(h, c[n] + rnorm[n] * s[r]);
        }
        lo_t[r] = l;
        hi_t[r] = h;
      }
    }
#pragma omp critical
    for (int r = 0; r < M; ++r) {
      lo[r] = std::max(lo[r], lo_t[r]);
      hi[r] = std::max(hi[r], hi_t[r]);
    }
#pragma omp barrier
#pragma omp single
    for (int r = 0; r < M; ++r)  // less two bf16 steps: 2 * 2**-7 of the magnitude
      cutoff[r] = lo[r] - std::ldexp(std::max(std::abs(lo[r]), std::abs(hi[r])), -6) - 1e-3f;
    const sluice::QBlockActivations* xfirst = first != kHeadBlocks ? &xw : nullptr;
    SLUICE_QB_DISPATCH(bits, group, integer,
                       (head_refine_t<B, G, IQ>(coarse.data(), xr, xfirst, M, K, w, N, rnorm,
                                                s.data(), cutoff.data(), first == kHeadPanels,
                                                y)))
  }
}

template <typename T>
void matmul_float(const T* x, int M, int K, int bits, int group, const QbWeight& w, int N, T* y) {
  const std::vector<float> xf = sluice::pair_ordered(x, M, K);
#pragma omp parallel
  SLUICE_QB_DISPATCH(bits, group, w.s != nullptr,
                     (sluice::qblock_float_rows_t<B, G, IQ>(xf.data(), M, K, w, N, y)))
}

// The activations quantized once for all M rows, then one parallel region over the groups.
template <typename T>
void matmul_experts(const T* x, int M, int K, int bits, int group, const QbWeight& w, int N,
                    int num_groups, const int64_t* start, const int64_t* expert, T* y) {
  const bool integer = w.s != nullptr;
  sluice::QBlockActivations xa;
  xa.quantize(x, M, K, group, integer);
#pragma omp parallel
  sluice::qblock_experts(xa, K, bits, group, w, N, num_groups, start, expert, y);
}

template <typename T>
void gather(const int64_t* rows, int count, int bits, int group, const QbWeight& w, int K,
            T* out) {
#pragma omp parallel
  SLUICE_QB_DISPATCH(bits, group, w.s != nullptr,
                     (sluice::qblock_gather_t<B, G, IQ>(rows, count, w, K, out)))
}

}  // namespace

namespace sluice {
SLUICE_QBLOCK_INSTANCES(, float)
SLUICE_QBLOCK_INSTANCES(, uint16_t)
}  // namespace sluice

extern "C" {

// Activation rows one pass of the int8-activation matmul serves (each weight is read
// once for up to this many rows; more take a pass per block of them).
int sluice_qblock_row_block() { return sluice::kQbRowBlock; }

// y [M, N] = x @ W.T with x quantized to int8 per block of 32 (of 256 for integer
// scales); x and y fp32 or bf16 (bf16 flag), K a multiple of 64.
void sluice_qblock_matmul(const void* x, int bf16, int M, int K, int bits, int group,
                          const uint8_t* packed, const uint8_t* hbits, const void* d,
                          const void* m, const uint16_t* s, int N, void* y) {
  const QbWeight w{packed, hbits, d, m, s};
  if (bf16)
    matmul(static_cast<const uint16_t*>(x), M, K, bits, group, w, N,
           static_cast<uint16_t*>(y));
  else
    matmul(static_cast<const float*>(x), M, K, bits, group, w, N,
           static_cast<float*>(y));
}

// Mixture-of-experts: W stacks E experts of N rows each ([E * N, K]); x's rows come in
// groups, group j rows group_start[j] .. group_start[j + 1] (group_start[0] = 0, the last
// M), and y [M, N] = each group's rows @ W_e.T, e = group_expert[j], as
// sluice_qblock_matmul computes them. Only the named experts' weights are read.
void sluice_qblock_matmul_experts(const void* x, int bf16, int M, int K, int bits, int group,
                                  const uint8_t* packed, const uint8_t* hbits, const void* d,
                                  const void* m, const uint16_t* s, int N, int num_groups,
                                  const int64_t* group_start, const int64_t* group_expert,
                                  void* y) {
  const QbWeight w{packed, hbits, d, m, s};
  if (bf16)
    matmul_experts(static_cast<const uint16_t*>(x), M, K, bits, group, w, N, num_groups,
                   group_start, group_expert, static_cast<uint16_t*>(y));
  else
    matmul_experts(static_cast<const float*>(x), M, K, bits, group, w, N, num_groups,
                   group_start, group_expert, static_cast<float*>(y));
}

// As sluice_qblock_matmul with x quantized in two int8 levels (x, then its residual).
void sluice_qblock_matmul_residual(const void* x, int bf16, int M, int K, int bits, int group,
                                   const uint8_t* packed, const uint8_t* hbits,
                                   const void* d, const void* m, const uint16_t* s, int N,
                                   void* y) {
  const QbWeight w{packed, hbits, d, m, s};
  if (bf16)
    matmul_residual(static_cast<const uint16_t*>(x), M, K, bits, group, w, N,
                    static_cast<uint16_t*>(y));
  else
    matmul_residual(static_cast<const float*>(x), M, K, bits, group, w, N,
                    static_cast<float*>(y));
}

// The output head: as sluice_qblock_matmul_residual for every logit that may be the
// greedy pick, one int8 level for the rest; row_norm [N]: each weight row's L2 norm
// (rounded up).
// first: that one level from the block kernel (0), the int8 GEMM (1), the int8 GEMM on
// AMX-INT8 tiles where this library has them (2; the caller holds the tile state), or
// the panel kernel on a Q4_K or Q6_K weight in panel order (3: qpanel.h's layout).
void sluice_qblock_matmul_head(const void* x, int bf16, int M, int K, int bits, int group,
                               const uint8_t* packed, const uint8_t* hbits, const void* d,
                               const void* m, const uint16_t* s, int N, const float* row_norm,
                               int first, void* y) {
  const QbWeight w{packed, hbits, d, m, s};
  if (bf16)
    matmul_head(static_cast<const uint16_t*>(x), M, K, bits, group, w, N, row_norm, first,
                static_cast<uint16_t*>(y));
  else
    matmul_head(static_cast<const float*>(x), M, K, bits, group, w, N, row_norm, first,
                static_cast<float*>(y));
}

// As sluice_qblock_matmul with unquantized activations (fp32 accumulation).
void sluice_qblock_matmul_float(const void* x, int bf16, int M, int K, int bits, int group,
                                const uint8_t* packed, const uint8_t* hbits, const void* d,
                                const void* m, const uint16_t* s, int N, void* y) {
  const QbWeight w{packed, hbits, d, m, s};
  if (bf16)
    matmul_float(static_cast<const uint16_t*>(x), M, K, bits, group, w, N,
                 static_cast<uint16_t*>(y));
  else
    matmul_float(static_cast<const float*>(x), M, K, bits, group, w, N,
                 static_cast<float*>(y));
}

// out [N, K] = W in natural order, fp32 or bf16 (out_bf16).
void sluice_qblock_dequantize(int bits, int group, const uint8_t* packed, const uint8_t* hbits,
                              const void* d, const void* m, const uint16_t* s, int K, int N,
                              void* out, int out_bf16) {
  const QbWeight w{packed, hbits, d, m, s};
  if (out_bf16)
    gather(nullptr, N, bits, group, w, K, static_cast<uint16_t*>(out));
  else
    gather(nullptr, N, bits, group, w, K, static_cast<float*>(out));
}

// out [T, K] = W[ids] (token embeddings), fp32 or bf16 (out_bf16).
void sluice_qblock_embedding(const int64_t* ids, int T, int bits, int group,
                             const uint8_t* packed, const uint8_t* hbits, const void* d,
                             const void* m, const uint16_t* s, int K, void* out, int out_bf16) {
  const QbWeight w{packed, hbits, d, m, s};
  if (out_bf16)
    gather(ids, T, bits, group, w, K, static_cast<uint16_t*>(out));
  else
    gather(ids, T, bits, group, w, K, static_cast<float*>(out));
}
}
