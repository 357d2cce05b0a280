// Host-side copy / cast kernels on raw pointers (no torch headers: rebuilds in seconds).
//
// Casts are bitwise what torch's CPU `tensor.to(dtype)` produces:
//   fp32 -> bf16: round to nearest even on the integer bits (denormals kept, not flushed); every NaN
//                 becomes 0xFFFF, as torch's vectorized path writes it.
//   fp32 -> fp16: IEEE round to nearest even (the F16C / AVX-512 conversion): NaN keeps sign and the top
//                 payload bits, quiet bit set.
//   bf16 -> fp32: exact (shift by 16).
//   fp16 -> fp32: exact; NaN keeps sign and payload, quiet bit set (what VCVTPH2PS does). torch's own
//                 scalar tail (the last n % 8 elements of a call) writes 0x7FFFFFFF for every fp16 NaN
//                 instead, so only fp16 NaNs there can differ from torch, and only in payload/sign.
#pragma once

#include <cstdint>
#include <vector>

namespace offload {
namespace copy {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kBytes = 3 };  // kBytes: plain copy, n in bytes

// One dst <- src job: n elements of `from` converted to `to`. from == to is a plain memcpy
// (n counts elements of that type; kBytes counts bytes). src == nullptr with kBytes zero-fills n bytes.
// Buffers must not overlap.
struct Task {
  void* dst;
  const void* src;
  int64_t n;
  DType from;
  DType to;
};

// Runs every task, split into chunks over the compute pool (offload::parallel_run). Each output
// element depends only on its own input element, so the result is the same for any thread count.
void run_tasks(const std::vector<Task>& tasks);

// Outputs of at least this many bytes (per task) use streaming stores; default 32 MiB, < 0 restores it.
int64_t stream_threshold();
void set_stream_threshold(int64_t bytes);

// Single-threaded conversions / copy of [0, n) on the path offload::active_isa() names (scalar / AVX2 /
// AVX-512); run_tasks calls them on each chunk. `stream`: non-temporal stores (for outputs much larger
// than the cache; the caller issues the sfence).
void cast_f32_to_bf16(const float* src, uint16_t* dst, int64_t n, bool stream = false);
void cast_bf16_to_f32(const uint16_t* src, float* dst, int64_t n, bool stream = false);
void cast_f32_to_f16(const float* src, uint16_t* dst, int64_t n, bool stream = false);
void cast_f16_to_f32(const uint16_t* src, float* dst, int64_t n, bool stream = false);
void copy_bytes(void* dst, const void* src, int64_t n, bool stream = false);

}  // namespace copy
}  // namespace offload
