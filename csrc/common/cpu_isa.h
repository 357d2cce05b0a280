// Which SIMD path the kernels take. Detected once at run time; a test or a user can force a lower
// one (set_isa) to exercise every path on one machine. Forcing a path the CPU lacks is an error.
#pragma once

#include <string>

namespace offload {

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

Isa best_isa();            // what this CPU supports
Isa active_isa();          // what kernels use now (best unless forced)
void set_isa(Isa isa);     // throws std::invalid_argument if the CPU lacks it; every kernel follows it
// Compute-bound kernels (AdamW8bit: a codebook search per element) gain from the widest path even where the
// memory-bound ones were timed faster on a narrower one at load (offload/_ext.py picks that one with set_isa,
// then prefers the widest here); set_isa clears the preference, so a forced path holds for every kernel.
Isa compute_isa();
void prefer_widest_for_compute(bool on);
Isa parse_isa(const std::string& name);  // "scalar" | "avx2" | "avx512" | "auto" (= best)
const char* isa_name(Isa isa);

}  // namespace offload
