// A bound native object is initialized exactly once, and no method runs before that.
//
// pybind11 (3.1) leaves two gaps here:
// 1. A method called on an instance whose __init__ never ran, e.g.
//    `KVCacheManager.__new__(KVCacheManager).add_token(1, 1)` or `LayerBuffer.__new__(LayerBuffer)
//    .__dlpack__()`, gets freshly allocated but never constructed memory as `self`
//    (type_caster_generic::load_value allocates a missing value lazily), so it runs on garbage: it
//    hangs on a garbage mutex, reports a garbage shape or pointer, or crashes the process.
// 2. A second __init__ on a live instance is ignored: the dispatcher returns None at once when
//    the instance is already registered, and a Python subclass then goes on to change its own
//    attributes for an object that did not change.
// The type casters below close gap 1 for every method, property and cast of each bound class
// (KVCacheManager, CapacityScheduler, PreparedPrompt, and LayerBuffer in bind_manager.cpp);
// RejectSecondInit closes gap 2. args.h includes this header first, so every binding translation
// unit sees the casters before its first use of a class (a type_caster specialization must be
// seen before its first use, in every translation unit).
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "kvcache/capacity_scheduler.h"
#include "kvcache/kv_cache_manager.h"
#include "kvcache/prepared_prompt.h"

namespace kvcache::py {
inline constexpr char kNotInitialized[] = "KVCacheManager is not initialized: its __init__ never ran";
inline constexpr char kSchedulerNotInitialized[] =
    "CapacityScheduler is not initialized: its __init__ never ran";
inline constexpr char kPromptNotInitialized[] =
    "PreparedPrompt is not initialized: it was made with __new__; get one from KVCacheManager.prepare()";
}  // namespace kvcache::py

namespace pybind11::detail {

/// The caster of a bound class T whose instances may lack a constructed value: refuses such an
/// instance (RuntimeError `Message`) before the base class would allocate an unconstructed value
/// for it.
template <typename T, const char* Message>
class GuardedCaster : public type_caster_base<T> {
 public:
  bool load(handle src, bool convert) { return this->template load_impl<GuardedCaster>(src, convert); }

  /// Called by load_impl with the instance's value slot.
  void load_value(value_and_holder&& v_h) {
    if (!v_h.holder_constructed()) throw std::runtime_error(Message);
    type_caster_base<T>::load_value(std::move(v_h));
  }
};

/// The same for a std::shared_ptr<T> parameter of a class held by std::shared_ptr: pybind11's own
/// caster raises "Unable to cast from non-held to held instance", which names nothing.
template <typename T, const char* Message>
class GuardedSharedCaster : public copyable_holder_caster<T, std::shared_ptr<T>> {
  using Base = copyable_holder_caster<T, std::shared_ptr<T>>;

 public:
  bool load(handle src, bool convert) { return this->template load_impl<GuardedSharedCaster>(src, convert); }

  void load_value(value_and_holder&& v_h) {
    if (!v_h.holder_constructed()) throw std::runtime_error(Message);
    Base::load_value(std::move(v_h));
  }
};

template <>
class type_caster<kvcache::KVCacheManager>
    : public GuardedCaster<kvcache::KVCacheManager, kvcache::py::kNotInitialized> {};
template <>
class type_caster<kvcache::CapacityScheduler>
    : public GuardedCaster<kvcache::CapacityScheduler, kvcache::py::kSchedulerNotInitialized> {};
template <>
class type_caster<kvcache::PreparedPrompt>
    : public GuardedCaster<kvcache::PreparedPrompt, kvcache::py::kPromptNotInitialized> {};
template <>
class type_caster<std::shared_ptr<kvcache::PreparedPrompt>>
    : public GuardedSharedCaster<kvcache::PreparedPrompt, kvcache::py::kPromptNotInitialized> {};

}  // namespace pybind11::detail

namespace kvcache::py {

/// Wraps the bound __init__ of `cls` so that calling it on an initialized instance raises
/// RuntimeError. The wrapper keeps the original docstring, whose first line is the typed
/// signature, so help() and the generated stub still show it.
template <typename Class>
void RejectSecondInit(pybind11::class_<Class>& cls) {
  pybind11::object init = cls.attr("__init__");
  const std::string doc = pybind11::str(init.attr("__doc__"));
  const std::string type_name = pybind11::str(cls.attr("__name__"));
  pybind11::options options;
  options.disable_function_signatures();  // the doc already starts with the signature
  // Named "_init_once", not "__init__": pybind11 would treat a function named __init__ as a
  // constructor and skip it on an initialized instance just the same.
  cls.attr("__init__") = pybind11::cpp_function(
      [init, cls_obj = pybind11::object(cls), type_name](pybind11::handle self, const pybind11::args& args,
                                                         const pybind11::kwargs& kwargs) {
        if (!pybind11::isinstance(self, cls_obj)) {
          throw pybind11::type_error(type_name + ".__init__ needs a " + type_name + " instance");
        }
        if (pybind11::detail::is_holder_constructed(self.ptr())) {
          throw std::runtime_error(type_name + " is already initialized: create a new one instead of "
                                   "calling __init__ again");
        }
        init(self, *args, **kwargs);
      },
      pybind11::name("_init_once"), pybind11::is_method(cls), pybind11::doc(doc.c_str()));
}

}  // namespace kvcache::py
