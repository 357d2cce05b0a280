// AVX2 + FMA + F16C path of the fused AdamW kernel: 8 lanes. The tail (< 8 elements, only at the
// very end of the array) is copied to a zero-padded stack block, run through the same vector body
// and copied back, so it rounds exactly like the full vectors.
#include "adam/adam_kernel.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstring>

#include "common/bf16.h"

#define OFFLOAD_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace offload {
namespace adam {
namespace {

template <DType D>
OFFLOAD_AVX2 inline __m256 load8(const void* base, int64_t i) {
  if constexpr (D == DType::kF32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
  if constexpr (D == DType::kBF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  if constexpr (D == DType::kF16) return _mm256_cvtph_ps(h);
}

// Integer round-to-nearest-even, every NaN -> 0xFFFF (kBf16NaN): the scalar path's bits
// (common/bf16.h), which are torch's .to(torch.bfloat16).
OFFLOAD_AVX2 inline __m128i ps_to_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(kBf16NaN), nan);
  // Lanes hold values <= 0xFFFF, so the unsigned-saturating pack is a plain narrowing.
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <DType D>
OFFLOAD_AVX2 inline void store8(void* base, int64_t i, __m256 x, bool nt) {
  if constexpr (D == DType::kF32) {
    float* p = static_cast<float*>(base) + i;
    if (nt)
      _mm256_stream_ps(p, x);
    else
      _mm256_storeu_ps(p, x);
  } else {
    __m128i* p = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i);
    __m128i h;
    if constexpr (D == DType::kBF16)
      h = ps_to_bf16(x);
    else
      h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  // IEEE RNE, exact
    if (nt)
      _mm_stream_si128(p, h);
    else
      _mm_storeu_si128(p, h);
  }
}

enum class Out { kNone, kF32, kBF16, kF16 };

template <DType G, DType M, Out O>
struct Kernel {
  __m256 gs, w, b2, c2, decay, step, eps_hat;
  bool lerp_lo;

  OFFLOAD_AVX2 explicit Kernel(const Consts& c) {
    gs = _mm256_set1_ps(c.gs);
    w = _mm256_set1_ps(c.lerp_lo ? c.w1 : c.w1m1);
    b2 = _mm256_set1_ps(c.b2);
    c2 = _mm256_set1_ps(c.c2);
    decay = _mm256_set1_ps(c.decay);
    step = _mm256_set1_ps(c.step);
    eps_hat = _mm256_set1_ps(c.eps_hat);
    lerp_lo = c.lerp_lo;
  }

  // Elements [i, i+8) of the given buffers (real ones, or the padded tail copies).
  OFFLOAD_AVX2 inline void step8(float* master, const void* grad, void* exp_avg, void* exp_avg_sq, void* out,
                                 int64_t i, bool nt) const {
    const __m256 g = _mm256_mul_ps(load8<G>(grad, i), gs);
    __m256 m = load8<M>(exp_avg, i);
    __m256 v = load8<M>(exp_avg_sq, i);
    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(master + i), decay);
    const __m256 d = _mm256_sub_ps(g, m);
    m = _mm256_fmadd_ps(w, d, lerp_lo ? m : g);
    v = _mm256_fmadd_ps(_mm256_mul_ps(c2, g), g, _mm256_mul_ps(v, b2));
    const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(v), eps_hat);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(step, m), denom));
    store8<M>(exp_avg, i, m, false);
    store8<M>(exp_avg_sq, i, v, false);
    _mm256_storeu_ps(master + i, p);
    if constexpr (O == Out::kF32) store8<DType::kF32>(out, i, p, nt);
    if constexpr (O == Out::kBF16) store8<DType::kBF16>(out, i, p, nt);
    if constexpr (O == Out::kF16) store8<DType::kF16>(out, i, p, nt);
  }
};

constexpr size_t size_of(DType d) { return d == DType::kF32 ? 4 : 2; }

template <DType G, DType M, Out O>
OFFLOAD_AVX2 void chunk(const Buffers& b, const Consts& c, int64_t begin, int64_t end, bool nt_out) {
  const Kernel<G, M, O> k(c);
  constexpr size_t kOut = O == Out::kF32 ? 4 : 2;
  // Streaming stores need aligned addresses; chunks start at multiples of 32 elements, so the
  // base pointer decides for the whole chunk.
  const bool nt = nt_out && b.out && (reinterpret_cast<uintptr_t>(b.out) % (8 * kOut) == 0);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) k.step8(b.master, b.grad, b.exp_avg, b.exp_avg_sq, b.out, i, nt);
  if (nt) _mm_sfence();  // streaming stores are weakly ordered: publish them before the pool joins
  const int64_t left = end - i;
  if (left == 0) return;
  // Tail: zero-padded copies (zeros keep the unused lanes finite), same vector body, copy back.
  alignas(32) float pm[8] = {0};
  alignas(32) unsigned char pg[32] = {0}, pa[32] = {0}, ps[32] = {0}, po[32] = {0};
  const size_t gsz = size_of(G), msz = size_of(M);
  std::memcpy(pm, b.master + i, left * 4);
  std::memcpy(pg, static_cast<const unsigned char*>(b.grad) + i * gsz, left * gsz);
  std::memcpy(pa, static_cast<unsigned char*>(b.exp_avg) + i * msz, left * msz);
  std::memcpy(ps, static_cast<unsigned char*>(b.exp_avg_sq) + i * msz, left * msz);
  k.step8(pm, pg, pa, ps, po, 0, false);
  std::memcpy(b.master + i, pm, left * 4);
  std::memcpy(static_cast<unsigned char*>(b.exp_avg) + i * msz, pa, left * msz);
  std::memcpy(static_cast<unsigned char*>(b.exp_avg_sq) + i * msz, ps, left * msz);
  if (O != Out::kNone) std::memcpy(static_cast<unsigned char*>(b.out) + i * kOut, po, left * kOut);
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

void adamw_chunk_avx2(const Buffers& b, const Consts& c, int64_t begin, int64_t end, bool nt_out) {
  switch (b.grad_dtype) {
    case DType::kF32: return pick_moment<DType::kF32>(b, c, begin, end, nt_out);
    case DType::kBF16: return pick_moment<DType::kBF16>(b, c, begin, end, nt_out);
    default: return pick_moment<DType::kF16>(b, c, begin, end, nt_out);
  }
}

}  // namespace adam
}  // namespace offload

#endif  // __x86_64__
