// C entry points of the paged attention kernel (paged_attention.h).
#include <cstdint>

#include "paged_attention.h"

// window: a sliding window's size in tokens (each query sees its last `window`
// positions), or 0 for full causal attention.

namespace {

template <typename T>
void attend(const T* q, const T* k, const T* v, const int64_t* bt, int64_t max_blocks,
            const int64_t* qs, const int64_t* ctx, T* out, int num_seqs, int num_heads,
            int num_kv_heads, int head_dim, int block_size, float scale, int64_t q_stride,
            int64_t window) {
#pragma omp parallel
  sluice::attend_tasks(q, k, v, bt, max_blocks, qs, ctx, out, num_seqs, num_heads,
                       num_kv_heads, head_dim, block_size, scale, q_stride, window);
}

}  // namespace

extern "C" {

// Whether head_dim takes this level's vectorized math (else the generic loops).
int sluice_attention_vectorized(int head_dim) {
  return sluice::vectorized_head_dim(head_dim) ? 1 : 0;
}

void sluice_paged_attention_f32(const float* q, const float* k, const float* v,
                                const int64_t* bt, int64_t max_blocks, const int64_t* qs,
                                const int64_t* ctx, float* out, int num_seqs, int num_heads,
                                int num_kv_heads, int head_dim, int block_size, float scale,
                                int64_t q_stride, int64_t window) {
  attend(q, k, v, bt, max_blocks, qs, ctx, out, num_seqs, num_heads, num_kv_heads, head_dim,
         block_size, scale, q_stride, window);
}

void sluice_paged_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                 const int64_t* bt, int64_t max_blocks, const int64_t* qs,
                                 const int64_t* ctx, uint16_t* out, int num_seqs,
                                 int num_heads, int num_kv_heads, int head_dim, int block_size,
                                 float scale, int64_t q_stride, int64_t window) {
  attend(q, k, v, bt, max_blocks, qs, ctx, out, num_seqs, num_heads, num_kv_heads, head_dim,
         block_size, scale, q_stride, window);
}

void sluice_write_kv(const void* k, const void* v, int64_t src_stride, void* k_cache,
                     void* v_cache, const int64_t* slots, int64_t num_tokens, int num_kv_heads,
                     int block_size, int head_dim, int elem_size) {
  sluice::write_kv(k, v, src_stride, k_cache, v_cache, slots, num_tokens, num_kv_heads,
                   block_size, head_dim, elem_size);
}
}
