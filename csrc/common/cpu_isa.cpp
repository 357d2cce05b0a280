#include "common/cpu_isa.h"

#include <atomic>
#include <stdexcept>

namespace offload {
namespace {

Isa detect() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  // AVX-512 path needs F (arithmetic) and BW (16-bit lanes for the bf16/fp16 pack/unpack).
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return Isa::kAvx512;
  // AVX2 path uses FMA and F16C (fp16 conversion) as well.
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

std::atomic<int> g_active{-1};
std::atomic<bool> g_widest_for_compute{false};

}  // namespace

Isa best_isa() {
  static const Isa best = detect();
  return best;
}

Isa active_isa() {
  int v = g_active.load(std::memory_order_relaxed);
  return v < 0 ? best_isa() : static_cast<Isa>(v);
}

void set_isa(Isa isa) {
  if (static_cast<int>(isa) > static_cast<int>(best_isa()))
    throw std::invalid_argument(std::string("offload.set_isa: this CPU does not support '") + isa_name(isa) +
                                "' (best available: '" + isa_name(best_isa()) + "')");
  g_active.store(static_cast<int>(isa));
  g_widest_for_compute.store(false);
}

Isa compute_isa() { return g_widest_for_compute.load(std::memory_order_relaxed) ? best_isa() : active_isa(); }

void prefer_widest_for_compute(bool on) { g_widest_for_compute.store(on); }

Isa parse_isa(const std::string& name) {
  if (name == "scalar") return Isa::kScalar;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "avx512") return Isa::kAvx512;
  if (name == "auto") return best_isa();
  throw std::invalid_argument("offload.set_isa: isa must be 'auto', 'avx512', 'avx2' or 'scalar', got '" + name +
                              "'");
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace offload
