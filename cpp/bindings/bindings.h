// Declarations shared by the binding translation units. No logic lives in the bindings beyond
// argument conversion, GIL handling and exception translation.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace kvcache::py {
void BindErrors(pybind11::module_& m);
void BindManager(pybind11::module_& m);
/// The per-step methods of the KVCacheManager class (bind_step.cpp), added to `manager_class`.
void BindStepMethods(pybind11::handle manager_class);
/// The scheduler estimates on KVCacheManager (after BindManager) and the block_math submodule.
void BindEstimates(pybind11::module_& m);
/// The recurrent-state methods of KVCacheManager (bind_state.cpp; after BindManager).
void BindState(pybind11::module_& m);
}  // namespace kvcache::py

namespace kvcache {
struct ModelSpec;
struct ManagerConfig;
struct KvCacheStats;
}  // namespace kvcache

namespace kvcache::py {
/// The constructor's recurrent_layers, state_slots and checkpoint_policy arguments.
void ParseStateArgs(const pybind11::handle& recurrent_layers, std::int64_t state_slots,
                    std::int64_t state_secondary_slots, const pybind11::handle& checkpoint_policy, ModelSpec* model,
                    ManagerConfig* config);
/// The state counters of a stats dict.
void AddStateStats(const KvCacheStats& s, pybind11::dict* d);
}  // namespace kvcache::py
