// Python face of the fused AdamW kernel: argument checks (ValueError naming the argument), then the
// kernel with the GIL released.
#include <torch/extension.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam/adam_kernel.h"
#include "adam/adam_membw.h"
#include "common/overlap.h"
#include "common/registry.h"

namespace offload {
namespace {

namespace py = pybind11;
using adam::DType;

// pybind11 turns std::invalid_argument into ValueError.
[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument("offload.ops.adamw_step_: " + msg); }

DType to_dtype(const at::Tensor& t, const char* name, bool allow_f16, bool allow_bf16) {
  const auto st = t.scalar_type();
  if (st == at::kFloat) return DType::kF32;
  if (st == at::kBFloat16 && allow_bf16) return DType::kBF16;
  if (st == at::kHalf && allow_f16) return DType::kF16;
  std::string allowed = "float32";
  if (allow_bf16) allowed += ", bfloat16";
  if (allow_f16) allowed += ", float16";
  bad(std::string(name) + " has dtype " + std::string(c10::toString(st)) + "; expected one of: " + allowed);
}

void check_common(const at::Tensor& t, const char* name, int64_t n) {
  if (!t.device().is_cpu())
    bad(std::string(name) + " is on " + t.device().str() + "; this kernel runs on CPU tensors only");
  if (t.layout() != at::kStrided) bad(std::string(name) + " must be a dense (strided) tensor");
  if (!t.is_contiguous()) bad(std::string(name) + " must be contiguous (call .contiguous() or use a flat buffer)");
  if (t.numel() != n)
    bad(std::string(name) + " has " + std::to_string(t.numel()) + " elements but master has " + std::to_string(n));
}

// A written buffer sharing bytes with any other argument (grad included) makes the result depend on
// which lane or thread reaches an element first.
void check_no_overlap(std::vector<ByteRange> ranges) {
  const std::string clash = first_overlap(std::move(ranges));
  if (!clash.empty()) bad(clash + "; each needs its own buffer");
}

void check_hyper(const adam::Hyper& h) {
  if (!std::isfinite(h.lr) || h.lr < 0) bad("lr must be finite and >= 0, got " + std::to_string(h.lr));
  if (!(h.beta1 >= 0 && h.beta1 < 1)) bad("beta1 must be in [0, 1), got " + std::to_string(h.beta1));
  if (!(h.beta2 >= 0 && h.beta2 < 1)) bad("beta2 must be in [0, 1), got " + std::to_string(h.beta2));
  if (!std::isfinite(h.eps) || h.eps < 0) bad("eps must be finite and >= 0, got " + std::to_string(h.eps));
  if (!std::isfinite(h.weight_decay) || h.weight_decay < 0)
    bad("weight_decay must be finite and >= 0, got " + std::to_string(h.weight_decay));
  if (!std::isfinite(h.grad_scale)) bad("grad_scale must be finite, got " + std::to_string(h.grad_scale));
  if (h.step < 1) bad("step must be >= 1 (the count after this update), got " + std::to_string(h.step));
}

void adamw_step_py(at::Tensor master, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq, double lr,
                   double beta1, double beta2, double eps, double weight_decay, int64_t step, double grad_scale,
                   c10::optional<at::Tensor> out) {
  adam::Buffers b;
  adam::Hyper h{lr, beta1, beta2, eps, weight_decay, grad_scale, step};
  check_hyper(h);
  if (master.scalar_type() != at::kFloat)
    bad(std::string("master has dtype ") + c10::toString(master.scalar_type()) +
        "; expected float32 (keep an fp32 master copy and pass the low-precision param as out=)");
  const int64_t n = master.numel();
  check_common(master, "master", n);
  check_common(grad, "grad", n);
  check_common(exp_avg, "exp_avg", n);
  check_common(exp_avg_sq, "exp_avg_sq", n);
  b.grad_dtype = to_dtype(grad, "grad", /*f16=*/true, /*bf16=*/true);
  b.moment_dtype = to_dtype(exp_avg, "exp_avg", false, true);
  if (to_dtype(exp_avg_sq, "exp_avg_sq", false, true) != b.moment_dtype)
    bad(std::string("exp_avg_sq has dtype ") + c10::toString(exp_avg_sq.scalar_type()) +
        " but exp_avg has " + c10::toString(exp_avg.scalar_type()) + "; both moments need the same dtype");
  std::vector<ByteRange> ranges{bytes_of(master, "master", true), bytes_of(grad, "grad", false),
                                 bytes_of(exp_avg, "exp_avg", true), bytes_of(exp_avg_sq, "exp_avg_sq", true)};
  if (out.has_value() && out->defined()) {
    check_common(*out, "out", n);
    b.out_dtype = to_dtype(*out, "out", true, true);
    ranges.push_back(bytes_of(*out, "out", true));
    b.out = out->data_ptr();
  }
  check_no_overlap(std::move(ranges));
  b.master = master.data_ptr<float>();
  b.grad = grad.data_ptr();
  b.exp_avg = exp_avg.data_ptr();
  b.exp_avg_sq = exp_avg_sq.data_ptr();
  b.n = n;
  {
    py::gil_scoped_release nogil;  // pure memory-bound work on raw pointers: let other Python threads run
    adam::adamw_step(b, h);
  }
  // In-place writes behind autograd's back: bump the version counters as torch's in-place ops do,
  // so a stale saved tensor is detected rather than silently used.
  // (Inference tensors have no version counter.)
  for (const at::Tensor* t : {&master, &exp_avg, &exp_avg_sq, b.out ? &*out : nullptr})
    if (t && !t->is_inference()) t->unsafeGetTensorImpl()->bump_version();
}

// Benchmark helpers: contiguous fp32 CPU tensors of equal size, else ValueError.
std::vector<float*> membw_args(const char* op, std::initializer_list<std::pair<const char*, at::Tensor*>> ts) {
  std::vector<float*> ptrs;
  const int64_t n = ts.begin()->second->numel();
  for (auto& [name, t] : ts) {
    if (t->scalar_type() != at::kFloat || !t->device().is_cpu() || !t->is_contiguous() || t->numel() != n)
      throw std::invalid_argument(std::string("offload.") + op + ": " + name +
                                  " must be a contiguous float32 CPU tensor with " + std::to_string(n) + " elements");
    ptrs.push_back(t->data_ptr<float>());
  }
  return ptrs;
}

}  // namespace

void register_adam(py::module_& m) {
  m.def("adamw_step_", &adamw_step_py, py::arg("master"), py::arg("grad"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::kw_only(), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("step"), py::arg("grad_scale") = 1.0, py::arg("out") = py::none(),
        "Fused AdamW step in place on master/exp_avg/exp_avg_sq; optionally writes the param to out "
        "(bf16/fp16, round-to-nearest-even). See offload.ops.adamw_step_.");
  m.def("adam_nontemporal_out", &adam::nontemporal_out, "Whether the AdamW kernel streams `out` (bypassing cache)");
  m.def("adam_set_nontemporal_out", &adam::set_nontemporal_out, py::arg("on"),
        "Benchmark knob: stream (non-temporal) stores for the AdamW `out` buffer");
  m.def("adam_hw_bf16_available", &adam::hw_bf16_available, "Whether the CPU has VCVTNEPS2BF16 (AVX512_BF16)");
  m.def("adam_set_hw_bf16", &adam::set_hw_bf16, py::arg("on"),
        "Test knob: let the AVX-512 AdamW path use the hardware bf16 convert (default on)");
  m.def(
      "membw_copy_",
      [](at::Tensor dst, at::Tensor src) {
        auto p = membw_args("membw_copy_", {{"dst", &dst}, {"src", &src}});
        py::gil_scoped_release nogil;  // memory-bound loop on raw pointers
        membw::copy(p[0], p[1], dst.numel());
      },
      py::arg("dst"), py::arg("src"), "Roofline helper: dst = src on the kernel pool");
  m.def(
      "membw_triad_",
      [](at::Tensor a, at::Tensor b, at::Tensor c, double s) {
        auto p = membw_args("membw_triad_", {{"a", &a}, {"b", &b}, {"c", &c}});
        py::gil_scoped_release nogil;  // memory-bound loop on raw pointers
        membw::triad(p[0], p[1], p[2], static_cast<float>(s), a.numel());
      },
      py::arg("a"), py::arg("b"), py::arg("c"), py::arg("s"), "Roofline helper: a = b + s*c on the kernel pool");
  m.def(
      "membw_axpy_",
      [](at::Tensor a, at::Tensor b, double s) {
        auto p = membw_args("membw_axpy_", {{"a", &a}, {"b", &b}});
        py::gil_scoped_release nogil;  // memory-bound loop on raw pointers
        membw::axpy(p[0], p[1], static_cast<float>(s), a.numel());
      },
      py::arg("a"), py::arg("b"), py::arg("s"), "Roofline helper: a += s*b on the kernel pool");
  m.def(
      "membw_adam_shaped_",
      [](at::Tensor a, at::Tensor b, at::Tensor c, at::Tensor d, double s) {
        auto p = membw_args("membw_adam_shaped_", {{"a", &a}, {"b", &b}, {"c", &c}, {"d", &d}});
        py::gil_scoped_release nogil;  // memory-bound loop on raw pointers
        membw::adam_shaped(p[0], p[1], p[2], p[3], static_cast<float>(s), a.numel());
      },
      py::arg("a"), py::arg("b"), py::arg("c"), py::arg("d"), py::arg("s"),
      "Roofline helper: a, b, c += s*d on the kernel pool (the fp32 Adam step's traffic, 28 B/elem)");
}

}  // namespace offload
