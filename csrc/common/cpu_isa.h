// Which SIMD path the kernels take. Detected once at run time; a test or a user can force a lower
// one (set_isa) to exercise every path on one machine. Forcing a path the CPU lacks is an error.
#pragma once

#include <string>

namespace offload {

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

Isa best_isa();            // what this CPU supports
Isa active_isa();          // what kernels use now (best unless forced)
void set_isa(Isa isa);     // throws std::invalid_argument if the CPU lacks it
Isa parse_isa(const std::string& name);  // "scalar" | "avx2" | "avx512" | "auto" (= best)
const char* isa_name(Isa isa);

}  // namespace offload
