// Python face of the aio engine (wrapped by offload/store/aio.py). Buffers cross as raw addresses:
// the Python handle keeps the tensors alive until the batch is done, so no torch header is needed.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>

#include "aio/aio_engine.h"
#include "common/registry.h"

namespace py = pybind11;

namespace offload {

void register_aio(py::module_& m) {
  using aio::Batch;
  using aio::Engine;

  py::class_<Batch, std::shared_ptr<Batch>>(m, "AioBatch", "Completion state of one aio submit")
      .def("done", &Batch::done)
      .def("failed", &Batch::failed)
      .def("abandoned", &Batch::abandoned, "True when the kernel may still own a buffer: never free them")
      .def("bytes", &Batch::bytes)
      .def(
          "wait", [](Batch& b, double timeout_s) { return b.wait(timeout_s); }, py::arg("timeout_s") = -1.0,
          py::call_guard<py::gil_scoped_release>(), "Block (GIL released) until done; False on timeout")
      .def(
          "error",
          [](const Batch& b) {
            aio::IoError e = b.error();
            return py::make_tuple(e.err, e.write, e.path, e.req_offset, e.req_len, e.piece_offset, e.piece_len,
                                  e.detail);
          },
          "(errno, write, path, req_offset, req_len, piece_offset, piece_len, detail) of the first failure");

  using ReqTuple = std::tuple<int, bool, std::string, uint64_t, uintptr_t, uint64_t>;
  py::class_<Engine>(m, "AioEngineCore", "Async file I/O engine (io_uring or pread/pwrite threads)")
      .def(py::init<const std::string&, uint64_t, int, int>(), py::arg("backend"), py::arg("block_size"),
           py::arg("queue_depth"), py::arg("workers"), py::call_guard<py::gil_scoped_release>())
      .def(
          "submit",
          [](Engine& e, const std::vector<ReqTuple>& reqs) {
            std::vector<aio::Request> rs;
            rs.reserve(reqs.size());
            for (const auto& t : reqs) {
              aio::Request r;
              r.fd = std::get<0>(t);
              r.write = std::get<1>(t);
              r.path = std::get<2>(t);
              r.offset = std::get<3>(t);
              r.buf = reinterpret_cast<char*>(std::get<4>(t));
              r.len = std::get<5>(t);
              rs.push_back(std::move(r));
            }
            py::gil_scoped_release nogil;  // queueing takes the engine lock; workers never need the GIL
            return e.submit(std::move(rs));
          },
          py::arg("requests"), "requests: [(fd, is_write, path, offset, buffer_address, nbytes), ...]")
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("closed", &Engine::closed)
      .def_property_readonly("backend", &Engine::backend_name)
      .def_property_readonly("fallback_reason", &Engine::fallback_reason)
      .def_property_readonly("block_size", &Engine::block_size)
      .def_property_readonly("queue_depth", &Engine::queue_depth)
      .def_property_readonly("num_threads", &Engine::num_threads);

  m.def(
      "aio_backends",
      [] {
        std::string why;
        std::vector<std::string> ok = aio::backends_available(why);
        py::dict d;
        d["threads"] = "usable";
        bool uring = ok.size() > 1;
        d["io_uring"] = uring ? std::string("usable") : why;
        return d;
      },
      "Which aio backends this build has and whether this kernel lets them run");
  m.def("aio_dio_alignment", &aio::dio_alignment, py::arg("fd"),
        "O_DIRECT alignment (bytes) for buffer address, offset and length of an open file");
}

}  // namespace offload
