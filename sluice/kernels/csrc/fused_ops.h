// Fused elementwise ops of a decoder layer, for eager CPU decoding: in a decode step
// each of these is a handful of tiny torch ops (RMSNorm alone is eight), and their
// per-op overhead, not their arithmetic, is what a 1-token step pays for. Math in
// fp32, rounded once to the storage dtype.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dtype.h"

namespace sluice {

// Parallel only when there is enough work to pay for waking the other threads.
constexpr int64_t kParallelElems = 1 << 16;

// residual += x (when x is given), then out = residual / rms(residual) * weight. The
// weight is in the rows' dtype, or fp32 beside bf16 rows (an encoder's norm scales: 1 + w
// rounded to bf16 loses most of a small w).
template <typename T, typename W = T>
void add_rms_norm(const T* x, T* residual, const W* weight, T* out, int64_t rows, int dim,
                  float eps) {
#pragma omp parallel for if (rows * dim > kParallelElems) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    T* h = residual + r * dim;
    float buf[8192];
    float ss = 0.f;
    for (int i = 0; i < dim; ++i) {
      float v = to_float(h[i]);
      if (x != nullptr) {
        v += to_float(x[r * dim + i]);
        h[i] = round_to(h, v);
        v = to_float(h[i]);  // the norm sees the stored (rounded) residual, as torch does
      }
      buf[i] = v;
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
    T* o = out + r * dim;
    for (int i = 0; i < dim; ++i) o[i] = round_to(o, buf[i] * inv * to_float(weight[i]));
  }
}

// In place on heads [rows, heads, dim] with row stride `stride` (a slice of qkv):
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), cos/sin [rows, dim / 2].
template <typename T>
void rotary(T* x, int64_t rows, int64_t stride, int heads, int dim, const T* cos, const T* sin) {
  const int half = dim / 2;
#pragma omp parallel for if (rows * heads * dim > kParallelElems) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* c = cos + r * half;
    const T* s = sin + r * half;
    for (int h = 0; h < heads; ++h) {
      T* p = x + r * stride + static_cast<int64_t>(h) * dim;
      for (int i = 0; i < half; ++i) {
        const float x1 = to_float(p[i]), x2 = to_float(p[i + half]);
        const float ci = to_float(c[i]), si = to_float(s[i]);
        p[i] = round_to(p, x1 * ci - x2 * si);
        p[i + half] = round_to(p, x2 * ci + x1 * si);
      }
    }
  }
}

// out[rows, inter] = f(gate, up) for gate_up [rows, 2 * inter] (gate, then up), in fp32
// and rounded once: the gated activations below.
template <typename T, typename F>
void gated(const T* gate_up, T* out, int64_t rows, int inter, F f) {
#pragma omp parallel for if (rows * inter > kParallelElems) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * inter;
    const T* u = g + inter;
    T* o = out + r * inter;
    for (int i = 0; i < inter; ++i) o[i] = round_to(o, f(to_float(g[i]), to_float(u[i])));
  }
}

// silu(gate) * up.
template <typename T>
void silu_and_mul(const T* gate_up, T* out, int64_t rows, int inter) {
  gated(gate_up, out, rows, inter, [](float g, float u) { return g / (1.f + std::exp(-g)) * u; });
}

// gpt-oss's clamped SwiGLU: the gate clamped above at `limit`, up to [-limit, limit],
// then (up + 1) * gate * sigmoid(alpha * gate). One compiled function for the eager
// experts and the decode stack, so both paths round alike.
template <typename T>
void clamped_swiglu(const T* gate_up, T* out, int64_t rows, int inter, float alpha, float limit) {
  gated(gate_up, out, rows, inter, [alpha, limit](float g, float u) {
    const float gv = std::min(g, limit), uv = std::min(std::max(u, -limit), limit);
    return (uv + 1.f) * (gv / (1.f + std::exp(-alpha * gv)));
  });
}

// Mixture-of-Experts routing, compiled once (fused_ops.cpp) so the eager layer and the
// decode stack take the same instructions, hence the same bits.
// logits [M, E] = x (fp32 or bf16, as float) @ router.T (+ bias [E] fp32 where not null:
// gpt-oss), router [E, H] fp32; the (row, expert) dot products shared out by an orphaned
// `omp for` (barrier at the end).
template <typename T>
void router_logits(const T* x, int M, int H, const float* router, const float* bias, int E,
                   float* logits);
// weights, ids [M, k] from logits [M, E]: a softmax over E in fp32, the k largest
// (largest first, the lower expert on a tie), renormalized to sum 1 where `renormalize`;
// or, where `softmax_after_top_k` (Granite-MoE, gpt-oss), the k largest logits and a
// softmax over those k.
void route_top_k(const float* logits, int M, int E, int k, bool renormalize,
                 bool softmax_after_top_k, float* weights, int64_t* ids);

}  // namespace sluice
