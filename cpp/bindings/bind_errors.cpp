#include <pybind11/pybind11.h>

#include "bindings.h"
#include "kvcache/errors.h"



namespace kvcache::py {

void BindErrors(pybind11::module_& m) {
  // Base classes first: pybind11 tries the translators registered last first.
  auto base = pybind11::register_exception<KVCacheError>(m, "KVCacheError", PyExc_RuntimeError);
  pybind11::register_exception<InternalError>(m, "InternalError", base.ptr());
  pybind11::register_exception<OutOfBlocksError>(m, "OutOfBlocksError", base.ptr());
  auto cuda = pybind11::register_exception<CudaError>(m, "CudaError", base.ptr());
  pybind11::register_exception<DeviceOOMError>(m, "DeviceOOMError", cuda.ptr());
  pybind11::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const UnknownSequenceError& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    }
  });
}

}  // namespace kvcache::py
