// C entry points of the qblock kernels (qblock.h, qblock_float.h). Every one takes the
// weight as (bits, group, packed, hbits, d, m): hbits is null unless bits == 5.
#include <cstdint>
#include <vector>

#include "q8_matmul.h"
#include "qblock.h"
#include "qblock_float.h"

namespace {

template <typename T>
void matmul(const T* x, int M, int K, int bits, int group, const uint8_t* packed,
            const uint8_t* hbits, const uint16_t* d, const uint16_t* m, int N, T* y) {
  sluice::QBlockActivations xa;
  xa.quantize(x, M, K, group);
#pragma omp parallel
  sluice::qblock_rows(xa, M, K, bits, group, packed, hbits, d, m, N, y);
}

template <typename T>
void matmul_float(const T* x, int M, int K, int bits, int group, const uint8_t* packed,
                  const uint8_t* hbits, const uint16_t* d, const uint16_t* m, int N, T* y) {
  const std::vector<float> xf = sluice::pair_ordered(x, M, K);
#pragma omp parallel
  SLUICE_QB_DISPATCH(bits, group,
                     (sluice::qblock_float_rows_t<B, G>(xf.data(), M, K, packed, hbits, d, m, N, y)))
}

template <typename T>
void gather(const int64_t* rows, int count, int bits, int group, const uint8_t* packed,
            const uint8_t* hbits, const uint16_t* d, const uint16_t* m, int K, T* out) {
#pragma omp parallel
  SLUICE_QB_DISPATCH(bits, group,
                     (sluice::qblock_gather_t<B, G>(rows, count, packed, hbits, d, m, K, out)))
}

}  // namespace

extern "C" {

// y [M, N] = x @ W.T with x quantized to int8 per block of 32; x and y fp32 or bf16
// (bf16 flag), K a multiple of 64.
void sluice_qblock_matmul(const void* x, int bf16, int M, int K, int bits, int group,
                          const uint8_t* packed, const uint8_t* hbits, const uint16_t* d,
                          const uint16_t* m, int N, void* y) {
  if (bf16)
    matmul(static_cast<const uint16_t*>(x), M, K, bits, group, packed, hbits, d, m, N,
           static_cast<uint16_t*>(y));
  else
    matmul(static_cast<const float*>(x), M, K, bits, group, packed, hbits, d, m, N,
           static_cast<float*>(y));
}

// As sluice_qblock_matmul with unquantized activations (fp32 accumulation).
void sluice_qblock_matmul_float(const void* x, int bf16, int M, int K, int bits, int group,
                                const uint8_t* packed, const uint8_t* hbits, const uint16_t* d,
                                const uint16_t* m, int N, void* y) {
  if (bf16)
    matmul_float(static_cast<const uint16_t*>(x), M, K, bits, group, packed, hbits, d, m, N,
                 static_cast<uint16_t*>(y));
  else
    matmul_float(static_cast<const float*>(x), M, K, bits, group, packed, hbits, d, m, N,
                 static_cast<float*>(y));
}

// out [N, K] = W in natural order, fp32 or bf16 (out_bf16).
void sluice_qblock_dequantize(int bits, int group, const uint8_t* packed, const uint8_t* hbits,
                              const uint16_t* d, const uint16_t* m, int K, int N, void* out,
                              int out_bf16) {
  if (out_bf16)
    gather(nullptr, N, bits, group, packed, hbits, d, m, K, static_cast<uint16_t*>(out));
  else
    gather(nullptr, N, bits, group, packed, hbits, d, m, K, static_cast<float*>(out));
}

// out [T, K] = W[ids] (token embeddings), fp32 or bf16 (out_bf16).
void sluice_qblock_embedding(const int64_t* ids, int T, int bits, int group,
                             const uint8_t* packed, const uint8_t* hbits, const uint16_t* d,
                             const uint16_t* m, int K, void* out, int out_bf16) {
  if (out_bf16)
    gather(ids, T, bits, group, packed, hbits, d, m, K, static_cast<uint16_t*>(out));
  else
    gather(ids, T, bits, group, packed, hbits, d, m, K, static_cast<float*>(out));
}
}
