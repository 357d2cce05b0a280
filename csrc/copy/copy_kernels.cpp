// Copy / cast kernels: scalar reference, AVX2 (+F16C) and AVX-512 paths, chosen per call by
// active_isa(). The scalar functions define the semantics; the vector paths must match them bit for bit
// (the tests force each path and compare against torch's .to()).
#include "copy/copy_kernels.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>

#include "common/bf16.h"
#include "common/cpu_isa.h"
#include "common/fp16.h"
#include "common/thread_pool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace offload {
namespace copy {
namespace {

// ---------------------------------------------------------------- scalar reference
// The per-element conversions live in common/bf16.h and common/fp16.h (shared with the AdamW kernel).

void f32_to_bf16_ref(const float* s, uint16_t* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16_bits(s[i]);
}
void bf16_to_f32_ref(const uint16_t* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = bf16_bits_to_f32(s[i]);
}
void f32_to_f16_ref(const float* s, uint16_t* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16_bits(s[i]);
}
void f16_to_f32_ref(const uint16_t* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = f16_bits_to_f32(s[i]);
}

#if defined(__x86_64__)
// Large outputs (see kStreamBytes) are written with non-temporal (streaming) stores: they skip the read
// of the destination line that a normal store costs (1/3 of the traffic of a copy) and do not evict the
// working set for a buffer that DMA or the disk reads next. Streaming stores need an aligned address,
// so a scalar head runs until the destination is aligned; each chunk ends with an sfence so its bytes
// are visible before the pool reports the chunk done.

// Scalar head: convert until dst + i is `align`-byte aligned (or the range ends).
template <typename S, typename D, typename F>
inline int64_t head_until_aligned(const S* s, D* d, int64_t n, uintptr_t align, F ref) {
  int64_t i = 0;
  while (i < n && (reinterpret_cast<uintptr_t>(d + i) & (align - 1))) ++i;
  ref(s, d, i);
  return i;
}

// ---------------------------------------------------------------- AVX2 (+F16C)
// Vector bodies handle whole vectors; the tail goes through the scalar reference (same semantics).

template <bool NT>
__attribute__((target("avx2"))) inline void st256(void* p, __m256i v) {
  if (NT)
    _mm256_stream_si256(static_cast<__m256i*>(p), v);
  else
    _mm256_storeu_si256(static_cast<__m256i*>(p), v);
}

template <bool NT>
__attribute__((target("avx2"))) inline void st128(void* p, __m128i v) {
  if (NT)
    _mm_stream_si128(static_cast<__m128i*>(p), v);
  else
    _mm_storeu_si128(static_cast<__m128i*>(p), v);
}

__attribute__((target("avx2"))) inline __m256i bf16_round_avx2(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(kBf16NaN), _mm256_castps_si256(nan));
}

template <bool NT>
__attribute__((target("avx2"))) void f32_to_bf16_avx2(const float* s, uint16_t* d, int64_t n) {
  int64_t i = NT ? head_until_aligned(s, d, n, 32, f32_to_bf16_ref) : 0;
  for (; i + 16 <= n; i += 16) {
    __m256i a = bf16_round_avx2(_mm256_loadu_ps(s + i));
    __m256i b = bf16_round_avx2(_mm256_loadu_ps(s + i + 8));
    // packus interleaves 128-bit lanes (a0 b0 a1 b1); the permute puts them back in order. Values are
    // <= 0xFFFF, so unsigned saturation never changes them.
    st256<NT>(d + i, _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8));
  }
  f32_to_bf16_ref(s + i, d + i, n - i);
}

template <bool NT>
__attribute__((target("avx2"))) void bf16_to_f32_avx2(const uint16_t* s, float* d, int64_t n) {
  int64_t i = NT ? head_until_aligned(s, d, n, 32, bf16_to_f32_ref) : 0;
  for (; i + 8 <= n; i += 8) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    st256<NT>(d + i, _mm256_slli_epi32(w, 16));
  }
  bf16_to_f32_ref(s + i, d + i, n - i);
}

template <bool NT>
__attribute__((target("avx2,f16c"))) void f32_to_f16_avx2(const float* s, uint16_t* d, int64_t n) {
  int64_t i = NT ? head_until_aligned(s, d, n, 16, f32_to_f16_ref) : 0;
  for (; i + 8 <= n; i += 8)
    st128<NT>(d + i, _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  f32_to_f16_ref(s + i, d + i, n - i);
}

template <bool NT>
__attribute__((target("avx2,f16c"))) void f16_to_f32_avx2(const uint16_t* s, float* d, int64_t n) {
  int64_t i = NT ? head_until_aligned(s, d, n, 32, f16_to_f32_ref) : 0;
  for (; i + 8 <= n; i += 8)
    st256<NT>(d + i, _mm256_castps_si256(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)))));
  f16_to_f32_ref(s + i, d + i, n - i);
}

