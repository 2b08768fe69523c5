// Paged attention for short query chunks on CPUs: decodes (one query) and small chunks
// (a few new tokens after a prefix-cache hit, short prompts). K/V are read in place
// from the block pool, once per (sequence, kv head) whatever the number of queries;
// query j of a sequence sees positions 0 .. ctx_end - q_len + j (causal), or with a
// sliding window W > 0 only the last W of them (a local layer reads no K/V before
// them, so blocks wholly outside the window may hold anything). Exact
// two-pass softmax in fp32; with attention sinks (gpt-oss) each head's learned logit
// joins every softmax's denominator as a key that has no value. Blocks are [kv_heads, block_size, head_dim]: a task reads
// its head's rows of a block as one contiguous run (DRAM-friendly, unlike 128-byte
// pieces at a stride of all heads). An int8 pool (kv_int8.h) is read the same way, its
// rows widened to fp32 in registers as they are used: no dequantized copy anywhere.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtype.h"
#include "isa.h"
#include "kv_int8.h"

namespace sluice {

constexpr int kMaxHeadDim = 256;

// Blocks sit anywhere in the pool: ask for the next one while this one is computed.
template <typename T>
inline void prefetch(const T* p, int64_t elems) {
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + off);
}

// One (sequence, kv head)'s rows of a K or V pool, token by token: the block table is
// walked, not divided into (no 64-bit division per token), and each block, on entry,
// asks for the next one.
template <typename T>
class HeadRows {
 public:
  // Rows from token `start` on (a sliding window's first visible token).
  HeadRows(const T* cache, const int64_t* table, int64_t ctx, int block_size,
           int64_t block_stride, int64_t head_offset, int row, int64_t start)
      : cache_(cache), table_(table), ctx_(ctx), block_size_(block_size),
        block_stride_(block_stride), head_offset_(head_offset), row_(row),
        block_(start / block_size), in_block_(static_cast<int>(start % block_size)) {
    if (in_block_ != 0) {  // mid-block: the next call steps one row on from here
      p_ = cache_ + table_[block_] * block_stride_ + head_offset_ +
           static_cast<int64_t>(in_block_ - 1) * row_;
      ++block_;
    }
  }

  const T* next() {
    if (in_block_ == 0) {
      p_ = cache_ + table_[block_] * block_stride_ + head_offset_;
      if ((block_ + 1) * block_size_ < ctx_)
        prefetch(cache_ + table_[block_ + 1] * block_stride_ + head_offset_,
                 static_cast<int64_t>(block_size_) * row_);
      ++block_;
    } else {
      p_ += row_;
    }
    if (++in_block_ == block_size_) in_block_ = 0;
    return p_;
  }

 private:
  const T* cache_;
  const int64_t* table_;
  int64_t ctx_;
  int block_size_;
  int64_t block_stride_, head_offset_;
  int row_;
  int64_t block_;
  int in_block_;
  const T* p_ = nullptr;
};

// The arithmetic of the kernel: a policy, so the generic and the AVX-512 kernels share
// one loop structure. A K or V row is widened into a `Row` once and used by every
// query row of the group.
struct GenericMath {
  struct Row {
    float v[kMaxHeadDim];
  };
  int d;
  int dim() const { return d; }
  template <typename T>
  Row widen(const T* p) const {
    Row row;
    for (int i = 0; i < d; ++i) row.v[i] = sluice::to_float(p[i]);
    return row;
  }
  Row widen(const kv8* p) const {
    Row row;
    for (int g = 0; g < d / kKvGroup; ++g) {
      const float s = half_to_float(kv8_scale_bits(p, d, g));
      for (int i = g * kKvGroup; i < (g + 1) * kKvGroup; ++i) row.v[i] = p[i].v * s;
    }
    return row;
  }
  float dot(const float* q, const Row& row) const {
    float s = 0.f;
    for (int i = 0; i < d; ++i) s += q[i] * row.v[i];
    return s;
  }
  void axpy(float w, const Row& row, float* y) const {
    for (int i = 0; i < d; ++i) y[i] += w * row.v[i];
  }
  // sc[t] = exp(sc[t] - m) for t < n; returns their sum.
  float exp_sum(float* sc, int64_t n, float m) const {
    float total = 0.f;
    for (int64_t t = 0; t < n; ++t) total += sc[t] = std::exp(sc[t] - m);
    return total;
  }
};

