// C entry points of the 4-bit matmul (q4_matmul.h), and the library's variant name.
#include <cstdint>

#include "isa.h"
#include "q4_matmul.h"

extern "C" {

// The instruction-set level these sources were compiled for (isa.h): lets the loader
// and the tests check that the variant they asked for is the one that runs.
const char* sluice_variant() { return SLUICE_ISA_NAME; }

// x [M, K] fp32 or bf16 (same dtype as y [M, N]); K a multiple of 64.
void sluice_q4_matmul(const void* x, int bf16, int M, int K, const uint8_t* qw,
                      const uint16_t* d, const uint16_t* m, int N, void* y) {
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
}
}
