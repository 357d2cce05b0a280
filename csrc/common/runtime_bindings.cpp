#include "common/cpu_isa.h"
#include "common/registry.h"
#include "common/thread_pool.h"

namespace offload {

void register_runtime(pybind11::module_& m) {
  m.def("num_threads", &num_threads, "Threads (caller included) the CPU kernels use");
  m.def("set_num_threads", &set_num_threads, pybind11::arg("n"),
        "Set the kernel thread count (1..1024); 0 restores the default (usable cores)");
  m.def("usable_cores", &usable_cores);
  m.def("best_isa", [] { return std::string(isa_name(best_isa())); });
  m.def("active_isa", [] { return std::string(isa_name(active_isa())); });
  m.def(
      "set_isa", [](const std::string& name) { set_isa(parse_isa(name)); }, pybind11::arg("isa"),
      "Force the SIMD path of every kernel: 'auto', 'avx512', 'avx2' or 'scalar'");
  m.def("compute_isa", [] { return std::string(isa_name(compute_isa())); },
        "The SIMD path compute-bound kernels (AdamW8bit) take");
  m.def("prefer_widest_for_compute", &prefer_widest_for_compute, pybind11::arg("on"),
        "Compute-bound kernels take the widest path while the memory-bound ones keep set_isa's");
}

}  // namespace offload
