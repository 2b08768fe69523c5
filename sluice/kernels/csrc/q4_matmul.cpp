// C entry points of the 4-bit matmul (q4_matmul.h).
#include <cstdint>

#include "q4_matmul.h"

extern "C" {

int sluice_q4_matmul_available() {
#if SLUICE_Q4_VNNI
  return 1;
#else
  return 0;
#endif
}

// x [M, K] fp32 or bf16 (same dtype as y [M, N]); K a multiple of 64.
void sluice_q4_matmul(const void* x, int bf16, int M, int K, const uint8_t* qw,
                      const uint16_t* d, const uint16_t* m, int N, void* y) {
#if SLUICE_Q4_VNNI
  sluice::Q4Activations xa;
  if (bf16) {
    xa.quantize(static_cast<const uint16_t*>(x), M, K);
#pragma omp parallel
    sluice::q4_rows(xa, M, K, qw, d, m, N, static_cast<uint16_t*>(y));
  } else {
    xa.quantize(static_cast<const float*>(x), M, K);
#pragma omp parallel
    sluice::q4_rows(xa, M, K, qw, d, m, N, static_cast<float*>(y));
  }
#else
  (void)x, (void)bf16, (void)M, (void)K, (void)qw, (void)d, (void)m, (void)N, (void)y;
#endif
}
}
