// The instruction-set level this translation unit is compiled for. The Python side
// builds the same sources once per variant with explicit flags (generic: the plain
// baseline of the architecture; avx2: x86-64-v3; avx512: x86-64-v4 + VNNI) and loads
// the best one the CPU has, so every kernel needs a path for each level. Intrinsics
// appear only inside the `#if SLUICE_ISA_*` blocks; everything else is portable C++,
// so an aarch64 build falls back to the generic paths (NEON/dotprod paths would be a
// fourth level, SLUICE_ISA_NEON, beside these).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define SLUICE_ISA_AVX512 1
#define SLUICE_ISA_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SLUICE_ISA_AVX2 1
#define SLUICE_ISA_NAME "avx2"
#else
#define SLUICE_ISA_NAME "generic"
#endif

#if defined(SLUICE_ISA_AVX512) || defined(SLUICE_ISA_AVX2)
#include <immintrin.h>
#endif

// For the small steps of an inner loop (a pair's unpack and dot products): GCC's
// inliner left some of them out of line, called through the PLT once a pair (the
// 6-bit two-row step: +35%; which instantiations it kept depended on unrelated edits
// to the caller), so their inlining is not left to its size heuristics.
#define SLUICE_INLINE inline __attribute__((always_inline))
// Fully unroll a loop over a kernel's activation rows: past about 5 rows GCC kept
// per-row accumulator arrays on the stack instead of in registers.
#define SLUICE_UNROLL_ROWS _Pragma("GCC unroll 16")

// The 4 bytes at p in every 32-bit lane, broadcast from memory (a load). `set1` of a
// copied int compiles to a broadcast from a general register instead: two vector ops
// on Zen 4, on the pipes the int8 products need (the panel kernel's few-row steps ran
// 21-30% slower that way).
#if defined(SLUICE_ISA_AVX512)
namespace sluice {
SLUICE_INLINE __m512i broadcast4x16(const void* p) {
  return _mm512_broadcastd_epi32(_mm_loadu_si32(p));
}
}  // namespace sluice
#endif
#if defined(SLUICE_ISA_AVX512) || defined(SLUICE_ISA_AVX2)
namespace sluice {
SLUICE_INLINE __m256i broadcast4x8(const void* p) {
  return _mm256_broadcastd_epi32(_mm_loadu_si32(p));
}
}  // namespace sluice
#endif

#if defined(SLUICE_ISA_AVX2)
namespace sluice {
// Sum of the 8 lanes (AVX2 has no reduce instruction; AVX-512's is _mm512_reduce_add_ps).
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
}  // namespace sluice
#endif
