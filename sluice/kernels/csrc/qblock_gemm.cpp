// C entry point of the compute-bound qblock matmul (qblock_gemm.h). The weight comes as
// the other qblock entry points take it (qblock.cpp): (bits, group, packed, hbits, d,
// m, s).
#include <cstdint>

#include "qblock_gemm.h"

namespace {

template <typename T>
void gemm(const T* x, int M, int K, int bits, int group, const sluice::QbWeight& w, int N,
          T* y) {
  sluice::GemmActivations a;  // shared: one thread sizes it, all fill their rows
#pragma omp parallel
  SLUICE_QB_DISPATCH(bits, group, w.s != nullptr,
                     (sluice::qblock_gemm_t<B, G, IQ>(x, M, K, w, N, y, a)))
}

}  // namespace

extern "C" {

// y [M, N] = x @ W.T for many rows of x (fp32 or bf16, bf16 flag), x quantized to int8
// per 32 values (per 256 for integer scales) as sluice_qblock_matmul quantizes it, the
// weight unpacked a panel of 32 rows at a time; K a multiple of 64.
void sluice_qblock_gemm(const void* x, int bf16, int M, int K, int bits, int group,
                        const uint8_t* packed, const uint8_t* hbits, const void* d,
                        const void* m, const uint16_t* s, int N, void* y) {
  const sluice::QbWeight w{packed, hbits, d, m, s};
  if (bf16)
    gemm(static_cast<const uint16_t*>(x), M, K, bits, group, w, N, static_cast<uint16_t*>(y));
  else
    gemm(static_cast<const float*>(x), M, K, bits, group, w, N, static_cast<float*>(y));
}
}
