// C entry points of the compute-bound qblock matmul (qblock_gemm.h, and on AMX-INT8
// tiles qblock_gemm_amx.h). The weight comes as the other qblock entry points take it
// (qblock.cpp): (bits, group, packed, hbits, d, m, s).
#include <cstdint>

#include "qblock_gemm_amx.h"

namespace {

template <typename T>
void gemm(const T* x, int M, int K, int bits, int group, const sluice::QbWeight& w, int N,
          bool tiles, T* y) {
  sluice::GemmActivations a;  // shared: one thread sizes it, all fill their rows
#pragma omp parallel
  sluice::qblock_gemm_on(tiles, x, M, K, bits, group, w, N, sluice::qb_out(y), a);
}

}  // namespace

namespace sluice {
SLUICE_QBLOCK_GEMM_INSTANCES(, float)
SLUICE_QBLOCK_GEMM_INSTANCES(, uint16_t)
#if defined(SLUICE_AMX)
SLUICE_QBLOCK_GEMM_AMX_INSTANCES(, float)
SLUICE_QBLOCK_GEMM_AMX_INSTANCES(, uint16_t)
#endif
}  // namespace sluice

extern "C" {

// y [M, N] = x @ W.T for many rows of x (fp32 or bf16, bf16 flag), x quantized to int8
// per 32 values (per 256 for integer scales) as sluice_qblock_matmul quantizes it, the
// weight unpacked a panel of 32 rows at a time; K a multiple of 64. tiles: on AMX-INT8
// tiles where this library has them (the caller holds the tile state; the same sums).
void sluice_qblock_gemm(const void* x, int bf16, int M, int K, int bits, int group,
                        const uint8_t* packed, const uint8_t* hbits, const void* d,
                        const void* m, const uint16_t* s, int N, int tiles, void* y) {
  const sluice::QbWeight w{packed, hbits, d, m, s};
  if (bf16)
    gemm(static_cast<const uint16_t*>(x), M, K, bits, group, w, N, tiles != 0,
         static_cast<uint16_t*>(y));
  else
    gemm(static_cast<const float*>(x), M, K, bits, group, w, N, tiles != 0,
         static_cast<float*>(y));
}

// Threads' shares of sluice_qblock_gemm calls that ran on the int8 tiles so far.
int64_t sluice_amx_int8_calls(void) {
#if defined(SLUICE_AMX)
  return sluice::amx_int8_calls.load();
#else
  return 0;
#endif
}
}
