// AdamW8bit: codebooks, the block quantizer (scalar reference, AVX2 and AVX-512 paths) and the fused
// step on the kernel pool. See adam8bit.h for the format.
#include "adam/adam8bit.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/cpu_isa.h"
#include "common/thread_pool.h"

#if defined(__x86_64__)
#include <immintrin.h>

// GCC 12 reports the deliberately undefined upper halves inside its own cast intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace offload {
namespace adam8 {
namespace {

// Blocks per chunk handed to a thread: 32 * 256 = 8192 elements, a few hundred microseconds of work,
// so the pool's atomic counter is noise and 2-4 threads still balance on a 1M shard.
constexpr int64_t kGrainBlocks = 32;

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

Codebook build(bool is_signed) {
  // Levels in double, rounded once to fp32 (the Python side builds them the same way: float ** int
  // is libm's pow on doubles, then one rounding to fp32).
  double lv[256];
  if (is_signed) {
    const double r = std::pow(1e-7, 1.0 / 127.0);
    for (int k = 0; k <= 126; ++k) lv[k] = -std::pow(r, static_cast<double>(k));        // -1 ... -r^126
    lv[127] = 0.0;
    for (int k = 0; k <= 127; ++k) lv[255 - k] = std::pow(r, static_cast<double>(k));   // r^127 ... 1
  } else {
    const double r = std::pow(1e-14, 1.0 / 254.0);
    lv[0] = 0.0;
    for (int k = 0; k <= 254; ++k) lv[255 - k] = std::pow(r, static_cast<double>(k));   // r^254 ... 1
  }
  Codebook cb;
  for (int i = 0; i < 256; ++i) cb.levels[i] = static_cast<float>(lv[i]);
  for (int i = 0; i < 255; ++i) cb.mids[i] = (cb.levels[i] + cb.levels[i + 1]) * 0.5f;
  cb.mids[255] = std::numeric_limits<float>::infinity();
  cb.zero = is_signed ? 127 : 0;
  // Bucket table (see Codebook): positive buckets run from key << 19 up, negative ones (sign bit set)
  // from their most negative value ((key << 19) | 0x7FFFF) up to key << 19.
  cb.table_ok = true;
  std::memset(cb.base, 0, sizeof(cb.base));
  for (uint32_t key = 0; key < (1u << 13); ++key) {
    if (((key >> 4) & 0xFF) == 0xFF) continue;  // inf / NaN: y is never one
    const bool neg = (key >> 12) != 0;
    const float lo = bits_to_float(neg ? (key << 19) | 0x7FFFFu : key << 19);
    const float hi = bits_to_float(neg ? key << 19 : (key << 19) | 0x7FFFFu);
    const auto base = static_cast<unsigned>(std::lower_bound(cb.mids, cb.mids + 255, lo) - cb.mids);
    cb.base[key] = static_cast<uint8_t>(base);
    // One midpoint at most in [lo, hi]: the next one must not be below the bucket's top.
    if (base < 254 && cb.mids[base + 1] < hi) cb.table_ok = false;
  }
  return cb;
}

// #{ j < 255 : mids[j] < y } (= std::lower_bound's index), the scalar reference: a branch-free binary
// search (255 = 2^8 - 1, so eight halvings visit the implicit complete tree). The vector paths find the
// same count through the bucket table (two gathers and one comparison per lane), so the bitwise tests
// of every path against this one check the table too.
inline unsigned search(const Codebook& cb, float y) {
  unsigned pos = 0;
  for (unsigned s = 128; s != 0; s >>= 1) pos += (cb.mids[pos + s - 1] < y) ? s : 0u;
  return pos;
}

// Blocks whose absmax is 0 or not finite get the zero code everywhere; returns whether it was one.
// A non-finite block stores the default quiet NaN (0x7FC00000, what torch writes for float('nan')).
inline bool special_block(float a, bool nan, int64_t len, const Codebook& cb, uint8_t* codes, float* absmax) {
  if (nan || std::isinf(a)) {
    std::memset(codes, cb.zero, static_cast<size_t>(len));
    *absmax = std::numeric_limits<float>::quiet_NaN();
    return true;
  }
  if (a == 0.0f) {
    std::memset(codes, cb.zero, static_cast<size_t>(len));
    *absmax = 0.0f;
    return true;
  }
  *absmax = a;
  return false;
}

// ---- scalar: the reference every vector path equals bit for bit ----

void dequant_scalar(const uint8_t* codes, float a, int64_t len, const Codebook& cb, float* out) {
  for (int64_t i = 0; i < len; ++i) out[i] = cb.levels[codes[i]] * a;
}

void quant_scalar(const float* x, int64_t len, const Codebook& cb, uint8_t* codes, float* absmax) {
  float a = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < len; ++i) {
    const float ax = std::fabs(x[i]);
    nan |= ax != ax;
    a = ax > a ? ax : a;
  }
  if (special_block(a, nan, len, cb, codes, absmax)) return;
  for (int64_t i = 0; i < len; ++i) codes[i] = static_cast<uint8_t>(search(cb, x[i] / a));
}

#if defined(__x86_64__)
#define OFFLOAD_8B_AVX2 __attribute__((target("avx2,fma")))
#define OFFLOAD_8B_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma")))

// ---- AVX2: 8 lanes, gathers for the codebook and the midpoints; tails (only in a last partial
// block) run the scalar code, which computes the same roundings ----

OFFLOAD_8B_AVX2 void dequant_avx2(const uint8_t* codes, float a, int64_t len, const Codebook& cb, float* out) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(cb.levels, idx, 4), va));
  }
  for (; i < len; ++i) out[i] = cb.levels[codes[i]] * a;
}

