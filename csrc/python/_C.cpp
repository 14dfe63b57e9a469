// fastmha._C: what Python needs beyond torch.ops. Importing it loads libfastmha (which registers the ops);
// the ops themselves are always called through torch.ops, never through pybind11.
#include <pybind11/pybind11.h>

#include <fastmha/build_info.h>
#include <fastmha/cpu_buffers.h>

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastmha native library loader and build information";
  m.def("build_info", [] {
    const auto info = fastmha::build_info();
    py::dict d;
    d["version"] = info.version;
    d["torch_version"] = info.torch_version;
    d["cuda_kernels"] = info.cuda_kernels;
    d["cuda_version"] = info.cuda_kernels ? py::object(py::str(info.cuda_version)) : py::object(py::none());
    d["cuda_archs"] = info.cuda_archs;
    return d;
  });
  m.def("cpu_capability", &fastmha::cpu_capability, "CPU kernel variant in use: avx512, avx2 or default");
  m.def("cpu_native_products", &fastmha::cpu_native_products,
        "Whether this CPU multiplies 'bfloat16' or 'float16' natively");
  m.def("cpu_widens_products", &fastmha::cpu_widens_products, py::arg("dtype"), py::arg("rows"),
        "Whether the block's 'bfloat16' or 'float16' projections of `rows` rows on this CPU are fp32 products "
        "rounded once");
  m.def("release_cpu_buffers", &fastmha::release_cpu_buffers, "Frees the large CPU buffers kept for reuse");
  m.def("cached_cpu_buffer_bytes", &fastmha::cached_cpu_buffer_bytes, "Bytes held in CPU buffers kept for reuse");
}
