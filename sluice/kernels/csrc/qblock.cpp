// C entry points of the qblock kernels (qblock.h, qblock_float.h). Every one takes the
// weight as (bits, group, packed, hbits, d, m, s): hbits is null unless bits is 5 or 6,
// m null for a symmetric weight, s (the multipliers of integer scales) null for fp16
// scales.
#include <cstdint>
#include <vector>

#include "q8_matmul.h"
#include "qblock.h"
#include "qblock_float.h"

namespace {

using sluice::QbWeight;

template <typename T>
void matmul(const T* x, int M, int K, int bits, int group, const QbWeight& w, int N, T* y) {
  sluice::QBlockActivations xa;
  xa.quantize(x, M, K, group, w.s != nullptr);
#pragma omp parallel
  sluice::qblock_rows(xa, M, K, bits, group, w, N, y);
}

// Row r of x becomes rows 2r (x) and 2r + 1 (what x's int8 blocks leave out, x - dx * q,
// itself quantized in blocks of a scale ~254 times finer; blocks of 256 values for a
// weight with integer scales, of 32 else): the int8 kernel then sees each value to ~15
// bits where one level keeps 8, and a weight pair unpacked once serves both rows. The
// output head's logits decide greedy picks among near-ties, so it needs more than int8; this gets that at the int8 kernel's bandwidth instead of
// the float kernel's instruction count (its 6-bit head was compute-bound).
template <typename T>
std::vector<float> with_residuals(const T* x, int M, int K, bool integer) {
  sluice::QBlockActivations coarse;
  coarse.quantize(x, M, K, 0, integer);
  std::vector<float> out(static_cast<size_t>(2) * M * K);
  for (int r = 0; r < M; ++r) {
    const T* xr = x + static_cast<int64_t>(r) * K;
    float* whole = out.data() + static_cast<int64_t>(2 * r) * K;
    float* rest = whole + K;
    const int8_t* q = coarse.q.data() + static_cast<int64_t>(r) * K;  // pair positions
    const float* dx = coarse.dx.data() + static_cast<int64_t>(r) * (K / 32);
    for (int p = 0; p < K / 64; ++p)
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 16; ++i) {
          const int k = sluice::qb_run_k(p, j) + i;
          whole[k] = sluice::to_float(xr[k]);
          rest[k] = whole[k] - dx[k / 32] * static_cast<float>(q[64 * p + 16 * j + i]);
        }
  }
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

template <typename T>
void matmul_float(const T* x, int M, int K, int bits, int group, const QbWeight& w, int N, T* y) {
  const std::vector<float> xf = sluice::pair_ordered(x, M, K);
#pragma omp parallel
  SLUICE_QB_DISPATCH(bits, group, w.s != nullptr,
                     (sluice::qblock_float_rows_t<B, G, IQ>(xf.data(), M, K, w, N, y)))
}

template <typename T>
void gather(const int64_t* rows, int count, int bits, int group, const QbWeight& w, int K,
            T* out) {
#pragma omp parallel
  SLUICE_QB_DISPATCH(bits, group, w.s != nullptr,
                     (sluice::qblock_gather_t<B, G, IQ>(rows, count, w, K, out)))
}

}  // namespace

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