OFFLOAD_8B_AVX2 void quant_avx2(const float* x, int64_t len, const Codebook& cb, uint8_t* codes, float* absmax) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 acc = _mm256_setzero_ps(), nanacc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_max_ps(acc, _mm256_andnot_ps(sign, v));  // a NaN lane is flagged below, not kept here
    nanacc = _mm256_or_ps(nanacc, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, acc);
  float a = 0.0f;
  for (float e : t) a = e > a ? e : a;
  bool nan = _mm256_movemask_ps(nanacc) != 0;
  for (; i < len; ++i) {
    const float ax = std::fabs(x[i]);
    nan |= ax != ax;
    a = ax > a ? ax : a;
  }
  if (special_block(a, nan, len, cb, codes, absmax)) return;
  const __m256 va = _mm256_set1_ps(a);
  // Low byte of each 32-bit lane to the bottom 4 bytes of each 128-bit half.
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 y = _mm256_div_ps(_mm256_loadu_ps(x + i), va);
    const __m256i key = _mm256_srli_epi32(_mm256_castps_si256(y), 19);
    const __m256i base = _mm256_and_si256(
        _mm256_i32gather_epi32(reinterpret_cast<const int*>(cb.base), key, 1), _mm256_set1_epi32(0xFF));
    const __m256 mid = _mm256_i32gather_ps(cb.mids, base, 4);
    // base + 1 where mids[base] < y (the compare's all-ones lane is -1)
    const __m256i pos = _mm256_sub_epi32(base, _mm256_castps_si256(_mm256_cmp_ps(mid, y, _CMP_LT_OQ)));
    const __m256i b = _mm256_shuffle_epi8(pos, pick);
    const uint64_t w = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(b))) |
                       (static_cast<uint64_t>(static_cast<uint32_t>(_mm256_extract_epi32(b, 4))) << 32);
    std::memcpy(codes + i, &w, 8);
  }
  for (; i < len; ++i) codes[i] = static_cast<uint8_t>(search(cb, x[i] / a));
}

// ---- AVX-512: 16 lanes, masked tails ----

OFFLOAD_8B_AVX512 void dequant_avx512(const uint8_t* codes, float a, int64_t len, const Codebook& cb, float* out) {
  const __m512 va = _mm512_set1_ps(a);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_i32gather_ps(idx, cb.levels, 4), va));
  }
  for (; i < len; ++i) out[i] = cb.levels[codes[i]] * a;
}

OFFLOAD_8B_AVX512 void quant_avx512(const float* x, int64_t len, const Codebook& cb, uint8_t* codes,
                                    float* absmax) {
  __m512 acc = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int64_t i = 0; i < len; i += 16) {
    const int64_t left = len - i;
    const __mmask16 k = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(k, x + i);  // inactive lanes read as 0: neutral for the max
    acc = _mm512_max_ps(acc, _mm512_abs_ps(v));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  if (special_block(_mm512_reduce_max_ps(acc), nan != 0, len, cb, codes, absmax)) return;
  const __m512 va = _mm512_set1_ps(*absmax);
  for (int64_t i = 0; i < len; i += 16) {
    const int64_t left = len - i;
    const __mmask16 k = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    const __m512 y = _mm512_div_ps(_mm512_maskz_loadu_ps(k, x + i), va);
    const __m512i key = _mm512_srli_epi32(_mm512_castps_si512(y), 19);
    const __m512i base =
        _mm512_and_si512(_mm512_i32gather_epi32(key, cb.base, 1), _mm512_set1_epi32(0xFF));
    const __m512 mid = _mm512_i32gather_ps(base, cb.mids, 4);
    const __mmask16 lt = _mm512_cmp_ps_mask(mid, y, _CMP_LT_OQ);
    const __m512i pos = _mm512_mask_add_epi32(base, lt, base, _mm512_set1_epi32(1));
    _mm512_mask_cvtepi32_storeu_epi8(codes + i, k, pos);  // VPMOVDB: codes are < 256
  }
}
#endif  // __x86_64__

