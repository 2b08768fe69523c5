// C entry points of the fused elementwise ops (fused_ops.h).
#include <cstdint>

#include "fused_ops.h"

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

}
