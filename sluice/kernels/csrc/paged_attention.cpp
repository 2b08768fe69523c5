// C entry points of the paged attention kernel (paged_attention.h).
#include <cstdint>

#include "paged_attention.h"

// window: a sliding window's size in tokens (each query sees its last `window`
// positions), or 0 for full causal attention. sinks: each query head's attention-sink
// logit (fp32, gpt-oss), or null for none.

namespace {

template <typename T, typename C>
void attend(const T* q, const C* k, const C* v, const int64_t* bt, int64_t max_blocks,
            const int64_t* qs, const int64_t* ctx, T* out, int num_seqs, int num_heads,
            int num_kv_heads, int head_dim, int block_size, float scale, int64_t q_stride,
            int64_t window, const float* sinks) {
#pragma omp parallel
  sluice::attend_tasks(q, k, v, bt, max_blocks, qs, ctx, out, num_seqs, num_heads,
                       num_kv_heads, head_dim, block_size, scale, q_stride, window, sinks);
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
                                int64_t q_stride, int64_t window, const float* sinks) {
  attend(q, k, v, bt, max_blocks, qs, ctx, out, num_seqs, num_heads, num_kv_heads, head_dim,
         block_size, scale, q_stride, window, sinks);
}

void sluice_paged_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                 const int64_t* bt, int64_t max_blocks, const int64_t* qs,
                                 const int64_t* ctx, uint16_t* out, int num_seqs,
                                 int num_heads, int num_kv_heads, int head_dim, int block_size,
                                 float scale, int64_t q_stride, int64_t window,
                                 const float* sinks) {
  attend(q, k, v, bt, max_blocks, qs, ctx, out, num_seqs, num_heads, num_kv_heads, head_dim,
         block_size, scale, q_stride, window, sinks);
}

// The same over an int8 pool (kv_int8.h): k and v point at its rows' bytes.
void sluice_paged_attention_f32_kv8(const float* q, const void* k, const void* v,
                                    const int64_t* bt, int64_t max_blocks, const int64_t* qs,
                                    const int64_t* ctx, float* out, int num_seqs,
                                    int num_heads, int num_kv_heads, int head_dim,
                                    int block_size, float scale, int64_t q_stride,
                                    int64_t window, const float* sinks) {
  attend(q, static_cast<const sluice::kv8*>(k), static_cast<const sluice::kv8*>(v), bt,
         max_blocks, qs, ctx, out, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
         scale, q_stride, window, sinks);
}

void sluice_paged_attention_bf16_kv8(const uint16_t* q, const void* k, const void* v,
                                     const int64_t* bt, int64_t max_blocks, const int64_t* qs,
                                     const int64_t* ctx, uint16_t* out, int num_seqs,
                                     int num_heads, int num_kv_heads, int head_dim,
                                     int block_size, float scale, int64_t q_stride,
                                     int64_t window, const float* sinks) {
  attend(q, static_cast<const sluice::kv8*>(k), static_cast<const sluice::kv8*>(v), bt,
         max_blocks, qs, ctx, out, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
         scale, q_stride, window, sinks);
}

// New K/V rows quantized into an int8 pool; bf16: the rows are bf16, else fp32.
void sluice_write_kv_int8(const void* k, const void* v, int64_t src_stride, void* k_cache,
                          void* v_cache, const int64_t* slots, int64_t num_tokens,
                          int num_kv_heads, int block_size, int head_dim, int bf16) {
  auto* kc = static_cast<sluice::kv8*>(k_cache);
  auto* vc = static_cast<sluice::kv8*>(v_cache);
  if (bf16)
    sluice::write_kv_int8(static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v),
                          src_stride, kc, vc, slots, num_tokens, num_kv_heads, block_size,
                          head_dim);
  else
    sluice::write_kv_int8(static_cast<const float*>(k), static_cast<const float*>(v),
                          src_stride, kc, vc, slots, num_tokens, num_kv_heads, block_size,
                          head_dim);
}

void sluice_write_kv(const void* k, const void* v, int64_t src_stride, void* k_cache,
                     void* v_cache, const int64_t* slots, int64_t num_tokens, int num_kv_heads,
                     int block_size, int head_dim, int elem_size) {
  sluice::write_kv(k, v, src_stride, k_cache, v_cache, slots, num_tokens, num_kv_heads,
                   block_size, head_dim, elem_size);
}
}
