// Fused CPU AdamW with 8-bit block-quantized moments ("AdamW8bit").
//
// Format (offload/ops/adam8bit.py is the plain-torch statement of it; other code depends on it):
//   - blocks of kBlock = 256 elements, anchored at element 0 of the buffers passed; the last may be partial;
//   - a moment is `codes` (uint8, one per element: an index into a 256-entry fp32 codebook) and
//     `absmax` (fp32, one per block: the block's max |value|);
//   - signed codebook (exp_avg): 0, +r^k (k = 0..127), -r^k (k = 0..126), r = 1e-7^(1/127);
//     unsigned codebook (exp_avg_sq): 0, r^k (k = 0..254), r = 1e-14^(1/254); both built in double,
//     rounded to fp32 and sorted ascending; mids[i] = (c[i] + c[i+1]) * 0.5f in fp32;
//   - quantize a block: a = max |x|; a == 0 -> every code is the index of 0.0, absmax 0; a not finite
//     (inf/NaN in the block) -> every code is the index of 0.0 and absmax NaN (the block reads back as
//     NaN: loud); else code = #{ mids < x / a } (x / a in fp32);
//   - dequantize: x = c[code] * absmax (fp32).
//
// The step: every block that meets [lo, hi) is dequantized into fp32 stack arrays, its in-range
// elements go through the fp32 AdamW chunk of the active ISA (adam_kernel.h: same roundings), and the
// whole block is quantized again. Every ISA path (dequantize, AdamW, absmax, division, codebook search)
// computes the same IEEE roundings, so the paths and all thread counts agree bit for bit.
#pragma once

#include <cstdint>

#include "adam/adam_kernel.h"

namespace offload {
namespace adam8 {

constexpr int64_t kBlock = 256;

struct Codebook {
  float levels[256];  // ascending
  float mids[256];    // (levels[i] + levels[i+1]) * 0.5f for i < 255; mids[255] = +inf (a search sentinel)
  uint8_t zero;       // index of 0.0
  // The search: a code is #{ i < 255 : mids[i] < y }, y = x / absmax in [-1, 1]. Bucket y by its top 13
  // bits (sign, exponent, 4 mantissa bits: a bucket spans a factor <= 1.0625 in |y|, levels are 1.135
  // apart), so a bucket holds at most one midpoint and code = base[key] + (mids[base[key]] < y), with
  // base[key] = #{ mids < the bucket's smallest y } (the vector paths' search; the scalar one is a binary
  // search). `table_ok` records that the build checked the one-midpoint property for every bucket (if it
  // did not hold, every path would take the scalar search; same results).
  uint8_t base[(1 << 13) + 4];  // + 4: the vector paths read it with 32-bit gathers
  bool table_ok;
};

// Built once (thread-safe static), then read-only.
const Codebook& codebook(bool is_signed);

inline int64_t num_blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }

struct Buffers {
  float* master = nullptr;           // n fp32, updated in place
  const void* grad = nullptr;        // n elements of grad_dtype
  adam::DType grad_dtype = adam::DType::kF32;
  uint8_t* m_codes = nullptr;        // n, exp_avg codes (signed codebook)
  float* m_absmax = nullptr;         // num_blocks(n)
  uint8_t* v_codes = nullptr;        // n, exp_avg_sq codes (unsigned codebook)
  float* v_absmax = nullptr;         // num_blocks(n)
  void* out = nullptr;               // optional: n elements of out_dtype
  adam::DType out_dtype = adam::DType::kBF16;
  int64_t n = 0;
};

// Checks nothing (the bindings validate; 0 <= lo <= hi <= n); runs on the kernel pool, active ISA.
void adamw8bit_step(const Buffers& b, const adam::Hyper& h, int64_t lo, int64_t hi);

// The quantizer alone, on the kernel pool with the active ISA (n values, num_blocks(n) absmax).
void quantize(const float* values, int64_t n, bool is_signed, uint8_t* codes, float* absmax);
void dequantize(const uint8_t* codes, const float* absmax, int64_t n, bool is_signed, float* values);

}  // namespace adam8
}  // namespace offload
