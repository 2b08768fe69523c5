// C entry points of the LoRA shrink and expand (lora.h): fp32 or bf16 activations and
// adapter matrices, fp32 low-rank products.
#include "lora.h"

namespace {
// Below this many multiply-adds a call stays on one thread (a decode step's few rows:
// waking the team costs more than it saves).
constexpr int64_t kParallelWork = 1 << 18;
}  // namespace

extern "C" {

void sluice_lora_shrink(int bf16, const void* x, int64_t rows, int in_dim, const void* a,
                        int r_total, int rank, const int32_t* slots, const int32_t* ranks,
                        float* u) {
#pragma omp parallel if (rows * r_total * in_dim > kParallelWork)
  if (bf16)
    sluice::lora_shrink(static_cast<const uint16_t*>(x), rows, in_dim,
                        static_cast<const uint16_t*>(a), r_total, rank, slots, ranks, u);
  else
    sluice::lora_shrink(static_cast<const float*>(x), rows, in_dim, static_cast<const float*>(a),
                        r_total, rank, slots, ranks, u);
}

void sluice_lora_expand(int bf16, const float* u, int64_t rows, int rank, int n_slices,
                        const int32_t* offsets, const void* bt, int out_dim,
                        const int32_t* slots, const int32_t* ranks, void* y) {
#pragma omp parallel if (rows * out_dim * rank > kParallelWork)
  if (bf16)
    sluice::lora_expand(u, rows, rank, n_slices, offsets, static_cast<const uint16_t*>(bt),
                        out_dim, slots, ranks, static_cast<uint16_t*>(y));
  else
    sluice::lora_expand(u, rows, rank, n_slices, offsets, static_cast<const float*>(bt), out_dim,
                        slots, ranks, static_cast<float*>(y));
}

}  // extern "C"
