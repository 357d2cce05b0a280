// AVX-512 (F + BW) path of the fused AdamW kernel: 16 lanes, tails by masked loads and stores, so
// the last partial vector computes exactly what the full ones do (no scalar epilogue to drift).
#include "adam/adam_kernel.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <atomic>

#include "common/bf16.h"

// GCC 12 reports the deliberately undefined upper halves inside its own cast intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define OFFLOAD_AVX512 __attribute__((target("avx512f,avx512bw,fma,f16c")))
// The same, plus the bf16 convert (VCVTNEPS2BF16) and fpclass: Cooper Lake, Sapphire Rapids, Zen 4.
#define OFFLOAD_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16,fma,f16c")))

namespace offload {
namespace adam {
namespace {

// ---- loads: 16 elements of T -> 16 fp32 lanes (inactive lanes read as 0 and are never stored) ----

OFFLOAD_AVX512 inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }

OFFLOAD_AVX512 inline __m256i load16_u16(const uint16_t* p, __mmask16 k) {
  // A 512-bit masked 16-bit load needs only BW (the 256-bit form would need VL); masked-off lanes
  // do not fault, so this is safe at the very end of a buffer.
  return _mm512_castsi512_si256(_mm512_maskz_loadu_epi16(static_cast<__mmask32>(k), p));
}

OFFLOAD_AVX512 inline __m512 bf16_to_ps(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <DType D>
OFFLOAD_AVX512 inline __m512 load_ps(const void* base, int64_t i, __mmask16 k) {
  if constexpr (D == DType::kF32) return load16(static_cast<const float*>(base) + i, k);
  if constexpr (D == DType::kBF16) return bf16_to_ps(load16_u16(static_cast<const uint16_t*>(base) + i, k));
  if constexpr (D == DType::kF16) return _mm512_cvtph_ps(load16_u16(static_cast<const uint16_t*>(base) + i, k));
}

// ---- stores: 16 fp32 lanes -> T ----

// Round-to-nearest-even on the integer bits, every NaN -> 0xFFFF (kBf16NaN): the same bits as the
// scalar path (common/bf16.h) and as torch's .to(torch.bfloat16), denormals and NaNs included.
OFFLOAD_AVX512 inline __m256i ps_to_bf16_int(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(kBf16NaN));
  return _mm512_cvtepi32_epi16(r);  // VPMOVDW: keep the low 16 bits of each lane
}

// One instruction instead of eight. It agrees with the integer rounding on every value except two
// classes: it reads denormal inputs as zero, and it writes a NaN as the truncated quiet NaN (0x7FC0
// for the default NaN) where torch writes 0xFFFF. One VFPCLASSPS spots both (a rare vector: a
// decayed exp_avg_sq, a diverged param), and such a vector takes the integer path; a NaN-only fixup
// would cost a masked blend per store on every vector, this costs nothing extra on the common one.
OFFLOAD_AVX512_BF16 inline __m256i ps_to_bf16_hw(__m512 x) {
  // fpclass bits: 0x01 QNaN, 0x20 denormal, 0x80 SNaN.
  if (__builtin_expect(_mm512_fpclass_ps_mask(x, 0x01 | 0x20 | 0x80) == 0, 1))
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  return ps_to_bf16_int(x);
}

// 0 = no out buffer; otherwise out's dtype.
enum class Out { kNone, kF32, kBF16, kF16 };

namespace plain {
#define OFFLOAD_BODY_TARGET OFFLOAD_AVX512
#define OFFLOAD_BODY_BF16 ps_to_bf16_int
#include "adam/adam_avx512_body.inc"
#undef OFFLOAD_BODY_TARGET
#undef OFFLOAD_BODY_BF16
}  // namespace plain

namespace hwbf16 {
#define OFFLOAD_BODY_TARGET OFFLOAD_AVX512_BF16
#define OFFLOAD_BODY_BF16 ps_to_bf16_hw
#include "adam/adam_avx512_body.inc"
#undef OFFLOAD_BODY_TARGET
#undef OFFLOAD_BODY_BF16
}  // namespace hwbf16

std::atomic<bool> g_hw_bf16{true};

bool have_hw_bf16() { return hw_bf16_available() && g_hw_bf16.load(std::memory_order_relaxed); }

template <DType G, DType M, Out O>
void chunk(const Buffers& b, const Consts& c, int64_t begin, int64_t end, bool nt_out) {
  // Only bf16 stores differ between the two builds.
  constexpr bool kAnyBf16 = M == DType::kBF16 || O == Out::kBF16;
  if (kAnyBf16 && have_hw_bf16()) return hwbf16::chunk<G, M, O>(b, c, begin, end, nt_out);
  return plain::chunk<G, M, O>(b, c, begin, end, nt_out);
}

template <DType G, DType M>
void pick_out(const Buffers& b, const Consts& c, int64_t s, int64_t e, bool nt) {
  if (!b.out) return chunk<G, M, Out::kNone>(b, c, s, e, nt);
  switch (b.out_dtype) {
    case DType::kF32: return chunk<G, M, Out::kF32>(b, c, s, e, nt);
    case DType::kBF16: return chunk<G, M, Out::kBF16>(b, c, s, e, nt);
    default: return chunk<G, M, Out::kF16>(b, c, s, e, nt);
  }
}

template <DType G>
void pick_moment(const Buffers& b, const Consts& c, int64_t s, int64_t e, bool nt) {
  if (b.moment_dtype == DType::kBF16) return pick_out<G, DType::kBF16>(b, c, s, e, nt);
  return pick_out<G, DType::kF32>(b, c, s, e, nt);
}

}  // namespace

bool hw_bf16_available() {
  static const bool yes = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512dq");
  return yes;
}

void set_hw_bf16(bool on) { g_hw_bf16.store(on); }

void adamw_chunk_avx512(const Buffers& b, const Consts& c, int64_t begin, int64_t end, bool nt_out) {
  switch (b.grad_dtype) {
    case DType::kF32: return pick_moment<DType::kF32>(b, c, begin, end, nt_out);
    case DType::kBF16: return pick_moment<DType::kBF16>(b, c, begin, end, nt_out);
    default: return pick_moment<DType::kF16>(b, c, begin, end, nt_out);
  }
}

}  // namespace adam
}  // namespace offload

#endif  // __x86_64__
