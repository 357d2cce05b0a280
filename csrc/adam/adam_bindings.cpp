// Placeholder until the adam kernels land.
#include "common/registry.h"

namespace offload {
void register_adam(pybind11::module_& m) { (void)m; }
}  // namespace offload
