// STREAM-like kernels (fp32, multi-threaded on the kernel pool) used as the measured memory
// roofline of the AdamW benchmark. Real traffic per element, write-allocate included:
//   copy  dst = src          read 4, write 4 (+4 write-allocate read unless the libc streams)
//   triad a = b + s*c        read 8, write 4, +4 write-allocate read          = 16
//   axpy  a = a + s*b        read 8, write 4, no write-allocate (a is read)   = 12
//   adam-shaped: a,b,c += s*d  read 16, write 12 in place, no write-allocate = 28: the fp32 AdamW
//                              step's streams and bytes (4 read, 3 written back) without its math
#pragma once

#include <cstdint>

namespace offload {
namespace membw {
void copy(float* dst, const float* src, int64_t n);
void triad(float* a, const float* b, const float* c, float s, int64_t n);
void axpy(float* a, const float* b, float s, int64_t n);
void adam_shaped(float* a, float* b, float* c, const float* d, float s, int64_t n);
}  // namespace membw
}  // namespace offload