#if defined(SLUICE_ISA_AVX512)
// AVX-512 math for the common head sizes (64, 128, 256): dot products, the weighted sum and
// exp run 16 lanes at a time. The generic loops leave dot products and exp scalar,
// which made the kernel compute bound far below memory bandwidth.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// e^x for x <= 0 (scores minus their max): 2^(x log2 e) split into integer and
// fraction, degree-6 Taylor polynomial for 2^f on |f| <= 0.5 (relative error ~1e-7).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

template <int D>
struct Avx512Math {
  static constexpr int kVecs = D / 16;
  struct Row {
    __m512 v[kVecs];  // stays in registers
  };
  static constexpr int dim() { return D; }
  template <typename T>
  Row widen(const T* p) const {
    Row row;
    for (int i = 0; i < kVecs; ++i) row.v[i] = load16(p + 16 * i);
    return row;
  }
  // Int8 rows: 16 bytes sign-extended to 16 floats, times their group's scale.
  Row widen(const kv8* p) const {
    const char* b = reinterpret_cast<const char*>(p);
    Row row;
    for (int g = 0; g < D / kKvGroup; ++g) {
      const __m512 s = _mm512_set1_ps(_cvtsh_ss(kv8_scale_bits(p, D, g)));
      for (int j = 0; j < 2; ++j) {
        const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 32 * g + 16 * j));
        row.v[2 * g + j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x)), s);
      }
    }
    return row;
  }
  float dot(const float* q, const Row& row) const {
    __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q), row.v[0]);
    for (int i = 1; i < kVecs; ++i) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * i), row.v[i], s);
    return _mm512_reduce_add_ps(s);
  }
  void axpy(float w, const Row& row, float* y) const {
    const __m512 wv = _mm512_set1_ps(w);
    for (int i = 0; i < kVecs; ++i)
      _mm512_storeu_ps(y + 16 * i, _mm512_fmadd_ps(wv, row.v[i], _mm512_loadu_ps(y + 16 * i)));
  }
  float exp_sum(float* sc, int64_t n, float m) const {
    const __m512 mv = _mm512_set1_ps(m);
    __m512 total = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + t), mv));
      _mm512_storeu_ps(sc + t, e);
      total = _mm512_add_ps(total, e);
    }
    if (t < n) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (n - t)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sc + t), mv));
      _mm512_mask_storeu_ps(sc + t, tail, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(tail, e));
    }
    return _mm512_reduce_add_ps(total);
  }
};
template <int D>
using VecMath = Avx512Math<D>;
#elif defined(SLUICE_ISA_AVX2)
// AVX2 math for the common head sizes (64, 128, 256): the AVX-512 policy at 8 lanes. exp has
// no vscalefps here: 2^n is built from n's bits in the exponent field.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// e^x for x <= 0, as exp16: n = round(x log2 e) >= -126 (x clamped at -87), so 2^n
// is a normal float whose exponent field is n + 127.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

template <int D>
struct Avx2Math {
  static constexpr int kVecs = D / 8;
  struct Row {
    __m256 v[kVecs];
  };
  static constexpr int dim() { return D; }
  template <typename T>
  Row widen(const T* p) const {
    Row row;
    for (int i = 0; i < kVecs; ++i) row.v[i] = load8(p + 8 * i);
    return row;
  }
  // Int8 rows: 8 bytes sign-extended to 8 floats, times their group's scale.
  Row widen(const kv8* p) const {
    const char* b = reinterpret_cast<const char*>(p);
    Row row;
    for (int g = 0; g < D / kKvGroup; ++g) {
      const __m256 s = _mm256_set1_ps(_cvtsh_ss(kv8_scale_bits(p, D, g)));
      for (int j = 0; j < 4; ++j) {
        const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 32 * g + 8 * j));
        row.v[4 * g + j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)), s);
      }
    }
    return row;
  }
  float dot(const float* q, const Row& row) const {
    __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(q), row.v[0]);
    __m256 s1 = _mm256_mul_ps(_mm256_loadu_ps(q + 8), row.v[1]);
    for (int i = 2; i < kVecs; i += 2) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * i), row.v[i], s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * i + 8), row.v[i + 1], s1);
    }
    return hsum8(_mm256_add_ps(s0, s1));
  }
  void axpy(float w, const Row& row, float* y) const {
    const __m256 wv = _mm256_set1_ps(w);
    for (int i = 0; i < kVecs; ++i)
      _mm256_storeu_ps(y + 8 * i, _mm256_fmadd_ps(wv, row.v[i], _mm256_loadu_ps(y + 8 * i)));
  }
  float exp_sum(float* sc, int64_t n, float m) const {
    const __m256 mv = _mm256_set1_ps(m);
    __m256 total = _mm256_setzero_ps();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), mv));
      _mm256_storeu_ps(sc + t, e);
      total = _mm256_add_ps(total, e);
    }
    float sum = hsum8(total);
    for (; t < n; ++t) sum += sc[t] = std::exp(sc[t] - m);
    return sum;
  }
};
template <int D>
using VecMath = Avx2Math<D>;
#endif

