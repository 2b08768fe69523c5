// Paged attention for short query chunks on CPUs: decodes (one query) and small chunks
// (a few new tokens after a prefix-cache hit, short prompts). K/V are read in place
// from the block pool, once per (sequence, kv head) whatever the number of queries;
// query j of a sequence sees positions 0 .. ctx_end - q_len + j (causal). Exact
// two-pass softmax in fp32. Built at first use by sluice/attention/cpu_kernels.py.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float load(const float* p, int i) { return p[i]; }
inline float load(const uint16_t* p, int i) {
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;  // bf16 is the top half of an fp32
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline void store(float* p, int i, float v) { p[i] = v; }
inline void store(uint16_t* p, int i, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even
  p[i] = static_cast<uint16_t>(bits >> 16);
}

constexpr int kMaxHeadDim = 256;

template <typename T>
void attend(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
            int64_t max_blocks, const int64_t* query_start, const int64_t* ctx_end, T* out,
            int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
            float scale) {
  const int group = num_heads / num_kv_heads;
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_dim;
  const int64_t block_stride = token_stride * block_size;
#pragma omp parallel
  {
    std::vector<float> qf, scores, acc, mx, sum;
    float row[kMaxHeadDim];
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int s = 0; s < num_seqs; ++s) {
      for (int h = 0; h < num_kv_heads; ++h) {
        const int64_t q0 = query_start[s];
        const int nq = static_cast<int>(query_start[s + 1] - q0);
        const int64_t ctx = ctx_end[s];
        const int64_t first_ctx = ctx - nq + 1;  // context of the first query
        const int rows = nq * group;             // (query, head) pairs sharing this K/V
        const int64_t* table = block_tables + s * max_blocks;
        qf.resize(static_cast<size_t>(rows) * head_dim);
        scores.resize(static_cast<size_t>(rows) * ctx);
        acc.assign(static_cast<size_t>(rows) * head_dim, 0.f);
        mx.assign(rows, -INFINITY);
        sum.assign(rows, 0.f);
        for (int j = 0; j < nq; ++j) {
          for (int g = 0; g < group; ++g) {
            const T* qp = q + ((q0 + j) * num_heads + h * group + g) * head_dim;
            float* dst = qf.data() + (j * group + g) * head_dim;
            for (int d = 0; d < head_dim; ++d) dst[d] = load(qp, d) * scale;
          }
        }
        // Pass 1: scores and their max. Token t is visible to queries j >= t - first_ctx + 1.
        for (int64_t t = 0; t < ctx; ++t) {
          const T* kp = k_cache + table[t / block_size] * block_stride +
                        (t % block_size) * token_stride + static_cast<int64_t>(h) * head_dim;
          for (int d = 0; d < head_dim; ++d) row[d] = load(kp, d);
          const int j0 = t < first_ctx ? 0 : static_cast<int>(t - first_ctx + 1);
          for (int r = j0 * group; r < rows; ++r) {
            const float* qr = qf.data() + r * head_dim;
            float dot = 0.f;
            for (int d = 0; d < head_dim; ++d) dot += qr[d] * row[d];
            scores[r * ctx + t] = dot;
            mx[r] = dot > mx[r] ? dot : mx[r];
          }
        }
        // Softmax weights over each row's visible prefix.
        for (int r = 0; r < rows; ++r) {
          const int64_t visible = first_ctx + r / group;
          float* sc = scores.data() + r * ctx;
          float total = 0.f;
          for (int64_t t = 0; t < visible; ++t) {
            sc[t] = std::exp(sc[t] - mx[r]);
            total += sc[t];
          }
          sum[r] = total;
        }
        // Pass 2: weighted sum of V.
        for (int64_t t = 0; t < ctx; ++t) {
          const T* vp = v_cache + table[t / block_size] * block_stride +
                        (t % block_size) * token_stride + static_cast<int64_t>(h) * head_dim;
          for (int d = 0; d < head_dim; ++d) row[d] = load(vp, d);
          const int j0 = t < first_ctx ? 0 : static_cast<int>(t - first_ctx + 1);
          for (int r = j0 * group; r < rows; ++r) {
            const float w = scores[r * ctx + t];
            float* a = acc.data() + r * head_dim;
            for (int d = 0; d < head_dim; ++d) a[d] += w * row[d];
          }
        }
        for (int r = 0; r < rows; ++r) {
          const int j = r / group, g = r % group;
          T* op = out + ((q0 + j) * num_heads + h * group + g) * head_dim;
          const float inv = 1.f / sum[r];
          const float* a = acc.data() + r * head_dim;
          for (int d = 0; d < head_dim; ++d) store(op, d, a[d] * inv);
        }
      }
    }
  }
}

}  // namespace

extern "C" {

void sluice_paged_attention_f32(const float* q, const float* k, const float* v,
                                const int64_t* bt, int64_t max_blocks, const int64_t* qs,
                                const int64_t* ctx, float* out, int num_seqs, int num_heads,
                                int num_kv_heads, int head_dim, int block_size, float scale) {
  attend(q, k, v, bt, max_blocks, qs, ctx, out, num_seqs, num_heads, num_kv_heads, head_dim,
         block_size, scale);
}

void sluice_paged_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                 const int64_t* bt, int64_t max_blocks, const int64_t* qs,
                                 const int64_t* ctx, uint16_t* out, int num_seqs,
                                 int num_heads, int num_kv_heads, int head_dim, int block_size,
                                 float scale) {
  attend(q, k, v, bt, max_blocks, qs, ctx, out, num_seqs, num_heads, num_kv_heads, head_dim,
         block_size, scale);
}
}
