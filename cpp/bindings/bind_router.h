// The router index (kvcache.router's native half): bind_router.cpp.
#pragma once

#include <pybind11/pybind11.h>

namespace kvcache::py {
/// The RouterIndex class of kvcache._core (kvcache.router.KvIndexer's table and lookups).
void BindRouter(pybind11::module_& m);
}  // namespace kvcache::py