// The (sequence, kv head) tasks, shared out by an orphaned `omp for`: called by every
// thread of an enclosing parallel region (or alone, serially), with a barrier at the end.
template <typename T, typename C, typename Math>
void attend_tasks(const Math& math, const T* q, const C* k_cache, const C* v_cache,
                  const int64_t* block_tables, int64_t max_blocks, const int64_t* query_start,
                  const int64_t* ctx_end, T* out, int num_seqs, int num_heads,
                  int num_kv_heads, int block_size, float scale, int64_t q_stride,
                  int64_t window, const float* sinks) {
  const int head_dim = math.dim();  // a constant where the policy fixes it
  const int group = num_heads / num_kv_heads;
  // Block layout [kv_heads, block_size, row]: one head's tokens are contiguous. A row
  // is head_dim values, or an int8 row's bytes (kv_int8.h).
  const int row = row_elems(k_cache, head_dim);
  const int64_t head_stride = static_cast<int64_t>(block_size) * row;
  const int64_t block_stride = head_stride * num_kv_heads;
  {
    std::vector<float> qf, scores, acc, mx, sum;
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int s = 0; s < num_seqs; ++s) {
      for (int h = 0; h < num_kv_heads; ++h) {
        const int64_t q0 = query_start[s];
        const int nq = static_cast<int>(query_start[s + 1] - q0);
        const int64_t ctx = ctx_end[s];
        const int64_t first_ctx = ctx - nq + 1;  // context of the first query
        // Query j sees tokens lo_j .. first_ctx - 1 + j, lo_j = first_ctx + j - window
        // (0 without a window); scores are kept from t0, the first query's lo, on.
        const int64_t t0 = window > 0 && first_ctx > window ? first_ctx - window : 0;
        const int64_t span = ctx - t0;
        const int rows = nq * group;             // (query, head) pairs sharing this K/V
        const int64_t* table = block_tables + s * max_blocks;
        qf.resize(static_cast<size_t>(rows) * head_dim);
        scores.resize(static_cast<size_t>(rows) * span);
        acc.assign(static_cast<size_t>(rows) * head_dim, 0.f);
        mx.assign(rows, -INFINITY);
        sum.assign(rows, 0.f);
        for (int j = 0; j < nq; ++j) {
          for (int g = 0; g < group; ++g) {
            const T* qp = q + (q0 + j) * q_stride + (h * group + g) * head_dim;
            float* dst = qf.data() + (j * group + g) * head_dim;
            for (int d = 0; d < head_dim; ++d) dst[d] = sluice::to_float(qp[d]) * scale;
          }
        }
        // The query rows that see token t: j >= t - first_ctx + 1 (causal) and, with a
        // window, j < t - first_ctx + window + 1.
        auto visible = [&](int64_t t, int* r0, int* r1) {
          const int64_t j0 = t < first_ctx ? 0 : t - first_ctx + 1;
          int64_t j1 = window > 0 ? t - first_ctx + window + 1 : nq;
          j1 = j1 < nq ? j1 : nq;
          *r0 = static_cast<int>(j0) * group;
          *r1 = static_cast<int>(j1 > j0 ? j1 : j0) * group;
        };
        // Pass 1: scores and their max; each K row is widened to fp32 once for all
        // query rows of the group.
        HeadRows<C> keys(k_cache, table, ctx, block_size, block_stride, h * head_stride, row,
                         t0);
        for (int64_t t = t0; t < ctx; ++t) {
          const typename Math::Row row = math.widen(keys.next());
          int r0, r1;
          visible(t, &r0, &r1);
          for (int r = r0; r < r1; ++r) {
            const float dot = math.dot(qf.data() + r * head_dim, row);
            scores[r * span + t - t0] = dot;
            mx[r] = dot > mx[r] ? dot : mx[r];
          }
        }
        // Softmax weights over each row's visible run (and its head's sink, a logit
        // that counts in the sum and the max but adds no value).
        for (int r = 0; r < rows; ++r) {
          const int64_t j = r / group, hi = first_ctx + j;  // one past the last visible
          const int64_t lo = window > 0 && hi > window ? hi - window : 0;
          const float sink = sinks != nullptr ? sinks[h * group + r % group] : -INFINITY;
          const float m = sink > mx[r] ? sink : mx[r];
          sum[r] = math.exp_sum(scores.data() + r * span + lo - t0, hi - lo, m);
          if (sinks != nullptr) sum[r] += std::exp(sink - m);
        }
        // Pass 2: weighted sum of V.
        HeadRows<C> values(v_cache, table, ctx, block_size, block_stride, h * head_stride,
                           row, t0);
        for (int64_t t = t0; t < ctx; ++t) {
          const typename Math::Row row = math.widen(values.next());
          int r0, r1;
          visible(t, &r0, &r1);
          for (int r = r0; r < r1; ++r)
            math.axpy(scores[r * span + t - t0], row, acc.data() + r * head_dim);
        }
        for (int r = 0; r < rows; ++r) {
          const int j = r / group, g = r % group;
          T* op = out + ((q0 + j) * num_heads + h * group + g) * head_dim;
          const float inv = 1.f / sum[r];
          const float* a = acc.data() + r * head_dim;
          for (int d = 0; d < head_dim; ++d) op[d] = sluice::round_to(op, a[d] * inv);
        }
      }
    }
  }
}

