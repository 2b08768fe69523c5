// 8-bit weight x 8-bit activation matmul for small batches (decode) on AVX-512 VNNI.
//
// Weights: symmetric int8 per output channel, w = s * q. vpdpbusd multiplies unsigned
// by signed bytes, so they are stored offset, u = q + 128, and the offset comes back
// out per activation block: sum_i u_i qx_i = sum_i q_i qx_i + 128 * sum_i qx_i.
// Activations are quantized per call exactly as for the 4-bit kernel (q4_matmul.h:
// int8 in blocks of 32, each pair of blocks stored as [b0 low, b1 low, b0 high,
// b1 high] halves); the weight bytes are stored in that same order at load time, so
// one 64-byte load of each feeds one vpdpbusd:
//   y_n = s_n * (sum_b dx_b * sum_{i in b} u_i qx_i  -  128 * sum_b dx_b * sum(qx_b)).
#pragma once
#include <cstdint>
#include <vector>

#include "dtype.h"
#include "q4_matmul.h"

namespace sluice {

#if SLUICE_Q4_VNNI
// y [M, N] = x @ w.T for quantized x; weight rows shared out by an orphaned `omp for`
// (called by every thread of an enclosing parallel region; barrier at the end).
template <typename T>
void q8_rows(const Q4Activations& xa, int M, int K, const uint8_t* qw, const float* scale, int N,
             T* y) {
  const int nb = K / 32, np = K / 64;
  const __m512i lanes = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  // The offset term does not depend on the weight row: once per activation row.
  std::vector<float> offset(M);
  for (int r = 0; r < M; ++r) {
    float s = 0.f;
    for (int b = 0; b < nb; ++b) s += xa.sx[static_cast<size_t>(r) * nb + b];
    offset[r] = 128.f * s;
  }
#pragma omp for schedule(static)
  for (int n = 0; n < N; ++n) {
    const uint8_t* wr = qw + static_cast<int64_t>(n) * K;
    for (int r = 0; r < M; ++r) {
      const int8_t* xr = xa.q.data() + static_cast<int64_t>(r) * K;
      const float* dxr = xa.dx.data() + static_cast<int64_t>(r) * nb;
      // Two accumulators: consecutive pairs do not wait on each other's FMA.
      __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int p = 0; p < np; ++p) {
        const __m512i w = _mm512_loadu_si512(wr + 64 * p);
        const __m512i x = _mm512_loadu_si512(xr + 64 * p);
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, x));
        const __m128 dx2 =
            _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dxr + 2 * p)));
        const __m512 sc = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(dx2));
        acc[p & 1] = _mm512_fmadd_ps(dot, sc, acc[p & 1]);
      }
      const float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
      T* dst = y + static_cast<int64_t>(r) * N + n;
      *dst = sluice::round_to(dst, scale[n] * (sum - offset[r]));
    }
  }
}
#endif

}  // namespace sluice
