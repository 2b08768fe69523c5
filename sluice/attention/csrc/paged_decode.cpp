// Paged decode attention for CPUs: one query token per sequence, K/V read in place
// from the block pool (no gather), exact two-pass softmax in fp32.
// Built at first use by sluice/attention/cpu_kernels.py with the system compiler.
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
constexpr int kMaxGroup = 16;

template <typename T>
void decode(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
            int64_t max_blocks, const int64_t* ctx_lens, T* out, int num_seqs, int num_heads,
            int num_kv_heads, int head_dim, int block_size, float scale) {
  const int group = num_heads / num_kv_heads;
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_dim;
  const int64_t block_stride = token_stride * block_size;
#pragma omp parallel
  {
    std::vector<float> scores;
    float qf[kMaxGroup][kMaxHeadDim];
    float acc[kMaxGroup][kMaxHeadDim];
    float row[kMaxHeadDim];
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int s = 0; s < num_seqs; ++s) {
      for (int h = 0; h < num_kv_heads; ++h) {
        const int64_t ctx = ctx_lens[s];
        const int64_t* table = block_tables + s * max_blocks;
        scores.resize(static_cast<size_t>(group) * ctx);
        for (int g = 0; g < group; ++g) {
          const T* qp = q + (static_cast<int64_t>(s) * num_heads + h * group + g) * head_dim;
          for (int d = 0; d < head_dim; ++d) qf[g][d] = load(qp, d) * scale;
        }
        // Pass 1: scores and their max.
        float mx[kMaxGroup];
        for (int g = 0; g < group; ++g) mx[g] = -INFINITY;
        for (int64_t t = 0; t < ctx; ++t) {
          const T* kp = k_cache + table[t / block_size] * block_stride +
                        (t % block_size) * token_stride + static_cast<int64_t>(h) * head_dim;
          for (int d = 0; d < head_dim; ++d) row[d] = load(kp, d);
          for (int g = 0; g < group; ++g) {
            float dot = 0.f;
            for (int d = 0; d < head_dim; ++d) dot += qf[g][d] * row[d];
            scores[g * ctx + t] = dot;
            mx[g] = dot > mx[g] ? dot : mx[g];
          }
        }
        // Pass 2: softmax weights, then the weighted sum of V.
        float sum[kMaxGroup];
        for (int g = 0; g < group; ++g) {
          float total = 0.f;
          float* sc = scores.data() + g * ctx;
          for (int64_t t = 0; t < ctx; ++t) {
            sc[t] = std::exp(sc[t] - mx[g]);
            total += sc[t];
          }
          sum[g] = total;
          for (int d = 0; d < head_dim; ++d) acc[g][d] = 0.f;
        }
        for (int64_t t = 0; t < ctx; ++t) {
          const T* vp = v_cache + table[t / block_size] * block_stride +
                        (t % block_size) * token_stride + static_cast<int64_t>(h) * head_dim;
          for (int d = 0; d < head_dim; ++d) row[d] = load(vp, d);
          for (int g = 0; g < group; ++g) {
            const float w = scores[g * ctx + t];
            for (int d = 0; d < head_dim; ++d) acc[g][d] += w * row[d];
          }
        }
        for (int g = 0; g < group; ++g) {
          T* op = out + (static_cast<int64_t>(s) * num_heads + h * group + g) * head_dim;
          const float inv = 1.f / sum[g];
          for (int d = 0; d < head_dim; ++d) store(op, d, acc[g][d] * inv);
        }
      }
    }
  }
}

}  // namespace

extern "C" {

int sluice_max_head_dim() { return kMaxHeadDim; }
int sluice_max_group() { return kMaxGroup; }

void sluice_paged_decode_f32(const float* q, const float* k, const float* v, const int64_t* bt,
                             int64_t max_blocks, const int64_t* ctx, float* out, int num_seqs,
                             int num_heads, int num_kv_heads, int head_dim, int block_size,
                             float scale) {
  decode(q, k, v, bt, max_blocks, ctx, out, num_seqs, num_heads, num_kv_heads, head_dim,
         block_size, scale);
}

void sluice_paged_decode_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                              const int64_t* bt, int64_t max_blocks, const int64_t* ctx,
                              uint16_t* out, int num_seqs, int num_heads, int num_kv_heads,
                              int head_dim, int block_size, float scale) {
  decode(q, k, v, bt, max_blocks, ctx, out, num_seqs, num_heads, num_kv_heads, head_dim,
         block_size, scale);
}
}
