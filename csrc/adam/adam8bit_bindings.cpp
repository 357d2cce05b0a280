// Python face of AdamW8bit (adam8bit.h): argument checks (ValueError naming the argument), then the
// kernel with the GIL released. Also the quantizer alone and the codebooks, for tests and tools.
#include <torch/extension.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam/adam8bit.h"
#include "adam/adam_kernel.h"
#include "common/overlap.h"
#include "common/registry.h"

namespace offload {
namespace {

namespace py = pybind11;
using adam::DType;

// pybind11 turns std::invalid_argument into ValueError.
[[noreturn]] void bad(const char* fn, const std::string& msg) {
  throw std::invalid_argument(std::string("offload.ops.") + fn + ": " + msg);
}

constexpr const char* kStep = "adamw8bit_step_";

DType float_dtype(const char* fn, const at::Tensor& t, const char* name, bool allow_f32, bool allow_half) {
  const auto st = t.scalar_type();
  if (st == at::kFloat && allow_f32) return DType::kF32;
  if (st == at::kBFloat16 && allow_half) return DType::kBF16;
  if (st == at::kHalf && allow_half) return DType::kF16;
  std::string allowed = allow_f32 ? "float32" : "";
  if (allow_half) allowed += std::string(allowed.empty() ? "" : ", ") + "bfloat16, float16";
  bad(fn, std::string(name) + " has dtype " + std::string(c10::toString(st)) + "; expected one of: " + allowed);
}

void check_tensor(const char* fn, const at::Tensor& t, const char* name, int64_t n, const char* of) {
  if (!t.device().is_cpu())
    bad(fn, std::string(name) + " is on " + t.device().str() + "; this kernel runs on CPU tensors only");
  if (t.layout() != at::kStrided) bad(fn, std::string(name) + " must be a dense (strided) tensor");
  if (!t.is_contiguous()) bad(fn, std::string(name) + " must be contiguous (call .contiguous() or use a flat buffer)");
  if (t.numel() != n)
    bad(fn, std::string(name) + " has " + std::to_string(t.numel()) + " elements but expected " +
                std::to_string(n) + " (" + of + ")");
}

void check_exact(const char* fn, const at::Tensor& t, const char* name, at::ScalarType st) {
  if (t.scalar_type() != st)
    bad(fn, std::string(name) + " has dtype " + std::string(c10::toString(t.scalar_type())) + "; expected " +
                std::string(c10::toString(st)));
}

// A written buffer sharing bytes with any other argument makes the result depend on which thread
// reaches an element first.
void check_no_overlap(const char* fn, std::vector<ByteRange> ranges) {
  const std::string clash = first_overlap(std::move(ranges));
  if (!clash.empty()) bad(fn, clash + "; each needs its own buffer");
}

void check_hyper(const adam::Hyper& h) {
  if (!std::isfinite(h.lr) || h.lr < 0) bad(kStep, "lr must be finite and >= 0, got " + std::to_string(h.lr));
  if (!(h.beta1 >= 0 && h.beta1 < 1)) bad(kStep, "beta1 must be in [0, 1), got " + std::to_string(h.beta1));
  if (!(h.beta2 >= 0 && h.beta2 < 1)) bad(kStep, "beta2 must be in [0, 1), got " + std::to_string(h.beta2));
  if (!std::isfinite(h.eps) || h.eps < 0) bad(kStep, "eps must be finite and >= 0, got " + std::to_string(h.eps));
  if (!std::isfinite(h.weight_decay) || h.weight_decay < 0)
    bad(kStep, "weight_decay must be finite and >= 0, got " + std::to_string(h.weight_decay));
  if (!std::isfinite(h.grad_scale)) bad(kStep, "grad_scale must be finite, got " + std::to_string(h.grad_scale));
  if (h.step < 1) bad(kStep, "step must be >= 1 (the count after this update), got " + std::to_string(h.step));
}

void bump(const at::Tensor& t) {
  // In-place writes behind autograd's back: bump the version counter as torch's in-place ops do.
  if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

void adamw8bit_step_py(at::Tensor master, at::Tensor grad, at::Tensor m_codes, at::Tensor m_absmax,
                       at::Tensor v_codes, at::Tensor v_absmax, int64_t lo, int64_t hi, double lr, double beta1,
                       double beta2, double eps, double weight_decay, int64_t step, double grad_scale,
                       c10::optional<at::Tensor> out) {
  adam::Hyper h{lr, beta1, beta2, eps, weight_decay, grad_scale, step};
  check_hyper(h);
  if (master.scalar_type() != at::kFloat)
    bad(kStep, std::string("master has dtype ") + c10::toString(master.scalar_type()) +
                   "; expected float32 (keep an fp32 master copy and pass the low-precision param as out=)");
  const int64_t n = master.numel(), nb = adam8::num_blocks(n);
  check_tensor(kStep, master, "master", n, "master's numel");
  check_tensor(kStep, grad, "grad", n, "master's numel");
  check_exact(kStep, m_codes, "exp_avg_codes", at::kByte);
  check_tensor(kStep, m_codes, "exp_avg_codes", n, "master's numel");
  check_exact(kStep, v_codes, "exp_avg_sq_codes", at::kByte);
  check_tensor(kStep, v_codes, "exp_avg_sq_codes", n, "master's numel");
  check_exact(kStep, m_absmax, "exp_avg_absmax", at::kFloat);
  check_tensor(kStep, m_absmax, "exp_avg_absmax", nb, "ceil(numel / 256) blocks");
  check_exact(kStep, v_absmax, "exp_avg_sq_absmax", at::kFloat);
  check_tensor(kStep, v_absmax, "exp_avg_sq_absmax", nb, "ceil(numel / 256) blocks");
  if (lo < 0 || lo > n) bad(kStep, "lo must be in [0, " + std::to_string(n) + "], got " + std::to_string(lo));
  if (hi < lo || hi > n)
    bad(kStep, "hi must be in [lo, numel] = [" + std::to_string(lo) + ", " + std::to_string(n) + "], got " +
                   std::to_string(hi));
  adam8::Buffers b;
  b.grad_dtype = float_dtype(kStep, grad, "grad", true, true);
  const std::pair<const at::Tensor*, const char*> outs[] = {
      {&master, "master"}, {&m_codes, "exp_avg_codes"}, {&m_absmax, "exp_avg_absmax"},
      {&v_codes, "exp_avg_sq_codes"}, {&v_absmax, "exp_avg_sq_absmax"}};
  std::vector<ByteRange> ranges{bytes_of(grad, "grad", false)};
  for (const auto& [t, name] : outs) ranges.push_back(bytes_of(*t, name, true));
  if (out.has_value() && out->defined()) {
    check_tensor(kStep, *out, "out", n, "master's numel");
    b.out_dtype = float_dtype(kStep, *out, "out", true, true);
    ranges.push_back(bytes_of(*out, "out", true));
    b.out = out->data_ptr();
  }
  check_no_overlap(kStep, std::move(ranges));
  b.master = master.data_ptr<float>();
  b.grad = grad.data_ptr();
  b.m_codes = m_codes.data_ptr<uint8_t>();
  b.m_absmax = m_absmax.data_ptr<float>();
  b.v_codes = v_codes.data_ptr<uint8_t>();
  b.v_absmax = v_absmax.data_ptr<float>();
  b.n = n;
  {
    py::gil_scoped_release nogil;  // memory-bound work on raw pointers: let other Python threads run
    adam8::adamw8bit_step(b, h, lo, hi);
  }
  for (const auto& [t, name] : outs) bump(*t);
  if (b.out) bump(*out);
}

void quantize_py(at::Tensor values, at::Tensor codes, at::Tensor absmax, bool is_signed) {
  constexpr const char* fn = "adam8bit_quantize_";
  check_exact(fn, values, "values", at::kFloat);
  const int64_t n = values.numel();
  check_tensor(fn, values, "values", n, "values' numel");
  check_exact(fn, codes, "codes", at::kByte);
  check_tensor(fn, codes, "codes", n, "values' numel");
  check_exact(fn, absmax, "absmax", at::kFloat);
  check_tensor(fn, absmax, "absmax", adam8::num_blocks(n), "ceil(numel / 256) blocks");
  check_no_overlap(fn, {bytes_of(values, "values", false), bytes_of(codes, "codes", true),
                        bytes_of(absmax, "absmax", true)});
  {
    py::gil_scoped_release nogil;
    adam8::quantize(values.data_ptr<float>(), n, is_signed, codes.data_ptr<uint8_t>(), absmax.data_ptr<float>());
  }
  bump(codes);
  bump(absmax);
}

void dequantize_py(at::Tensor codes, at::Tensor absmax, at::Tensor values, bool is_signed) {
  constexpr const char* fn = "adam8bit_dequantize_";
  check_exact(fn, codes, "codes", at::kByte);
  const int64_t n = codes.numel();
  check_tensor(fn, codes, "codes", n, "codes' numel");
  check_exact(fn, absmax, "absmax", at::kFloat);
  check_tensor(fn, absmax, "absmax", adam8::num_blocks(n), "ceil(numel / 256) blocks");
  check_exact(fn, values, "values", at::kFloat);
  check_tensor(fn, values, "values", n, "codes' numel");
  check_no_overlap(fn, {bytes_of(codes, "codes", false), bytes_of(absmax, "absmax", false),
                        bytes_of(values, "values", true)});
  {
    py::gil_scoped_release nogil;
    adam8::dequantize(codes.data_ptr<uint8_t>(), absmax.data_ptr<float>(), n, is_signed, values.data_ptr<float>());
  }
  bump(values);
}

}  // namespace

void register_adam8bit(py::module_& m) {
  m.def("adamw8bit_step_", &adamw8bit_step_py, py::arg("master"), py::arg("grad"), py::arg("exp_avg_codes"),
        py::arg("exp_avg_absmax"), py::arg("exp_avg_sq_codes"), py::arg("exp_avg_sq_absmax"), py::kw_only(),
        py::arg("lo"), py::arg("hi"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("step"), py::arg("grad_scale") = 1.0, py::arg("out") = py::none(),
        "AdamW step with 8-bit block-quantized moments on elements [lo, hi). See offload.ops.adam8bit.");
  m.def("adam8bit_quantize_", &quantize_py, py::arg("values"), py::arg("codes"), py::arg("absmax"),
        py::arg("signed"), "Block-quantize fp32 values into codes/absmax (AdamW8bit format), active ISA");
  m.def("adam8bit_dequantize_", &dequantize_py, py::arg("codes"), py::arg("absmax"), py::arg("values"),
        py::arg("signed"), "Dequantize codes/absmax into fp32 values (AdamW8bit format), active ISA");
  m.def(
      "adam8bit_codebook",
      [](bool is_signed) {
        const auto& cb = adam8::codebook(is_signed);
        return torch::from_blob(const_cast<float*>(cb.levels), {256}, torch::kFloat).clone();
      },
      py::arg("signed"), "The 256 fp32 levels (ascending) of the signed or unsigned AdamW8bit codebook");
}

}  // namespace offload
