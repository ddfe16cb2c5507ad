// A native KVCacheManager is initialized exactly once, and no method runs before that.
//
// pybind11 (3.1) leaves two gaps here:
// 1. A method called on an instance whose __init__ never ran, e.g.
//    `KVCacheManager.__new__(KVCacheManager).add_token(1, 1)`, gets freshly allocated but never
//    constructed memory as `self` (type_caster_generic::load_value allocates a missing value
//    lazily), so it runs on garbage: it hangs on a garbage mutex or crashes the process.
// 2. A second __init__ on a live instance is ignored: the dispatcher returns None at once when
//    the instance is already registered, and a Python subclass then goes on to change its own
//    attributes for a manager that did not change.
// The type caster below closes gap 1 for every method, property and cast of KVCacheManager;
// RejectSecondInit closes gap 2. Include this header before any binding code that uses the class
// (a type_caster specialization must be seen before its first use).
#pragma once

#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <utility>

#include "kvcache/kv_cache_manager.h"

namespace kvcache::py {
inline constexpr char kNotInitialized[] = "KVCacheManager is not initialized: its __init__ never ran";
}  // namespace kvcache::py

namespace pybind11::detail {

template <>
class type_caster<kvcache::KVCacheManager> : public type_caster_base<kvcache::KVCacheManager> {
 public:
  bool load(handle src, bool convert) { return load_impl<type_caster>(src, convert); }

  /// Called by load_impl with the instance's value slot: refuses an instance whose holder was
  /// never constructed before the base class would allocate an unconstructed value for it.
  void load_value(value_and_holder&& v_h) {
    if (!v_h.holder_constructed()) {
      throw std::runtime_error(kvcache::py::kNotInitialized);
    }
    type_caster_base<kvcache::KVCacheManager>::load_value(std::move(v_h));
  }
};

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
