// C entry points of the fused elementwise ops (fused_ops.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fused_ops.h"

namespace sluice {

template <typename T>
void router_logits(const T* x, int M, int H, const float* router, const float* bias, int E,
                   float* logits) {
  constexpr int kLanes = 16;  // partial sums, added in a fixed order at the end
#pragma omp for schedule(static)
  for (int64_t i = 0; i < static_cast<int64_t>(M) * E; ++i) {
    const T* xr = x + (i / E) * H;
    const float* w = router + (i % E) * H;
    float acc[kLanes] = {};
    int h = 0;
    for (; h + kLanes <= H; h += kLanes)
      for (int j = 0; j < kLanes; ++j) acc[j] += to_float(xr[h + j]) * w[h + j];
    for (; h < H; ++h) acc[h % kLanes] += to_float(xr[h]) * w[h];
    float sum = 0.f;
    for (int j = 0; j < kLanes; ++j) sum += acc[j];
    logits[i] = bias == nullptr ? sum : sum + bias[i % E];
  }
}

template void router_logits(const float*, int, int, const float*, const float*, int, float*);
template void router_logits(const uint16_t*, int, int, const float*, const float*, int, float*);

namespace {

// The k largest of v [E] into ids (largest first, the lower index on a tie), their
// values into w.
void top_k(const float* v, int E, int k, float* w, int64_t* ids) {
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken = taken || ids[i] == e;
      if (!taken && (best < 0 || v[e] > v[best])) best = e;
    }
    ids[j] = best;
    w[j] = v[best];
  }
}

// v [n] in place: exp(v - max) / sum, in fp32.
void softmax(float* v, int n) {
  float top = v[0];
  for (int e = 1; e < n; ++e) top = std::max(top, v[e]);
  float sum = 0.f;
  for (int e = 0; e < n; ++e) {
    v[e] = std::exp(v[e] - top);
    sum += v[e];
  }
  for (int e = 0; e < n; ++e) v[e] /= sum;
}

}  // namespace

void route_top_k(const float* logits, int M, int E, int k, bool renormalize,
                 bool softmax_after_top_k, float* weights, int64_t* ids) {
  std::vector<float> p(E);
  for (int r = 0; r < M; ++r) {
    std::copy_n(logits + static_cast<int64_t>(r) * E, E, p.data());
    float* w = weights + static_cast<int64_t>(r) * k;
    int64_t* id = ids + static_cast<int64_t>(r) * k;
    if (softmax_after_top_k) {
      top_k(p.data(), E, k, w, id);
      softmax(w, k);
      continue;
    }
    softmax(p.data(), E);
    top_k(p.data(), E, k, w, id);
    if (!renormalize) continue;
    float picked = 0.f;
    for (int j = 0; j < k; ++j) picked += w[j];
    for (int j = 0; j < k; ++j) w[j] /= picked;
  }
}

}  // namespace sluice

extern "C" {

int sluice_fused_max_dim() { return 8192; }

void sluice_add_rms_norm(int bf16, const void* x, void* residual, const void* weight, void* out,
                         int64_t rows, int dim, float eps) {
  if (bf16)
    sluice::add_rms_norm(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(residual),
                         static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), rows,
                         dim, eps);
  else
    sluice::add_rms_norm(static_cast<const float*>(x), static_cast<float*>(residual),
                         static_cast<const float*>(weight), static_cast<float*>(out), rows, dim,
                         eps);
}

void sluice_add_rms_norm_f32_weight(const void* x, void* residual, const void* weight, void* out,
                                    int64_t rows, int dim, float eps) {
  sluice::add_rms_norm(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(residual),
                       static_cast<const float*>(weight), static_cast<uint16_t*>(out), rows, dim,
                       eps);
}

void sluice_rotary(int bf16, void* x, int64_t rows, int64_t stride, int heads, int dim,
                   const void* cos, const void* sin) {
  if (bf16)
    sluice::rotary(static_cast<uint16_t*>(x), rows, stride, heads, dim,
                   static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin));
  else
    sluice::rotary(static_cast<float*>(x), rows, stride, heads, dim,
                   static_cast<const float*>(cos), static_cast<const float*>(sin));
}

void sluice_silu_and_mul(int bf16, const void* gate_up, void* out, int64_t rows, int inter) {
  if (bf16)
    sluice::silu_and_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows,
                         inter);
  else
    sluice::silu_and_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), rows,
                         inter);
}

void sluice_clamped_swiglu(int bf16, const void* gate_up, void* out, int64_t rows, int inter,
                           float alpha, float limit) {
  if (bf16)
    sluice::clamped_swiglu(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out),
                           rows, inter, alpha, limit);
  else
    sluice::clamped_swiglu(static_cast<const float*>(gate_up), static_cast<float*>(out), rows,
                           inter, alpha, limit);
}

// Mixture-of-Experts routing of x [M, H] (fp32 or bf16) by the fp32 router [E, H] and its
// bias [E] (null: none): weights [M, k] fp32 and expert ids [M, k] (router_logits,
// route_top_k).
void sluice_moe_route(int bf16, const void* x, int M, int H, const float* router,
                      const float* bias, int E, int k, int renormalize, int softmax_after_top_k,
                      float* weights, int64_t* ids) {
  std::vector<float> logits(static_cast<size_t>(M) * E);
#pragma omp parallel
  {
    if (bf16)
      sluice::router_logits(static_cast<const uint16_t*>(x), M, H, router, bias, E,
                            logits.data());
    else
      sluice::router_logits(static_cast<const float*>(x), M, H, router, bias, E, logits.data());
  }
  sluice::route_top_k(logits.data(), M, E, k, renormalize != 0, softmax_after_top_k != 0,
                      weights, ids);
}

}
