// Declarations shared by the binding translation units. No logic lives in the bindings beyond
// argument conversion, GIL handling and exception translation.
#pragma once

#include <pybind11/pybind11.h>

namespace kvcache::py {
void BindErrors(pybind11::module_& m);
void BindManager(pybind11::module_& m);
/// The per-step methods of the KVCacheManager class (bind_step.cpp), added to `manager_class`.
void BindStepMethods(pybind11::handle manager_class);
/// The scheduler estimates on KVCacheManager (after BindManager) and the block_math submodule.
void BindEstimates(pybind11::module_& m);
}  // namespace kvcache::py
