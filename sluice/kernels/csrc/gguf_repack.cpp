// GGUF blocks -> the qblock layout (qblock.h), as sluice/loader/gguf_blocks.py's
// `repack` writes it, byte for byte (tests/test_gguf_blocks.py). That Python path
// runs a few dozen torch ops a chunk and read ~100 MB/s of file: most of a 7B file's
// minute of loading. Here one pass over each row: its blocks decoded to unsigned
// values in natural order (a row's worth, per thread), then packed into pair
// positions, with the scales copied as the file holds them (fp16 bits; the K-quants'
// 6-bit or int8 scales and their fp16 multipliers).
#include <cstdint>
#include <cstring>
#include <vector>

#include "qblock.h"

namespace {

// Format codes (gguf_blocks.REPACK_CODES).
enum Format { kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kMXFP4, kFormats };

struct Spec {
  int values, bytes, bits, group;
  bool offsets, integer;  // stores minimums; integer scales (K-quants)
};

constexpr Spec kSpecs[kFormats] = {
    {32, 18, 4, 32, false, false},  {32, 20, 4, 32, true, false},
    {32, 22, 5, 32, false, false},  {32, 24, 5, 32, true, false},
    {32, 34, 8, 32, false, false},  {256, 144, 4, 32, true, true},
    {256, 176, 5, 32, true, true},  {256, 210, 6, 16, false, true},
    {32, 17, sluice::kQbE2M1, 32, false, false},
};

// An MXFP4 block's scale 2^(e - 128) (the half of ggml's E8M0 scale that goes with the
// doubled values) as fp16 bits: exact from 2^-24 to 2^15, zero below; false above.
bool mxfp4_scale(uint8_t e, uint16_t* h) {
  const int x = e - 128;
  if (x > 15) return false;
  *h = x >= -14 ? static_cast<uint16_t>((x + 15) << 10)
                : x >= -24 ? static_cast<uint16_t>(1u << (x + 24)) : 0;
  return true;
}

uint16_t f16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

// Values j and j + 16 of a 32-value nibble block (byte j: low, high nibble).
void nibbles32(const uint8_t* qs, uint8_t* u) {
  for (int j = 0; j < 16; ++j) u[j] = qs[j] & 0x0F, u[j + 16] = qs[j] >> 4;
}

// The fifth bit of value j is bit j of the little-endian 32-bit qh.
void fifth_bits32(const uint8_t* qh, uint8_t* u) {
  uint32_t h;
  std::memcpy(&h, qh, 4);
  for (int j = 0; j < 32; ++j) u[j] |= static_cast<uint8_t>(((h >> j) & 1) << 4);
}

// ggml's get_scale_min_k4: the 8 six-bit scales and minimums of a Q4_K/Q5_K block.
void k_scales(const uint8_t* s, int8_t* sc, int8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = static_cast<int8_t>(s[j] & 63), mn[j] = static_cast<int8_t>(s[j + 4] & 63);
    sc[j + 4] = static_cast<int8_t>((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
    mn[j + 4] = static_cast<int8_t>((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
  }
}

// One block of `f` at b into values u (natural order) and its groups' scales: fp16
// bits (d16, m16) or int8 (d8, m8) with the multipliers sup[0] (d) and sup[1] (-dmin).
// False for a block the layout cannot hold (an MXFP4 scale beyond fp16).
bool decode_block(int f, const uint8_t* b, uint8_t* u, uint16_t* d16, uint16_t* m16, int8_t* d8,
                  int8_t* m8, uint16_t* sup) {
  switch (f) {
    case kMXFP4:  // the codes as stored, negative zero (8) as zero (0): the same weight
      nibbles32(b + 1, u);
      for (int j = 0; j < 32; ++j) u[j] = u[j] == 8 ? 0 : u[j];
      return mxfp4_scale(b[0], d16);
    case kQ4_0: d16[0] = f16_at(b), nibbles32(b + 2, u); break;
    case kQ4_1: d16[0] = f16_at(b), m16[0] = f16_at(b + 2), nibbles32(b + 4, u); break;
    case kQ5_0: d16[0] = f16_at(b), nibbles32(b + 6, u), fifth_bits32(b + 2, u); break;
    case kQ5_1:
      d16[0] = f16_at(b), m16[0] = f16_at(b + 2), nibbles32(b + 8, u), fifth_bits32(b + 4, u);
      break;
    case kQ8_0:
      d16[0] = f16_at(b);
      for (int j = 0; j < 32; ++j) u[j] = static_cast<uint8_t>(b[2 + j] ^ 0x80);  // q + 128
      break;
    case kQ4_K:
    case kQ5_K: {
      sup[0] = f16_at(b), sup[1] = f16_at(b + 2) ^ 0x8000;  // d, -dmin
      k_scales(b + 4, d8, m8);
      const uint8_t* qs = b + (f == kQ4_K ? 16 : 48);
      for (int i = 0; i < 4; ++i)  // 32 bytes: sub-block 2i low nibbles, 2i + 1 high
        for (int l = 0; l < 32; ++l)
          u[64 * i + l] = qs[32 * i + l] & 0x0F, u[64 * i + 32 + l] = qs[32 * i + l] >> 4;
      if (f == kQ5_K)  // bit i of qh[l]: the fifth bit of value 32 i + l
        for (int i = 0; i < 8; ++i)
          for (int l = 0; l < 32; ++l) u[32 * i + l] |= static_cast<uint8_t>(((b[16 + l] >> i) & 1) << 4);
      break;
    }
    case kQ6_K: {
      // Per 128-value half h: quarter q's value l is ql's low (q even) or high nibble of
      // byte 64 h + 32 (q & 1) + l, topped by bits 2q, 2q + 1 of qh[32 h + l].
      for (int h = 0; h < 2; ++h)
        for (int q = 0; q < 4; ++q)
          for (int l = 0; l < 32; ++l) {
            const uint8_t ql = b[64 * h + 32 * (q & 1) + l];
            const uint8_t lo = q < 2 ? ql & 0x0F : ql >> 4;
            u[128 * h + 32 * q + l] = static_cast<uint8_t>(lo | (((b[128 + 32 * h + l] >> (2 * q)) & 3) << 4));
          }
      std::memcpy(d8, b + 192, 16);
      sup[0] = f16_at(b + 208);
      break;
    }
  }
  return true;
}

}  // namespace

extern "C" {

// rows x cols values of GGUF format `format` (raw: rows of blocks) into packed [rows,
// cols or cols / 2], hbits [rows, cols / 8 or cols / 4] (5 and 6 bits), scale and
// minimum [rows, cols / group] (fp16 bits, or int8 for the K-quants; minimum only for
// formats with offsets) and super [rows, 1 or 2, cols / 256] (K-quants). cols is a
// multiple of 64 and of the format's block. Returns 0, -1 for an unknown format, or -2
// for a block the layout cannot hold (an MXFP4 scale above 2^15).
int sluice_gguf_repack(const void* raw, int format, int64_t rows, int cols, void* packed,
                       void* hbits, void* scale, void* minimum, void* super) {
  if (format < 0 || format >= kFormats) return -1;
  const Spec s = kSpecs[format];
  const int blocks = cols / s.values, groups = cols / s.group, per_block = s.values / s.group;
  const int64_t row_bytes = static_cast<int64_t>(blocks) * s.bytes;
  const int64_t packed_row = s.bits == 8 ? cols : cols / 2;
  const int64_t hbits_row = s.bits == 5 ? cols / 8 : s.bits == 6 ? cols / 4 : 0;
  const int supers = s.integer ? (s.offsets ? 2 : 1) : 0;
  const auto* in = static_cast<const uint8_t*>(raw);
  int unfit = 0;
#pragma omp parallel
  {
    std::vector<uint8_t> u(cols);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      auto* d16 = static_cast<uint16_t*>(scale) + r * groups;
      auto* m16 = static_cast<uint16_t*>(minimum) + r * groups;
      auto* d8 = static_cast<int8_t*>(scale) + r * groups;
      auto* m8 = static_cast<int8_t*>(minimum) + r * groups;
      auto* sup = static_cast<uint16_t*>(super) + r * supers * blocks;
      for (int b = 0; b < blocks; ++b) {
        uint16_t pair[2] = {0, 0};
        const int g = b * per_block;
        if (!decode_block(format, in + r * row_bytes + b * s.bytes, u.data() + b * s.values,
                          s.integer ? nullptr : d16 + g,
                          s.integer || !s.offsets ? nullptr : m16 + g, s.integer ? d8 + g : nullptr,
                          s.integer && s.offsets ? m8 + g : nullptr, pair)) {
#pragma omp atomic write
          unfit = 1;
        }
        for (int j = 0; j < supers; ++j) sup[j * blocks + b] = pair[j];
      }
      sluice::qb_pack_row(u.data(), cols, s.bits, static_cast<uint8_t*>(packed) + r * packed_row,
               static_cast<uint8_t*>(hbits) + r * hbits_row);
    }
  }
  return unfit ? -2 : 0;
}

}  // extern "C"
