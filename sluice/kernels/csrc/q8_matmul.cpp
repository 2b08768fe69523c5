// C entry point of the 8-bit matmul (q8_matmul.h).
#include <cstdint>
#include <vector>

#include "q8_matmul.h"

extern "C" {

// x [M, K] fp32 or bf16 (same dtype as y [M, N]); K a multiple of 64;
// qw [N, K] offset bytes in pair order, scale [N] fp32.
void sluice_q8_matmul(const void* x, int bf16, int M, int K, const uint8_t* qw,
                      const float* scale, int N, void* y) {
  sluice::Q4Activations xa;
  if (bf16) {
    xa.quantize(static_cast<const uint16_t*>(x), M, K);
#pragma omp parallel
    sluice::q8_rows(xa, M, K, qw, scale, N, static_cast<uint16_t*>(y));
  } else {
    xa.quantize(static_cast<const float*>(x), M, K);
#pragma omp parallel
    sluice::q8_rows(xa, M, K, qw, scale, N, static_cast<float*>(y));
  }
}

// As sluice_q8_matmul, but the activations stay unquantized (fp32 accumulation).
void sluice_q8_matmul_float(const void* x, int bf16, int M, int K, const uint8_t* qw,
                            const float* scale, int N, void* y) {
  if (bf16) {
    const std::vector<float> xf = sluice::pair_ordered(static_cast<const uint16_t*>(x), M, K);
#pragma omp parallel
    sluice::q8f_rows(xf.data(), M, K, qw, scale, N, static_cast<uint16_t*>(y));
  } else {
    const std::vector<float> xf = sluice::pair_ordered(static_cast<const float*>(x), M, K);
#pragma omp parallel
    sluice::q8f_rows(xf.data(), M, K, qw, scale, N, static_cast<float*>(y));
  }
}
}
