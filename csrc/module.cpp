// The one Python module of offload's C++ side. Each subsystem registers its own functions.
#include "common/registry.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "offload C++ kernels: fused CPU AdamW, copy/cast, async NVMe engine, host pool";
  offload::register_runtime(m);
  offload::register_adam(m);
  offload::register_adam8bit(m);
  offload::register_copy(m);
  offload::register_aio(m);
  offload::register_host_pool(m);
}