// The head sizes this level's vectorized math covers; the rest take GenericMath.
inline bool vectorized_head_dim(int head_dim) {
#if defined(SLUICE_ISA_AVX512) || defined(SLUICE_ISA_AVX2)
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
#else
  (void)head_dim;
  return false;
#endif
}

// attend_tasks with the fastest math for head_dim; inside a parallel region. C is the
// pool's element: T itself, or kv8 for an int8 pool.
template <typename T, typename C>
void attend_tasks(const T* q, const C* k, const C* v, const int64_t* bt, int64_t max_blocks,
                  const int64_t* qs, const int64_t* ctx, T* out, int num_seqs, int num_heads,
                  int num_kv_heads, int head_dim, int block_size, float scale,
                  int64_t q_stride, int64_t window, const float* sinks) {
#if defined(SLUICE_ISA_AVX512) || defined(SLUICE_ISA_AVX2)
  if (head_dim == 64)
    return attend_tasks(VecMath<64>{}, q, k, v, bt, max_blocks, qs, ctx, out, num_seqs,
                        num_heads, num_kv_heads, block_size, scale, q_stride, window, sinks);
  if (head_dim == 128)
    return attend_tasks(VecMath<128>{}, q, k, v, bt, max_blocks, qs, ctx, out, num_seqs,
                        num_heads, num_kv_heads, block_size, scale, q_stride, window, sinks);
  if (head_dim == 256)  // Gemma 3
    return attend_tasks(VecMath<256>{}, q, k, v, bt, max_blocks, qs, ctx, out, num_seqs,
                        num_heads, num_kv_heads, block_size, scale, q_stride, window, sinks);
#endif
  attend_tasks(GenericMath{head_dim}, q, k, v, bt, max_blocks, qs, ctx, out, num_seqs,
               num_heads, num_kv_heads, block_size, scale, q_stride, window, sinks);
}

// New K and V rows into their cache slots. k/v: [T, kv_heads, head_dim] with token
// stride `src_stride` (slices of the qkv output); caches [blocks, kv_heads, block_size,
// head_dim]. One call replaces a copy to make the slices contiguous plus two scatters.
inline void write_kv(const void* k, const void* v, int64_t src_stride, void* k_cache,
                     void* v_cache, const int64_t* slots, int64_t num_tokens, int num_kv_heads,
                     int block_size, int head_dim, int elem_size) {
  const int64_t row = static_cast<int64_t>(head_dim) * elem_size;
#pragma omp parallel for if (num_tokens > 256) schedule(static)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    for (int h = 0; h < num_kv_heads; ++h) {
      const int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * row;
      const int64_t src = (t * src_stride + static_cast<int64_t>(h) * head_dim) * elem_size;
      std::memcpy(static_cast<char*>(k_cache) + dst, static_cast<const char*>(k) + src, row);
      std::memcpy(static_cast<char*>(v_cache) + dst, static_cast<const char*>(v) + src, row);
    }
  }
}

}  // namespace sluice
