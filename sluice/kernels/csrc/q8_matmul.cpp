// C entry point of the 8-bit matmul (q8_matmul.h).
#include <cstdint>

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
}
