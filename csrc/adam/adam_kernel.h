// Fused CPU AdamW on raw pointers: one pass over memory per step.
//
// Per element it reads the fp32 master, the two moments (fp32, or bf16 when opted in) and the grad
// (fp32 / bf16 / fp16), and writes master and moments back in place plus, optionally, the updated
// param rounded to bf16/fp16 into `out` (round-to-nearest-even, bit-equal to torch's `.to(dtype)`,
// denormals and NaNs included: a bf16 NaN is 0xFFFF, an fp16 NaN keeps its sign and payload), so no
// separate cast pass and no fp32 grad buffer is needed.
//
// The arithmetic is torch.optim.AdamW's. The moments follow torch's single-tensor path operation by
// operation (same fused multiply-adds), so they match torch bit for bit; the param update folds
// the bias correction of v into the scalars, which saves one division per element (the divider is
// the kernel's only slow unit) and moves the param by at most a few ulps of its update from torch's:
//   g  = grad * grad_scale
//   p  = p * (1 - lr*wd)                          decoupled weight decay
//   m  = lerp(m, g, 1 - beta1)                    torch's lerp: fma(w, g - m, m) for w < 0.5
//   v  = fma((1 - beta2) * g, g, v * beta2)
//   p  = p + (step * m) / (sqrt(v) + eps_hat)     step = -lr*sqrt(bc2)/bc1, eps_hat = eps*sqrt(bc2)
//      (= p - lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps), torch's form)
// Every ISA path computes exactly these roundings (IEEE sqrt and division, explicit FMAs), so the
// paths agree bit for bit with each other, and each element's result does not depend on the
// chunking, so every thread count agrees too.
#pragma once

#include <cstdint>

namespace offload {
namespace adam {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

const char* dtype_name(DType d);

struct Buffers {
  float* master = nullptr;      // n fp32, updated in place
  const void* grad = nullptr;   // n elements of grad_dtype
  DType grad_dtype = DType::kF32;
  void* exp_avg = nullptr;      // n elements of moment_dtype, in place
  void* exp_avg_sq = nullptr;   // n elements of moment_dtype, in place
  DType moment_dtype = DType::kF32;  // kF32 or kBF16
  void* out = nullptr;          // optional: n elements of out_dtype receive the updated param
  DType out_dtype = DType::kBF16;    // kBF16 or kF16 (kF32 allowed: a plain copy of master)
  int64_t n = 0;
};

struct Hyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0, grad_scale = 1.0;
  int64_t step = 1;  // 1-based, after increment (as torch's state["step"])
};

// Per-call constants, rounded to fp32 the way torch rounds its Python scalars into fp32 kernels.
struct Consts {
  float gs;       // grad scale
  float w1;       // 1 - beta1 (lerp weight)
  float w1m1;     // w1 - 1 (torch's lerp for weights >= 0.5)
  bool lerp_lo;   // |w1| < 0.5: lerp as fma(w1, g - m, m), else fma(w1 - 1, g - m, g)
  float b2;       // beta2
  float c2;       // 1 - beta2
  float decay;    // 1 - lr * weight_decay
  float step;     // -lr * sqrt(bc2) / bc1, bc_i = 1 - beta_i^step
  float eps_hat;  // eps * sqrt(bc2)
};

Consts make_consts(const Hyper& h);

// Checks nothing (the bindings validate); runs on the kernel pool with the active ISA.
void adamw_step(const Buffers& b, const Hyper& h);

// One chunk [begin, end) on a given path. Exposed for the dispatch in adam_kernel.cpp.
void adamw_chunk_scalar(const Buffers& b, const Consts& c, int64_t begin, int64_t end);
void adamw_chunk_avx2(const Buffers& b, const Consts& c, int64_t begin, int64_t end, bool nt_out);
void adamw_chunk_avx512(const Buffers& b, const Consts& c, int64_t begin, int64_t end, bool nt_out);

// Non-temporal (streaming) stores for `out`: it is written once and not read again in this pass,
// so skipping the read-for-ownership saves its bytes. On by default; a knob for the benchmark.
bool nontemporal_out();
void set_nontemporal_out(bool on);

// The AVX-512 path rounds to bf16 with VCVTNEPS2BF16 where the CPU has AVX512_BF16 (integer
// rounding otherwise, or for vectors holding denormals or NaNs, which that instruction would write
// differently from torch). Off: always the integer rounding, so a test can check both on one machine.
// Returns whether the CPU has the instruction at all.
bool hw_bf16_available();
void set_hw_bf16(bool on);

}  // namespace adam
}  // namespace offload
