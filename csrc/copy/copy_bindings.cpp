// Python face of csrc/copy: one batched entry point, copy_many(dsts, srcs), used by offload/ops/copy.py
// for copy_, flatten and unflatten. Validation here is a second line of defence; the Python wrapper
// checks first and names the user's argument.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "common/registry.h"
#include "copy/copy_kernels.h"

namespace offload {
namespace {

copy::DType kind_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return copy::DType::kF32;
    case at::kBFloat16: return copy::DType::kBF16;
    case at::kHalf: return copy::DType::kF16;
    default: return copy::DType::kBytes;
  }
}

void copy_many(const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs) {
  if (dsts.size() != srcs.size())
    throw std::invalid_argument("offload._C.copy_many: dsts has " + std::to_string(dsts.size()) +
                                " tensors but srcs has " + std::to_string(srcs.size()));
  std::vector<copy::Task> tasks;
  tasks.reserve(dsts.size());
  for (size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor& d = dsts[i];
    const at::Tensor& s = srcs[i];
    const std::string at_i = "[" + std::to_string(i) + "]";
    if (!d.device().is_cpu() || !s.device().is_cpu())
      throw std::invalid_argument("offload._C.copy_many: dsts" + at_i + " and srcs" + at_i + " must be CPU tensors");
    if (!d.is_contiguous() || !s.is_contiguous())
      throw std::invalid_argument("offload._C.copy_many: dsts" + at_i + " and srcs" + at_i + " must be contiguous");
    if (d.numel() != s.numel())
      throw std::invalid_argument("offload._C.copy_many: dsts" + at_i + " has " + std::to_string(d.numel()) +
                                  " elements but srcs" + at_i + " has " + std::to_string(s.numel()));
    copy::Task t{d.data_ptr(), s.data_ptr(), d.numel(), kind_of(s), kind_of(d)};
    if (d.scalar_type() == s.scalar_type()) {
      t.from = t.to = copy::DType::kBytes;  // same dtype: a byte copy, whatever the dtype
      t.n = d.numel() * static_cast<int64_t>(d.element_size());
    } else if (t.from == copy::DType::kBytes || t.to == copy::DType::kBytes || t.from != copy::DType::kF32 &&
                                                                                    t.to != copy::DType::kF32) {
      throw std::invalid_argument("offload._C.copy_many: cannot cast srcs" + at_i + " (" +
                                  std::string(c10::toString(s.scalar_type())) + ") to dsts" + at_i + " (" +
                                  std::string(c10::toString(d.scalar_type())) +
                                  "); supported: same dtype, float32<->bfloat16, float32<->float16");
    }
    tasks.push_back(t);
  }
  pybind11::gil_scoped_release nogil;  // pure memory work: let other Python threads (store workers) run
  copy::run_tasks(tasks);
}

}  // namespace

void register_copy(pybind11::module_& m) {
  m.def("copy_many", &copy_many, pybind11::arg("dsts"), pybind11::arg("srcs"),
        "dsts[i] <- srcs[i] for every i (CPU, contiguous, equal numel), casting float32<->bfloat16/float16 "
        "like Tensor.to(), multi-threaded over the kernel pool");
}

}  // namespace offload
