// Scalar fp32 <-> bf16 conversion on raw bits: the one definition used by the copy kernels and the
// fused AdamW kernel (their scalar paths and vector tails), so both write what torch writes.
// The SIMD paths beside them implement the same rules and are tested bit for bit against torch.
#pragma once

#include <cstdint>
#include <cstring>

namespace offload {

// What torch's .to(torch.bfloat16) writes for every fp32 NaN on x86 CPUs, whatever its sign or
// payload: all ones (a negative quiet NaN).
constexpr uint16_t kBf16NaN = 0xFFFFu;

// Round to nearest, ties to even, on the raw bits; denormals are kept (no flush to zero), NaN ->
// kBf16NaN. Adding 0x7FFF plus the lowest kept bit rounds correctly; the carry walks into the
// exponent, so the largest finite values round up to inf as they should.
inline uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return kBf16NaN;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Exact: bf16 is the top half of an fp32 (NaN payloads, signaling ones included, kept as they are).
inline float bf16_bits_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace offload
