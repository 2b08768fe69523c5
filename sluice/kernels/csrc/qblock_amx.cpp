// C entry points of the AMX bf16 qblock matmul (qblock_amx.h). The weight comes as the
// other qblock entry points take it (qblock.cpp): (bits, group, packed, hbits, d, m, s).
#include <cstdint>

#include "qblock_amx.h"

extern "C" {

// Whether this library has sluice_qblock_amx's tile path (the avx512 build, from a
// compiler that knows AMX).
int sluice_amx(void) {
#if defined(SLUICE_AMX)
  return 1;
#else
  return 0;
#endif
}

// y [M, N] = x @ W.T for bf16 x and y (bf16 must be 1), the weight dequantized to bf16
// a panel of 32 rows at a time, on AMX tiles; K a multiple of 64. The caller holds the
// tile state (arch_prctl). Returns 0, or -1 (nothing written) for fp32 x or where the
// library has no tile path.
int sluice_qblock_amx(const void* x, int bf16, int M, int K, int bits, int group,
                      const uint8_t* packed, const uint8_t* hbits, const void* d, const void* m,
                      const uint16_t* s, int N, void* y) {
#if defined(SLUICE_AMX)
  if (!bf16) return -1;
  const sluice::QbWeight w{packed, hbits, d, m, s};
  const auto* xb = static_cast<const uint16_t*>(x);
  auto* yb = static_cast<uint16_t*>(y);
  sluice::AmxActivations a;  // shared: one thread sizes it, all copy their rows
#pragma omp parallel
  SLUICE_QB_DISPATCH(bits, group, w.s != nullptr,
                     (sluice::qblock_amx_t<B, G, IQ>(xb, M, K, w, N, yb, a)))
  return 0;
#else
  (void)x, (void)bf16, (void)M, (void)K, (void)bits, (void)group, (void)packed, (void)hbits;
  (void)d, (void)m, (void)s, (void)N, (void)y;
  return -1;
#endif
}

// Threads' shares of sluice_qblock_amx calls that ran on the tiles so far.
int64_t sluice_amx_calls(void) {
#if defined(SLUICE_AMX)
  return sluice::amx_calls.load();
#else
  return 0;
#endif
}
}
