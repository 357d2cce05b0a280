// STREAM-like memory kernels on the same thread pool as the AdamW kernel: the roofline the Adam
// benchmark measures against in the same run (same threads, same chunking, same host noise).
// Plain loops; the compiler vectorises them, and memory, not arithmetic, bounds them.
#include "adam/adam_membw.h"

#include <cstring>

#include "common/cpu_isa.h"
#include "common/thread_pool.h"

namespace offload {
namespace membw {
namespace {

constexpr int64_t kGrain = 1 << 15;  // as the AdamW kernel

// Each loop body is written once and compiled twice: for the baseline ISA and, on x86, for AVX2+FMA.
// Which runs follows the kernels' active ISA, so a CPU without AVX2 (or a forced scalar path) never
// meets an AVX2 instruction.
#define OFFLOAD_INLINE inline __attribute__((always_inline))

OFFLOAD_INLINE void triad_body(float* __restrict a, const float* __restrict b, const float* __restrict c, float s,
                               int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
}

OFFLOAD_INLINE void axpy_body(float* __restrict a, const float* __restrict b, float s, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) a[i] = a[i] + s * b[i];
}

OFFLOAD_INLINE void adam_shaped_body(float* __restrict a, float* __restrict b, float* __restrict c,
                                     const float* __restrict d, float s, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float x = s * d[i];
    a[i] += x;
    b[i] += x;
    c[i] += x;
  }
}

void triad_base(float* a, const float* b, const float* c, float s, int64_t lo, int64_t hi) {
  triad_body(a, b, c, s, lo, hi);
}
void axpy_base(float* a, const float* b, float s, int64_t lo, int64_t hi) { axpy_body(a, b, s, lo, hi); }
void adam_shaped_base(float* a, float* b, float* c, const float* d, float s, int64_t lo, int64_t hi) {
  adam_shaped_body(a, b, c, d, s, lo, hi);
}

#if defined(__x86_64__)
#define OFFLOAD_AVX2 __attribute__((target("avx2,fma")))
OFFLOAD_AVX2 void triad_avx2(float* a, const float* b, const float* c, float s, int64_t lo, int64_t hi) {
  triad_body(a, b, c, s, lo, hi);
}
OFFLOAD_AVX2 void axpy_avx2(float* a, const float* b, float s, int64_t lo, int64_t hi) { axpy_body(a, b, s, lo, hi); }
OFFLOAD_AVX2 void adam_shaped_avx2(float* a, float* b, float* c, const float* d, float s, int64_t lo, int64_t hi) {
  adam_shaped_body(a, b, c, d, s, lo, hi);
}
bool use_avx2() { return active_isa() >= Isa::kAvx2; }
#else
#define triad_avx2 triad_base
#define axpy_avx2 axpy_base
#define adam_shaped_avx2 adam_shaped_base
bool use_avx2() { return false; }
#endif

}  // namespace

void copy(float* dst, const float* src, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t b, int64_t e) { std::memcpy(dst + b, src + b, (e - b) * sizeof(float)); });
}

void triad(float* a, const float* b, const float* c, float s, int64_t n) {
  auto* chunk = use_avx2() ? triad_avx2 : triad_base;
  parallel_for(n, kGrain, [&](int64_t lo, int64_t hi) { chunk(a, b, c, s, lo, hi); });
}

void axpy(float* a, const float* b, float s, int64_t n) {
  auto* chunk = use_avx2() ? axpy_avx2 : axpy_base;
  parallel_for(n, kGrain, [&](int64_t lo, int64_t hi) { chunk(a, b, s, lo, hi); });
}

void adam_shaped(float* a, float* b, float* c, const float* d, float s, int64_t n) {
  auto* chunk = use_avx2() ? adam_shaped_avx2 : adam_shaped_base;
  parallel_for(n, kGrain, [&](int64_t lo, int64_t hi) { chunk(a, b, c, d, s, lo, hi); });
}

}  // namespace membw
}  // namespace offload
