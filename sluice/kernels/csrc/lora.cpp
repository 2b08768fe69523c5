// C entry points of the LoRA shrink and expand (lora.h): fp32 or bf16 activations,
// adapter matrices in the activations' type or int8, fp32 low-rank products.
#include "lora.h"

namespace {
// Below this many multiply-adds a call stays on one thread (a decode step's few rows:
// waking the team costs more than it saves).
constexpr int64_t kParallelWork = 1 << 18;
}  // namespace

extern "C" {

// The columns of a tile of B^T (kLoraTile): the slots' layout the Python side builds.
int sluice_lora_tile_columns() { return sluice::kLoraTile; }

// scale: null where A is in x's type; else A is int8 and u's columns are scaled by it.
void sluice_lora_shrink(int bf16, const void* x, int64_t rows, int in_dim, const void* a,
                        const float* scale, int r_total, int rank, const int32_t* slots,
                        const int32_t* ranks, float* u) {
#pragma omp parallel if (rows * r_total * in_dim > kParallelWork)
  if (bf16)
    sluice::lora_shrink_stored(static_cast<const uint16_t*>(x), rows, in_dim, a, scale, r_total,
                               rank, slots, ranks, u);
  else
    sluice::lora_shrink_stored(static_cast<const float*>(x), rows, in_dim, a, scale, r_total,
                               rank, slots, ranks, u);
}

// bt_int8: B^T is int8 (its scales in u, from the shrink), else in y's type.
void sluice_lora_expand(int bf16, const float* u, int64_t rows, int rank, int n_slices,
                        const int32_t* offsets, const void* bt, int bt_int8, int out_dim,
                        const int32_t* slots, const int32_t* ranks, void* y) {
#pragma omp parallel if (rows * out_dim * rank > kParallelWork)
  if (bf16)
    sluice::lora_expand_stored(u, rows, rank, n_slices, offsets, bt, bt_int8 != 0, out_dim,
                               slots, ranks, static_cast<uint16_t*>(y));
  else
    sluice::lora_expand_stored(u, rows, rank, n_slices, offsets, bt, bt_int8 != 0, out_dim,
                               slots, ranks, static_cast<float*>(y));
}

}  // extern "C"
