// Storage types of our kernels: fp32, and bf16 carried as its 16 bits (uint16_t), so
// the kernels need no torch or compiler bf16 type. Arithmetic is always fp32.
#pragma once
#include <cstdint>
#include <cstring>

namespace sluice {

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;  // bf16 is the top half of an fp32
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