__attribute__((target("avx2"))) void stream_copy_avx2(char* d, const char* s, int64_t n) {
  int64_t i = 0;
  while (i < n && (reinterpret_cast<uintptr_t>(d + i) & 31)) d[i] = s[i], ++i;
  for (; i + 128 <= n; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
  std::memcpy(d + i, s + i, static_cast<size_t>(n - i));
}

// ---------------------------------------------------------------- AVX-512
// Not VCVTNEPS2BF16: it flushes denormal inputs to zero, torch does not. Integer rounding instead.

template <bool NT>
__attribute__((target("avx512f,avx512bw"))) inline void st256x(void* p, __m256i v) {
  if (NT)
    _mm256_stream_si256(static_cast<__m256i*>(p), v);
  else
    _mm256_storeu_si256(static_cast<__m256i*>(p), v);
}

template <bool NT>
__attribute__((target("avx512f,avx512bw"))) inline void st512(void* p, __m512i v) {
  if (NT)
    _mm512_stream_si512(static_cast<__m512i*>(p), v);
  else
    _mm512_storeu_si512(p, v);
}

template <bool NT>
__attribute__((target("avx512f,avx512bw"))) void f32_to_bf16_avx512(const float* s, uint16_t* d, int64_t n) {
  const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), nanv = _mm512_set1_epi32(kBf16NaN);
  int64_t i = NT ? head_until_aligned(s, d, n, 32, f32_to_bf16_ref) : 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(s + i);
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, bias)), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, nanv);
    st256x<NT>(d + i, _mm512_cvtepi32_epi16(r));
  }
  f32_to_bf16_ref(s + i, d + i, n - i);
}

template <bool NT>
__attribute__((target("avx512f,avx512bw"))) void bf16_to_f32_avx512(const uint16_t* s, float* d, int64_t n) {
  int64_t i = NT ? head_until_aligned(s, d, n, 64, bf16_to_f32_ref) : 0;
  for (; i + 16 <= n; i += 16) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
    st512<NT>(d + i, _mm512_slli_epi32(w, 16));
  }
  bf16_to_f32_ref(s + i, d + i, n - i);
}

template <bool NT>
__attribute__((target("avx512f,avx512bw"))) void f32_to_f16_avx512(const float* s, uint16_t* d, int64_t n) {
  int64_t i = NT ? head_until_aligned(s, d, n, 32, f32_to_f16_ref) : 0;
  for (; i + 16 <= n; i += 16)
    st256x<NT>(d + i, _mm512_cvtps_ph(_mm512_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  f32_to_f16_ref(s + i, d + i, n - i);
}

template <bool NT>
__attribute__((target("avx512f,avx512bw"))) void f16_to_f32_avx512(const uint16_t* s, float* d, int64_t n) {
  int64_t i = NT ? head_until_aligned(s, d, n, 64, f16_to_f32_ref) : 0;
  for (; i + 16 <= n; i += 16)
    st512<NT>(d + i, _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)))));
  f16_to_f32_ref(s + i, d + i, n - i);
}

__attribute__((target("avx512f,avx512bw"))) void stream_copy_avx512(char* d, const char* s, int64_t n) {
  int64_t i = 0;
  while (i < n && (reinterpret_cast<uintptr_t>(d + i) & 63)) d[i] = s[i], ++i;
  for (; i + 256 <= n; i += 256) {
    __m512i a = _mm512_loadu_si512(s + i);
    __m512i b = _mm512_loadu_si512(s + i + 64);
    __m512i c = _mm512_loadu_si512(s + i + 128);
    __m512i e = _mm512_loadu_si512(s + i + 192);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 64), b);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 128), c);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 192), e);
  }
  std::memcpy(d + i, s + i, static_cast<size_t>(n - i));
}
#endif  // __x86_64__

int64_t elem_size(DType t) { return t == DType::kF32 ? 4 : t == DType::kBytes ? 1 : 2; }

// Chunk size in elements: big enough that the claim/dispatch cost vanishes (~256 KiB of output),
// a multiple of 16 so every chunk but a task's last has no vector tail.
int64_t grain_for(const Task& t) {
  const int64_t bytes = 256 * 1024;
  return std::max<int64_t>(16, bytes / elem_size(t.to));
}

}  // namespace

#if defined(__x86_64__)
#define OFFLOAD_DISPATCH(name, ...)                                                               \
  switch (active_isa()) {                                                                         \
    case Isa::kAvx512:                                                                            \
      return stream ? name##_avx512<true>(__VA_ARGS__) : name##_avx512<false>(__VA_ARGS__);       \
    case Isa::kAvx2: return stream ? name##_avx2<true>(__VA_ARGS__) : name##_avx2<false>(__VA_ARGS__); \
    default: return name##_ref(__VA_ARGS__);                                                      \
  }
