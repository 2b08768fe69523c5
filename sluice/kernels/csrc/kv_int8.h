// The int8 KV cache's rows (kv_cache_dtype="int8"): one (token, kv head) row is
// head_dim signed bytes followed by one IEEE fp16 scale per group of 32 channels, the
// q8_0 idea laid out per row, so that a block keeps its [kv_heads, block_size, row]
// shape and a head's tokens stay one contiguous run. Symmetric: x ~= q * scale with
// scale = max|x| / 127 over the group, q in [-127, 127]. The torch reference is
// sluice/attention/kv_int8.py; the two round the same way.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dtype.h"

namespace sluice {

constexpr int kKvGroup = 32;

// One byte of an int8 KV row: its own type, so the attention kernel's overloads can
// tell a quantized pool from a bf16 (uint16_t) or fp32 one.
struct kv8 {
  int8_t v;
};

inline int row_elems(const float*, int head_dim) { return head_dim; }
inline int row_elems(const uint16_t*, int head_dim) { return head_dim; }
inline int row_elems(const kv8*, int head_dim) { return head_dim + 2 * (head_dim / kKvGroup); }

// The fp16 bits of group g's scale in a row.
inline uint16_t kv8_scale_bits(const kv8* row, int head_dim, int g) {
  uint16_t h;
  std::memcpy(&h, reinterpret_cast<const char*>(row) + head_dim + 2 * g, sizeof(h));
  return h;
}

// fp32 -> IEEE fp16, round to nearest even (what torch's .to(torch.float16) does).
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) return static_cast<uint16_t>(sign | (x > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (x >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds past 65504
  if (x < 0x38800000u) {  // below fp16's smallest normal: a subnormal (or zero)
    if (x < 0x33000000u) return static_cast<uint16_t>(sign);  // at most 2^-25: rounds to 0
    const uint32_t e = x >> 23, m = (x & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - e;  // value = m * 2^(e-150) = (m >> shift) * 2^-24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = x - 0x38000000u;  // rebias the exponent 127 -> 15
  r = (r + 0x0FFFu + ((r >> 13) & 1u)) >> 13;
  return static_cast<uint16_t>(sign | r);
}

// src[0 .. head_dim) into one int8 row at dst.
template <typename T>
void quantize_kv_row(const T* src, kv8* dst, int head_dim) {
  for (int g = 0; g < head_dim / kKvGroup; ++g) {
    const T* x = src + g * kKvGroup;
    float amax = 0.f;
    for (int i = 0; i < kKvGroup; ++i) amax = std::fmax(amax, std::fabs(to_float(x[i])));
    const uint16_t bits = float_to_half(amax / 127.f);
    const float scale = half_to_float(bits);
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    for (int i = 0; i < kKvGroup; ++i) {
      const float q = std::nearbyint(to_float(x[i]) * inv);
      dst[g * kKvGroup + i].v = static_cast<int8_t>(q > 127.f ? 127.f : (q < -127.f ? -127.f : q));
    }
    std::memcpy(reinterpret_cast<char*>(dst) + head_dim + 2 * g, &bits, sizeof(bits));
  }
}

// write_kv (paged_attention.h) for int8 pools: each new token's K and V rows are
// quantized straight into their cache slots.
template <typename T>
void write_kv_int8(const T* k, const T* v, int64_t src_stride, kv8* k_cache, kv8* v_cache,
                   const int64_t* slots, int64_t num_tokens, int num_kv_heads, int block_size,
                   int head_dim) {
  const int64_t row = row_elems(k_cache, head_dim);
#pragma omp parallel for if (num_tokens > 64) schedule(static)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    for (int h = 0; h < num_kv_heads; ++h) {
      const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * row;
      const int64_t src = t * src_stride + static_cast<int64_t>(h) * head_dim;
      quantize_kv_row(k + src, k_cache + dst, head_dim);
      quantize_kv_row(v + src, v_cache + dst, head_dim);
    }
  }
}

}  // namespace sluice
