// Python face of csrc/copy: one batched entry point, copy_many(dsts, srcs), used by offload/ops/copy.py
// for copy_, flatten and unflatten. Validation here is a second line of defence; the Python wrapper
// checks first and names the user's argument.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "common/overlap.h"
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
  // Chunks of different tasks run in any order on any thread: no destination may alias a source or
  // another destination.
  std::vector<ByteRange> ranges;
  ranges.reserve(2 * dsts.size());
  for (size_t i = 0; i < dsts.size(); ++i) {
    const std::string at_i = "[" + std::to_string(i) + "]";
    ranges.push_back(byte_range(dsts[i].data_ptr(), dsts[i].nbytes(), "dsts" + at_i, true));
    ranges.push_back(byte_range(srcs[i].data_ptr(), srcs[i].nbytes(), "srcs" + at_i, false));
  }
  std::string clash = first_overlap(std::move(ranges));
  if (!clash.empty())
    throw std::invalid_argument("offload._C.copy_many: " + clash + "; the destination needs its own buffer");
  pybind11::gil_scoped_release nogil;  // pure memory work: let other Python threads (store workers) run
  copy::run_tasks(tasks);
}

// flat[offsets[i] : offsets[i] + srcs[i].numel()] <- srcs[i] (cast to flat's dtype) for every i, and the gaps
// between them (padding) zeroed, all in one parallel run. With to_flat == false the direction is reversed:
// srcs[i] <- its slice of flat, and nothing is zeroed. Offsets must be increasing and non-overlapping.
void flat_copy(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& offsets,
               bool to_flat) {
  const char* fn = to_flat ? "offload._C.flatten_into" : "offload._C.unflatten_from";
  if (!flat.device().is_cpu() || !flat.is_contiguous())
    throw std::invalid_argument(std::string(fn) + ": flat must be a contiguous CPU tensor");
  if (tensors.size() != offsets.size())
    throw std::invalid_argument(std::string(fn) + ": " + std::to_string(tensors.size()) + " tensors but " +
                                std::to_string(offsets.size()) + " offsets");
  const int64_t es = static_cast<int64_t>(flat.element_size());
  char* base = static_cast<char*>(flat.data_ptr());
  std::vector<copy::Task> tasks;
  tasks.reserve(2 * tensors.size() + 1);
  std::vector<at::Tensor> keep;  // contiguous copies of non-contiguous sources live until the run ends
  keep.reserve(tensors.size());
  std::vector<ByteRange> ranges;
  ranges.reserve(tensors.size() + 1);
  int64_t cursor = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const std::string at_i = "[" + std::to_string(i) + "]";
    const int64_t off = offsets[i], n = t.numel();
    if (!t.device().is_cpu())
      throw std::invalid_argument(std::string(fn) + ": tensors" + at_i + " must be a CPU tensor");
    if (off < cursor || off + n > flat.numel())
      throw std::invalid_argument(std::string(fn) + ": offsets" + at_i + " = " + std::to_string(off) +
                                  " overlaps the previous tensor or runs past flat (" +
                                  std::to_string(flat.numel()) + " elements)");
    if (!to_flat && !t.is_contiguous())
      throw std::invalid_argument(std::string(fn) + ": tensors" + at_i + " must be contiguous");
    if (to_flat && off > cursor)  // zero the padding so the bytes written to disk are deterministic
      tasks.push_back({base + cursor * es, nullptr, (off - cursor) * es, copy::DType::kBytes, copy::DType::kBytes});
    const at::Tensor& c = to_flat && !t.is_contiguous() ? keep.emplace_back(t.contiguous()) : t;
    char* slot = base + off * es;
    copy::Task task = to_flat ? copy::Task{slot, c.data_ptr(), n, kind_of(c), kind_of(flat)}
                              : copy::Task{c.data_ptr(), slot, n, kind_of(flat), kind_of(c)};
    if (c.scalar_type() == flat.scalar_type()) {
      task.from = task.to = copy::DType::kBytes;
      task.n = n * es;
    } else if (task.from == copy::DType::kBytes || task.to == copy::DType::kBytes ||
               (task.from != copy::DType::kF32 && task.to != copy::DType::kF32)) {
      throw std::invalid_argument(std::string(fn) + ": cannot cast between tensors" + at_i + " (" +
                                  std::string(c10::toString(c.scalar_type())) + ") and flat (" +
                                  std::string(c10::toString(flat.scalar_type())) + ")");
    }
    tasks.push_back(task);
    ranges.push_back(byte_range(c.data_ptr(), c.nbytes(), "tensors" + at_i, !to_flat));
    cursor = off + n;
  }
  // flat is written whole (slots and padding) by flatten and read by unflatten; a tensor aliasing it,
  // or (unflatten) another output, would be read after being overwritten or written twice. Sources
  // that were not contiguous were copied above, before anything is written.
  ranges.push_back(byte_range(flat.data_ptr(), flat.nbytes(), "flat", to_flat));
  std::string clash = first_overlap(std::move(ranges));
  if (!clash.empty())
    throw std::invalid_argument(std::string(fn) + ": " + clash + "; each output needs its own buffer");
  pybind11::gil_scoped_release nogil;  // pure memory work
  copy::run_tasks(tasks);
}

}  // namespace

void register_copy(pybind11::module_& m) {
  m.def("copy_many", &copy_many, pybind11::arg("dsts"), pybind11::arg("srcs"),
        "dsts[i] <- srcs[i] for every i (CPU, contiguous, equal numel), casting float32<->bfloat16/float16 "
        "like Tensor.to(), multi-threaded over the kernel pool");
  m.def("copy_stream_threshold", &copy::stream_threshold,
        "Output size (bytes per tensor) from which copies/casts use non-temporal stores");
  m.def("set_copy_stream_threshold", &copy::set_stream_threshold, pybind11::arg("nbytes"),
        "Set that size; a negative value restores the default (32 MiB)");
  m.def(
      "flatten_into",
      [](const at::Tensor& flat, const std::vector<at::Tensor>& srcs, const std::vector<int64_t>& offsets) {
        flat_copy(flat, srcs, offsets, true);
      },
      pybind11::arg("flat"), pybind11::arg("srcs"), pybind11::arg("offsets"),
      "flat[offsets[i]:...] <- srcs[i] (cast to flat's dtype), padding zeroed, one parallel run");
  m.def(
      "unflatten_from",
      [](const at::Tensor& flat, const std::vector<at::Tensor>& outs, const std::vector<int64_t>& offsets) {
        flat_copy(flat, outs, offsets, false);
      },
      pybind11::arg("flat"), pybind11::arg("outs"), pybind11::arg("offsets"),
      "outs[i] <- flat[offsets[i]:...] (cast to each out's dtype), one parallel run");
}

}  // namespace offload
