#include <pybind11/pybind11.h>

#include "bindings.h"
#include "kvcache/memory_backend.h"
#include "kvcache/types.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "kvcache native core: VSWA block pools, sliding windows and memory backends";
  kvcache::py::BindErrors(m);  // first: the exception hierarchy
  m.attr("NULL_BLOCK") = kvcache::kNullBlock;
  m.attr("OFFSET_SENTINEL") = kvcache::kOffsetSentinel;
  m.attr("DEFAULT_PRIORITY") = kvcache::kDefaultPriority;
  m.def("cuda_compiled", &kvcache::CudaCompiled, "True if the CUDA backend was compiled in.");
  m.def("cuda_available", &kvcache::CudaAvailable,
        "True if the CUDA backend was compiled in and a CUDA device is usable now.");
  m.def("cuda_mem_get_info", &kvcache::CudaMemGetInfo,
        "(free, total) bytes of the current CUDA device; raises CudaError without one.");
  kvcache::py::BindManager(m);
  kvcache::py::BindEstimates(m);
}
