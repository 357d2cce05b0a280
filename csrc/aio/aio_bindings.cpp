// Placeholder until the aio kernels land.
#include "common/registry.h"

namespace offload {
void register_aio(pybind11::module_& m) { (void)m; }
}  // namespace offload
