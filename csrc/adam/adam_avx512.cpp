// AVX-512 (F + BW) path of the fused AdamW kernel: 16 lanes, tails by masked loads and stores, so
// the last partial vector computes exactly what the full ones do (no scalar epilogue to drift).
#include "adam/adam_kernel.h"

#if defined(__x86_64__)
#include <immintrin.h>

// GCC 12 reports the deliberately undefined upper halves inside its own cast intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define OFFLOAD_AVX512 __attribute__((target("avx512f,avx512bw,fma,f16c")))

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

// Round-to-nearest-even on the integer bits, NaN -> 0x7FC0: the same as the scalar path and
// torch's .to(torch.bfloat16) for every finite value, denormals included.
OFFLOAD_AVX512 inline __m512i ps_to_bf16_epi32(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}

template <DType D>
OFFLOAD_AVX512 inline void store_ps(void* base, int64_t i, __m512 x, __mmask16 k, bool full, bool nt) {
  if constexpr (D == DType::kF32) {
    float* p = static_cast<float*>(base) + i;
    if (full && nt)
      _mm512_stream_ps(p, x);
    else
      _mm512_mask_storeu_ps(p, k, x);
  } else {
    uint16_t* p = static_cast<uint16_t*>(base) + i;
    __m256i h;
    if constexpr (D == DType::kBF16)
      h = _mm512_cvtepi32_epi16(ps_to_bf16_epi32(x));  // VPMOVDW: keep the low 16 bits of each lane
    else
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // IEEE RNE, exact
    if (full && nt)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h);
    else if (full)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    else
      _mm512_mask_storeu_epi16(p, static_cast<__mmask32>(k), _mm512_castsi256_si512(h));
  }
}

// 0 = no out buffer; otherwise out's dtype.
enum class Out { kNone, kF32, kBF16, kF16 };

template <DType G, DType M, Out O>
OFFLOAD_AVX512 void chunk(const Buffers& b, const Consts& c, int64_t begin, int64_t end, bool nt_out) {
  const __m512 gs = _mm512_set1_ps(c.gs), w = _mm512_set1_ps(c.lerp_lo ? c.w1 : c.w1m1);
  const __m512 b2 = _mm512_set1_ps(c.b2), c2 = _mm512_set1_ps(c.c2), decay = _mm512_set1_ps(c.decay);
  const __m512 nss = _mm512_set1_ps(c.nss), bc2s = _mm512_set1_ps(c.bc2s), eps = _mm512_set1_ps(c.eps);
  const bool lerp_lo = c.lerp_lo;
  float* master = b.master;
  // Streaming stores need 32/64-byte aligned addresses; chunks start at multiples of 32 elements,
  // so the base pointer decides for the whole chunk.
  constexpr int kOutBytes = O == Out::kF32 ? 4 : 2;
  const bool nt = nt_out && b.out && (reinterpret_cast<uintptr_t>(b.out) % (16 * kOutBytes) == 0);

  for (int64_t i = begin; i < end; i += 16) {
    const int64_t left = end - i;
    const bool full = left >= 16;
    const __mmask16 k = full ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    const __m512 g = _mm512_mul_ps(load_ps<G>(b.grad, i, k), gs);
    __m512 m = load_ps<M>(b.exp_avg, i, k);
    __m512 v = load_ps<M>(b.exp_avg_sq, i, k);
    __m512 p = _mm512_mul_ps(load16(master + i, k), decay);
    const __m512 d = _mm512_sub_ps(g, m);
    m = _mm512_fmadd_ps(w, d, lerp_lo ? m : g);
    v = _mm512_fmadd_ps(_mm512_mul_ps(c2, g), g, _mm512_mul_ps(v, b2));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2s), eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(nss, m), denom));
    store_ps<M>(b.exp_avg, i, m, k, full, false);
    store_ps<M>(b.exp_avg_sq, i, v, k, full, false);
    _mm512_mask_storeu_ps(master + i, k, p);
    if constexpr (O == Out::kF32) store_ps<DType::kF32>(b.out, i, p, k, full, nt);
    if constexpr (O == Out::kBF16) store_ps<DType::kBF16>(b.out, i, p, k, full, nt);
    if constexpr (O == Out::kF16) store_ps<DType::kF16>(b.out, i, p, k, full, nt);
  }
  // Streaming stores are weakly ordered: fence so the caller (another thread, after the pool's
  // join) sees every out element once the step returns.
  if (nt) _mm_sfence();
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
