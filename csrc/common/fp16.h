// Scalar fp32 <-> IEEE fp16 conversion on raw bits: the one definition used by the copy kernels and
// the fused AdamW kernel. It gives what the F16C instructions (VCVTPS2PH with round-to-nearest-even,
// VCVTPH2PS) give, which is also what torch's vectorized .to() writes: NaNs keep their sign and top
// payload bits and come out quiet. (c10::Half's portable conversion would write every NaN as
// 0x7E00 with its sign, so it is not used.)
#pragma once

#include <cstdint>
#include <cstring>

namespace offload {

inline uint16_t f32_to_f16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u | static_cast<uint16_t>((a >> 13) & 0x3FFu);  // quiet NaN, payload kept
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to inf (and inf stays inf)
  if (a >= 0x38800000u) {                        // result is a normal half (>= 2^-14)
    uint32_t r = a - (112u << 23);                // rebias the exponent 127 -> 15
    r += 0xFFFu + ((r >> 13) & 1u);               // round to nearest even at bit 13; carry may bump exponent
    return sign | static_cast<uint16_t>(r >> 13);
  }
  if (a < 0x33000000u) return sign;  // below 2^-25: rounds to zero (2^-25 itself is a tie, to even = 0)
  // Half subnormal: value / 2^-24 rounded to nearest even. m is the 24-bit significand.
  const uint32_t e = a >> 23;                      // 102 .. 112
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - e;                 // 14 .. 24
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // may reach 0x400: the smallest normal, as it should
  return sign | static_cast<uint16_t>(q);
}

inline float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  uint32_t m = h & 0x3FFu;
  uint32_t u;
  if (e == 0x1F) {
    u = sign | 0x7F800000u | (m ? (0x400000u | (m << 13)) : 0u);  // inf / quiet NaN, payload kept
  } else if (e != 0) {
    u = sign | ((e + 112u) << 23) | (m << 13);
  } else if (m == 0) {
    u = sign;
  } else {
    // Subnormal half: normalize (exact in fp32).
    uint32_t exp = 113u;
    while (!(m & 0x400u)) {
      m <<= 1;
      --exp;
    }
    u = sign | (exp << 23) | ((m & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace offload
