// STREAM-like kernels (fp32, multi-threaded on the kernel pool) used as the measured memory
// roofline of the AdamW benchmark. Real traffic per element, write-allocate included:
//   copy  dst = src          read 4, write 4 (+4 write-allocate read unless the libc streams)
//   triad a = b + s*c        read 8, write 4, +4 write-allocate read          = 16
//   axpy  a = a + s*b        read 8, write 4, no write-allocate (a is read)   = 12 (Adam's pattern)
#pragma once

#include <cstdint>

namespace offload {
namespace membw {
void copy(float* dst, const float* src, int64_t n);
void triad(float* a, const float* b, const float* c, float s, int64_t n);
void axpy(float* a, const float* b, float s, int64_t n);
}  // namespace membw
}  // namespace offload
