// Storage types of our kernels: fp32, and bf16 carried as its 16 bits (uint16_t), so
// the kernels need no torch or compiler bf16 type. Arithmetic is always fp32.
#pragma once
#include <cstdint>
#include <cstring>

namespace sluice {

inline float to_float(float v) { return v; }
inline float to_float(int8_t v) { return static_cast<float>(v); }  // int8 weights, scaled apart
inline float to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;  // bf16 is the top half of an fp32
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// IEEE fp16 (the GGUF block scales) to fp32, portably: the generic kernels' path; the
// x86 variants convert with F16C/AVX-512 instructions instead.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);  // normal: rebias 15 -> 127
  } else if (mant == 0) {
    bits = sign;  // zero
  } else {  // subnormal: mant * 2^-24, exact in fp32
    float f = static_cast<float>(mant) * (1.f / 16777216.f);
    std::memcpy(&bits, &f, sizeof(bits));
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// v rounded to the storage type of `*dst` (the pointer only picks the overload).
inline float round_to(const float*, float v) { return v; }
inline uint16_t round_to(const uint16_t*, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace sluice
