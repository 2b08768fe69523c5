// C entry points of the fused elementwise ops (fused_ops.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fused_ops.h"

namespace sluice {

template <typename T>
void router_logits(const T* x, int M, int H, const float* router, int E, float* logits) {
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
    logits[i] = sum;
  }
}

template void router_logits(const float*, int, int, const float*, int, float*);
template void router_logits(const uint16_t*, int, int, const float*, int, float*);

void route_top_k(const float* logits, int M, int E, int k, bool renormalize, float* weights,
                 int64_t* ids) {
  std::vector<float> p(E);
  for (int r = 0; r < M; ++r) {
    const float* l = logits + static_cast<int64_t>(r) * E;
    float top = l[0];
    for (int e = 1; e < E; ++e) top = std::max(top, l[e]);
    float sum = 0.f;
    for (int e = 0; e < E; ++e) {
      p[e] = std::exp(l[e] - top);
      sum += p[e];
    }
    for (int e = 0; e < E; ++e) p[e] /= sum;
    float* w = weights + static_cast<int64_t>(r) * k;
    int64_t* id = ids + static_cast<int64_t>(r) * k;
    float picked = 0.f;
    for (int j = 0; j < k; ++j) {
      int best = -1;
      for (int e = 0; e < E; ++e) {
        bool taken = false;
        for (int i = 0; i < j; ++i) taken = taken || id[i] == e;
        if (!taken && (best < 0 || p[e] > p[best])) best = e;
      }
      id[j] = best;
      w[j] = p[best];
      picked += p[best];
    }
    if (renormalize)
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

// Mixture-of-Experts routing of x [M, H] (fp32 or bf16) by the fp32 router [E, H]:
// weights [M, k] fp32 and expert ids [M, k] (router_logits, route_top_k).
void sluice_moe_route(int bf16, const void* x, int M, int H, const float* router, int E, int k,
                      int renormalize, float* weights, int64_t* ids) {
  std::vector<float> logits(static_cast<size_t>(M) * E);
#pragma omp parallel
  {
    if (bf16)
      sluice::router_logits(static_cast<const uint16_t*>(x), M, H, router, E, logits.data());
    else
      sluice::router_logits(static_cast<const float*>(x), M, H, router, E, logits.data());
  }
  sluice::route_top_k(logits.data(), M, E, k, renormalize != 0, weights, ids);
}

}