#else
#define OFFLOAD_DISPATCH(name, ...) return (void)stream, name##_ref(__VA_ARGS__);
#endif

void cast_f32_to_bf16(const float* s, uint16_t* d, int64_t n, bool stream) { OFFLOAD_DISPATCH(f32_to_bf16, s, d, n) }
void cast_bf16_to_f32(const uint16_t* s, float* d, int64_t n, bool stream) { OFFLOAD_DISPATCH(bf16_to_f32, s, d, n) }
void cast_f32_to_f16(const float* s, uint16_t* d, int64_t n, bool stream) { OFFLOAD_DISPATCH(f32_to_f16, s, d, n) }
void cast_f16_to_f32(const uint16_t* s, float* d, int64_t n, bool stream) { OFFLOAD_DISPATCH(f16_to_f32, s, d, n) }

void copy_bytes(void* dst, const void* src, int64_t n, bool stream) {
#if defined(__x86_64__)
  if (stream && active_isa() == Isa::kAvx512)
    return stream_copy_avx512(static_cast<char*>(dst), static_cast<const char*>(src), n);
  if (stream && active_isa() == Isa::kAvx2)
    return stream_copy_avx2(static_cast<char*>(dst), static_cast<const char*>(src), n);
#endif
  (void)stream;
  std::memcpy(dst, src, static_cast<size_t>(n));
}

namespace {

// Outputs at least this large are written with streaming stores (see above). Below it the output
// probably stays in cache for whoever reads it next, and normal stores win. Settable so the tests can
// run the streaming paths on small sizes.
std::atomic<int64_t> g_stream_bytes{32ll << 20};

void run_range(const Task& t, int64_t b, int64_t e) {
  const int64_t n = e - b;
  if (t.src == nullptr) {  // padding between flattened tensors
    std::memset(static_cast<char*>(t.dst) + b, 0, static_cast<size_t>(n));
    return;
  }
  const bool stream = t.n * elem_size(t.to) >= g_stream_bytes.load(std::memory_order_relaxed);
  if (t.from == t.to) {
    const int64_t es = elem_size(t.to);
    copy_bytes(static_cast<char*>(t.dst) + b * es, static_cast<const char*>(t.src) + b * es, n * es, stream);
  } else if (t.from == DType::kF32 && t.to == DType::kBF16) {
    cast_f32_to_bf16(static_cast<const float*>(t.src) + b, static_cast<uint16_t*>(t.dst) + b, n, stream);
  } else if (t.from == DType::kBF16 && t.to == DType::kF32) {
    cast_bf16_to_f32(static_cast<const uint16_t*>(t.src) + b, static_cast<float*>(t.dst) + b, n, stream);
  } else if (t.from == DType::kF32 && t.to == DType::kF16) {
    cast_f32_to_f16(static_cast<const float*>(t.src) + b, static_cast<uint16_t*>(t.dst) + b, n, stream);
  } else if (t.from == DType::kF16 && t.to == DType::kF32) {
    cast_f16_to_f32(static_cast<const uint16_t*>(t.src) + b, static_cast<float*>(t.dst) + b, n, stream);
  } else {
    throw std::invalid_argument("offload copy kernels: unsupported cast (only fp32<->bf16 and fp32<->fp16)");
  }
#if defined(__x86_64__)
  if (stream) _mm_sfence();  // streaming stores are weakly ordered: publish them before the chunk counts as done
#endif
}

}  // namespace

int64_t stream_threshold() { return g_stream_bytes.load(); }
void set_stream_threshold(int64_t bytes) { g_stream_bytes.store(bytes < 0 ? (32ll << 20) : bytes); }

void run_tasks(const std::vector<Task>& tasks) {
  // Flatten every task into (task, begin, end) pieces so many small tensors and one huge one both
  // spread evenly over the pool in a single parallel run.
  struct Piece {
    int32_t task;
    int64_t b, e;
  };
  std::vector<Piece> pieces;
  for (size_t k = 0; k < tasks.size(); ++k) {
    const Task& t = tasks[k];
    if (t.n <= 0) continue;
    const int64_t g = grain_for(t);
    for (int64_t b = 0; b < t.n; b += g) pieces.push_back({static_cast<int32_t>(k), b, std::min(t.n, b + g)});
  }
  // A tiny job is cheaper on the calling thread than waking the pool.
  if (pieces.size() == 1) {
    run_range(tasks[pieces[0].task], pieces[0].b, pieces[0].e);
    return;
  }
  parallel_run(static_cast<int64_t>(pieces.size()), [&](int64_t i) {
    const Piece& p = pieces[static_cast<size_t>(i)];
    run_range(tasks[p.task], p.b, p.e);
  });
}

}  // namespace copy
}  // namespace offload
