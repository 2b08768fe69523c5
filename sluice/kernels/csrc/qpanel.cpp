// C entry points of the panel-order K-quant weights (qpanel.h): the repack from the
// row-major qblock layout, and the matmuls on it. The weight comes as the qblock entry
// points take it, (bits, group, packed, hbits, d, m, s), in the panel layout.
#include <cstdint>

#include "qpanel.h"

namespace {

using sluice::QbWeight;

template <typename T>
void matmul(const T* x, int M, int K, int bits, int group, const QbWeight& w, int N, T* y) {
  sluice::GemmActivations a;  // shared: one thread sizes it, all fill their rows
#pragma omp parallel
  sluice::qpanel_matmul(x, M, K, bits, group, w, N, sluice::qb_out(y), a);
}

template <typename T>
void experts(const T* x, int M, int K, int bits, int group, const QbWeight& w, int N,
             int num_groups, const int64_t* start, const int64_t* expert, T* y) {
  sluice::GemmActivations a;
#pragma omp parallel
  {
    sluice::gemm_quantize(x, M, K, sluice::kQbSuper, group, sluice::qb_implied(bits),
                          w.m == nullptr, a);
    sluice::qpanel_experts(a, K, bits, group, w, N, num_groups, start, expert,
                           sluice::qb_out(y));
  }
}

}  // namespace

namespace sluice {

void qpanel_experts(const GemmActivations& a, int K, int bits, int group, const QbWeight& w,
                    int N, int num_groups, const int64_t* start, const int64_t* expert,
                    QbOut y) {
  SLUICE_QP_DISPATCH(bits, group, ({
                       for (int j = 0; j < num_groups; ++j) {
                         const int r0 = static_cast<int>(start[j]);
                         const int rows = static_cast<int>(start[j + 1] - start[j]);
                         if (rows == 0) continue;
                         const QbWeight we = qp_expert_weight<B, G>(w, K, expert[j] * N);
                         qpanel_rows_t<B, G>(a, rows, K, we, N, y, r0, /*wait=*/false);
                       }
                     }))
#pragma omp barrier
}

SLUICE_QPANEL_INSTANCES(, float)
SLUICE_QPANEL_INSTANCES(, uint16_t)

}  // namespace sluice

extern "C" {

// The row-major qblock weight (N rows, K a multiple of 256; Q4_K or Q6_K, integer
// scales) in panel order into out_* (sized for ceil(N / 32) panels: qpanel.h); rows past
// N are zero. Returns 0, or -1 for a format without a panel layout.
// 1 where the panel kernel's sums are the int8 GEMM's (qblock_gemm: AVX-512 and the
// portable level), 0 where they are its own (avx2: integer scales summed in int32).
int sluice_qpanel_gemm_sums(void) { return sluice::kGemmInt16Sums ? 0 : 1; }

int sluice_qpanel_repack(int bits, int group, const uint8_t* packed, const uint8_t* hbits,
                         const void* d, const void* m, const uint16_t* s, int K, int N,
                         uint8_t* out_packed, uint8_t* out_hbits, void* out_d, void* out_m,
                         uint16_t* out_s) {
  if (!sluice::qp_format(bits, group) || s == nullptr) return -1;
  const QbWeight src{packed, hbits, d, m, s};
  const QbWeight dst{out_packed, out_hbits, out_d, m ? out_m : nullptr, out_s};
  const int panels = (N + sluice::kQpCols - 1) / sluice::kQpCols;
#pragma omp parallel
  {
    sluice::GemmPanel scratch;
#pragma omp for schedule(static)
    for (int p = 0; p < panels; ++p)
      SLUICE_QP_DISPATCH(bits, group, (sluice::qp_repack_panel<B, G>(src, K, N, p * sluice::kQpCols,
                                                                     scratch, dst, p)))
  }
  return 0;
}

// y [M, N] = x @ W.T (x fp32 or bf16: bf16 flag) for a panel weight, x quantized to int8
// per 256 values as sluice_qblock_gemm quantizes it; any M, the same sums per row.
void sluice_qpanel_matmul(const void* x, int bf16, int M, int K, int bits, int group,
                          const uint8_t* packed, const uint8_t* hbits, const void* d,
                          const void* m, const uint16_t* s, int N, void* y) {
  const QbWeight w{packed, hbits, d, m, s};
  if (bf16)
    matmul(static_cast<const uint16_t*>(x), M, K, bits, group, w, N, static_cast<uint16_t*>(y));
  else
    matmul(static_cast<const float*>(x), M, K, bits, group, w, N, static_cast<float*>(y));
}

// Mixture-of-experts on stacked panel weights (E experts of N rows, N a multiple of 32):
// as sluice_qblock_matmul_experts, each group's rows times its expert.
void sluice_qpanel_experts(const void* x, int bf16, int M, int K, int bits, int group,
                           const uint8_t* packed, const uint8_t* hbits, const void* d,
                           const void* m, const uint16_t* s, int N, int num_groups,
                           const int64_t* group_start, const int64_t* group_expert, void* y) {
  const QbWeight w{packed, hbits, d, m, s};
  if (bf16)
    experts(static_cast<const uint16_t*>(x), M, K, bits, group, w, N, num_groups, group_start,
            group_expert, static_cast<uint16_t*>(y));
  else
    experts(static_cast<const float*>(x), M, K, bits, group, w, N, num_groups, group_start,
            group_expert, static_cast<float*>(y));
}
}
