// A persistent pool of compute threads shared by the CPU kernels (Adam, copy/cast).
//
// run(n_chunks, fn) calls fn(i) once for every i in [0, n_chunks), spread over the pool's threads
// and the calling thread, and returns when all are done. Chunks are claimed from an atomic
// counter, so a slow thread never holds up the others. Kernels must make each chunk's result
// independent of which thread runs it (they are elementwise), so output is identical for every
// thread count. One run() at a time: concurrent callers queue on a mutex.
#pragma once

#include <cstdint>
#include <functional>

namespace offload {

// Number of threads (including the caller) kernels use. Default: usable cores (sched_getaffinity).
int num_threads();
// Most threads set_num_threads() accepts (a guard against typos that would start thousands of threads).
constexpr int kMaxThreads = 1024;
// 1 <= n <= kMaxThreads; n == 0 means "back to the default". Takes effect for the next run().
// Out of range: std::invalid_argument (ValueError in Python).
void set_num_threads(int n);
// Cores this process may run on.
int usable_cores();

void parallel_run(int64_t n_chunks, const std::function<void(int64_t)>& fn);

// Splits [0, n) into chunks of `grain` elements (grain a multiple of any vector width the kernel
// needs, so every chunk but the last has no tail) and runs fn(begin, end) on each.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace offload