void dequant_block(Isa isa, const uint8_t* codes, float a, int64_t len, const Codebook& cb, float* out) {
#if defined(__x86_64__)
  if (isa == Isa::kAvx512) return dequant_avx512(codes, a, len, cb, out);
  if (isa == Isa::kAvx2) return dequant_avx2(codes, a, len, cb, out);
#endif
  (void)isa;
  dequant_scalar(codes, a, len, cb, out);
}

void quant_block(Isa isa, const float* x, int64_t len, const Codebook& cb, uint8_t* codes, float* absmax) {
#if defined(__x86_64__)
  if (!cb.table_ok) isa = Isa::kScalar;  // the vector paths search through the table only
  if (isa == Isa::kAvx512) return quant_avx512(x, len, cb, codes, absmax);
  if (isa == Isa::kAvx2) return quant_avx2(x, len, cb, codes, absmax);
#endif
  (void)isa;
  quant_scalar(x, len, cb, codes, absmax);
}

void adamw_chunk(Isa isa, const adam::Buffers& b, const adam::Consts& c, int64_t len) {
  // Streaming stores off: a block's `out` slice is short and usually not vector aligned.
#if defined(__x86_64__)
  if (isa == Isa::kAvx512) return adam::adamw_chunk_avx512(b, c, 0, len, /*nt_out=*/false);
  if (isa == Isa::kAvx2) return adam::adamw_chunk_avx2(b, c, 0, len, /*nt_out=*/false);
#endif
  (void)isa;
  adam::adamw_chunk_scalar(b, c, 0, len);
}

size_t dtype_size(adam::DType d) { return d == adam::DType::kF32 ? 4 : 2; }

}  // namespace

const Codebook& codebook(bool is_signed) {
  static const Codebook s = build(true), u = build(false);
  return is_signed ? s : u;
}

void adamw8bit_step(const Buffers& b, const adam::Hyper& h, int64_t lo, int64_t hi) {
  lo = std::max<int64_t>(lo, 0);
  hi = std::min(hi, b.n);
  if (hi <= lo) return;
  const adam::Consts c = adam::make_consts(h);
  const Isa isa = compute_isa();  // (compute-bound: the widest path unless one is forced)
  const Codebook& cs = codebook(true);
  const Codebook& cu = codebook(false);
  const int64_t b0 = lo / kBlock, b1 = num_blocks(hi);
  const size_t gsz = dtype_size(b.grad_dtype), osz = dtype_size(b.out_dtype);
  parallel_for(b1 - b0, kGrainBlocks, [&](int64_t first, int64_t last) {
    alignas(64) float m[kBlock];
    alignas(64) float v[kBlock];
    for (int64_t blk = b0 + first; blk < b0 + last; ++blk) {
      const int64_t start = blk * kBlock, stop = std::min(start + kBlock, b.n), len = stop - start;
      dequant_block(isa, b.m_codes + start, b.m_absmax[blk], len, cs, m);
      dequant_block(isa, b.v_codes + start, b.v_absmax[blk], len, cu, v);
      const int64_t rs = std::max(start, lo), re = std::min(stop, hi);
      adam::Buffers ab;
      ab.master = b.master + rs;
      ab.grad = static_cast<const unsigned char*>(b.grad) + rs * gsz;
      ab.grad_dtype = b.grad_dtype;
      ab.exp_avg = m + (rs - start);
      ab.exp_avg_sq = v + (rs - start);
      ab.moment_dtype = adam::DType::kF32;
      ab.out = b.out ? static_cast<unsigned char*>(b.out) + rs * osz : nullptr;
      ab.out_dtype = b.out_dtype;
      ab.n = re - rs;
      adamw_chunk(isa, ab, c, re - rs);
      quant_block(isa, m, len, cs, b.m_codes + start, b.m_absmax + blk);
      quant_block(isa, v, len, cu, b.v_codes + start, b.v_absmax + blk);
    }
  });
}

void quantize(const float* values, int64_t n, bool is_signed, uint8_t* codes, float* absmax) {
  const Codebook& cb = codebook(is_signed);
  const Isa isa = compute_isa();  // (compute-bound: the widest path unless one is forced)
  parallel_for(num_blocks(n), kGrainBlocks, [&](int64_t first, int64_t last) {
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t start = blk * kBlock, len = std::min(start + kBlock, n) - start;
      quant_block(isa, values + start, len, cb, codes + start, absmax + blk);
    }
  });
}

void dequantize(const uint8_t* codes, const float* absmax, int64_t n, bool is_signed, float* values) {
  const Codebook& cb = codebook(is_signed);
  const Isa isa = compute_isa();  // (compute-bound: the widest path unless one is forced)
  parallel_for(num_blocks(n), kGrainBlocks, [&](int64_t first, int64_t last) {
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t start = blk * kBlock, len = std::min(start + kBlock, n) - start;
      dequant_block(isa, codes + start, absmax[blk], len, cb, values + start);
    }
  });
}

}  // namespace adam8
}  // namespace offload
