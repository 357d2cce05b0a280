// Each csrc/ subsystem adds its functions to the one Python module through one register_* call,
// so module.cpp is the only file that knows them all.
#pragma once

#include <pybind11/pybind11.h>  // torch/extension.h only where tensors cross (slow to compile)

namespace offload {
void register_runtime(pybind11::module_& m);  // common/runtime_bindings.cpp: threads, ISA
void register_adam(pybind11::module_& m);     // adam/
void register_adam8bit(pybind11::module_& m); // adam/adam8bit_bindings.cpp: AdamW with 8-bit moments
void register_copy(pybind11::module_& m);     // copy/
void register_aio(pybind11::module_& m);      // aio/
void register_host_pool(pybind11::module_& m); // memory/host_pool.cpp: torch's CPU allocator while a runtime is open
}  // namespace offload
