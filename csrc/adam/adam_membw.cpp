// STREAM-like memory kernels on the same thread pool as the AdamW kernel: the roofline the Adam
// benchmark measures against in the same run (same threads, same chunking, same host noise).
// Plain loops; the compiler vectorises them, and memory, not arithmetic, bounds them.
#include "adam/adam_membw.h"

#include <cstring>

#include "common/thread_pool.h"

#if defined(__x86_64__)
#define OFFLOAD_MEMBW __attribute__((target("avx2,fma")))
#else
#define OFFLOAD_MEMBW
#endif

namespace offload {
namespace membw {
namespace {

constexpr int64_t kGrain = 1 << 15;  // as the AdamW kernel

OFFLOAD_MEMBW void triad_chunk(float* __restrict a, const float* __restrict b, const float* __restrict c, float s,
                               int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
}

OFFLOAD_MEMBW void axpy_chunk(float* __restrict a, const float* __restrict b, float s, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) a[i] = a[i] + s * b[i];
}

OFFLOAD_MEMBW void adam_shaped_chunk(float* __restrict a, float* __restrict b, float* __restrict c,
                                     const float* __restrict d, float s, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float x = s * d[i];
    a[i] += x;
    b[i] += x;
    c[i] += x;
  }
}

}  // namespace

void copy(float* dst, const float* src, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t b, int64_t e) { std::memcpy(dst + b, src + b, (e - b) * sizeof(float)); });
}

void triad(float* a, const float* b, const float* c, float s, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t lo, int64_t hi) { triad_chunk(a, b, c, s, lo, hi); });
}

void axpy(float* a, const float* b, float s, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t lo, int64_t hi) { axpy_chunk(a, b, s, lo, hi); });
}

void adam_shaped(float* a, float* b, float* c, const float* d, float s, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t lo, int64_t hi) { adam_shaped_chunk(a, b, c, d, s, lo, hi); });
}

}  // namespace membw
}  // namespace offload
