// Dispatch, per-call constants and the scalar reference path of the fused AdamW kernel.
#include "adam/adam_kernel.h"

#include <atomic>
#include <cmath>

#include "common/bf16.h"
#include "common/cpu_isa.h"
#include "common/fp16.h"
#include "common/thread_pool.h"

namespace offload {
namespace adam {
namespace {

// Elements per chunk handed to a thread: a multiple of every vector width (and of 32 so that a
// chunk's bf16/fp16 `out` slice starts 64-byte aligned when the buffer does), large enough that the
// pool's atomic counter is noise, small enough that 2-4 threads still balance on a 1M tensor.
constexpr int64_t kGrain = 1 << 15;

std::atomic<bool> g_nt_out{true};

// Conversions are common/bf16.h and common/fp16.h, the copy kernels' own: round-to-nearest-even,
// denormals kept, bf16 NaN -> 0xFFFF and fp16 NaN -> quiet with sign and payload kept, i.e. what
// torch's .to(dtype) writes. The vector paths produce the same bits.

inline float load_as_f32(const void* p, DType d, int64_t i) {
  switch (d) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kBF16: return bf16_bits_to_f32(static_cast<const uint16_t*>(p)[i]);
    default: return f16_bits_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}

inline void store_from_f32(void* p, DType d, int64_t i, float x) {
  switch (d) {
    case DType::kF32: static_cast<float*>(p)[i] = x; break;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16_bits(x); break;
    default: static_cast<uint16_t*>(p)[i] = f32_to_f16_bits(x); break;
  }
}

}  // namespace

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    default: return "float16";
  }
}

Consts make_consts(const Hyper& h) {
  // Scalars are formed in double and rounded once to fp32, as torch does when a Python float
  // meets a float32 tensor op.
  Consts c;
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  c.gs = static_cast<float>(h.grad_scale);
  c.w1 = static_cast<float>(1.0 - h.beta1);
  c.w1m1 = c.w1 - 1.0f;
  c.lerp_lo = std::fabs(c.w1) < 0.5f;
  c.b2 = static_cast<float>(h.beta2);
  c.c2 = static_cast<float>(1.0 - h.beta2);
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  c.step = static_cast<float>(-h.lr * std::sqrt(bc2) / bc1);
  c.eps_hat = static_cast<float>(h.eps * std::sqrt(bc2));
  return c;
}

// The reference every vector path must equal bit for bit. std::fma is an exact fused multiply-add
// (a libm call without -mfma: slow but exact; this path only runs when forced or on non-x86).
void adamw_chunk_scalar(const Buffers& b, const Consts& c, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = load_as_f32(b.grad, b.grad_dtype, i) * c.gs;
    float m = load_as_f32(b.exp_avg, b.moment_dtype, i);
    float v = load_as_f32(b.exp_avg_sq, b.moment_dtype, i);
    float p = b.master[i] * c.decay;
    const float d = g - m;
    m = c.lerp_lo ? std::fma(c.w1, d, m) : std::fma(c.w1m1, d, g);
    v = std::fma(c.c2 * g, g, v * c.b2);
    const float denom = std::sqrt(v) + c.eps_hat;
    p = p + (c.step * m) / denom;
    // Moments stored in bf16 are rounded after the update; the update itself used fp32 values.
    store_from_f32(b.exp_avg, b.moment_dtype, i, m);
    store_from_f32(b.exp_avg_sq, b.moment_dtype, i, v);
    b.master[i] = p;
    if (b.out) store_from_f32(b.out, b.out_dtype, i, p);
  }
}

#if !defined(__x86_64__)
bool hw_bf16_available() { return false; }
void set_hw_bf16(bool) {}
#endif

bool nontemporal_out() { return g_nt_out.load(std::memory_order_relaxed); }
void set_nontemporal_out(bool on) { g_nt_out.store(on); }

void adamw_step(const Buffers& b, const Hyper& h) {
  if (b.n <= 0) return;
  const Consts c = make_consts(h);
  const Isa isa = active_isa();
  const bool nt = nontemporal_out();
  parallel_for(b.n, kGrain, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__)
    if (isa == Isa::kAvx512) return adamw_chunk_avx512(b, c, begin, end, nt);
    if (isa == Isa::kAvx2) return adamw_chunk_avx2(b, c, begin, end, nt);
#endif
    adamw_chunk_scalar(b, c, begin, end);
  });
}

}  // namespace adam
}  // namespace offload
