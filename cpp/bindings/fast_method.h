// Methods on CPython's vectorcall protocol, for the calls an engine makes per request per step.
//
// pybind11's dispatcher costs about 900 instructions a call on top of CPython's own (argument
// vectors on the heap, overload resolution, a caster object per argument), and releasing and
// retaking the GIL about 450 more: together more than the bookkeeping of `prefill`,
// `store_context_blocks` or `num_tokens` itself. The per-step methods are therefore plain
// METH_FASTCALL | METH_KEYWORDS functions added to the pybind11 class:
// - arguments by position or keyword as in Python (`FastParams`), TypeError as Python words it
//   for a missing, unexpected or repeated argument, and every value converted by the same
//   functions as the pybind11 methods (ReadInt, ToTokens, ...), so errors read the same;
// - `self` read as the KVCacheManager type caster (init_guard.h) reads it, so a method of an
//   instance whose __init__ never ran raises the same error instead of running on garbage;
// - C++ exceptions through pybind11's registered translators, as for every other method;
// - the GIL released only around work that can copy KV bytes (`KVCacheManager::MayCopyBlocks`):
//   bookkeeping alone is shorter than the release. The core never calls Python, so a thread
//   that waits for the manager's mutex while holding the GIL cannot deadlock with the thread
//   that holds the mutex (which takes the GIL only after releasing the mutex).
// The docstring's first line is the typed signature in pybind11's format, which help() shows and
// pybind11-stubgen reads for the stub. Uses two pybind11 internals that have been stable since
// 2.13 (the build requires it; CI pins 3.1): `detail::instance`'s simple layout and
// `detail::try_translate_exceptions`, which the dispatcher itself calls.
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <cstddef>
#include <stdexcept>
#include <string>

#include "init_guard.h"  // first: the KVCacheManager type caster
#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"

namespace kvcache::py {

/// The parameters of a fast method after self: names in order; the first `positional` may be
/// passed by position (the rest only by keyword), the first `required` must be passed.
template <std::size_t N>
struct FastParams {
  const char* method;
  std::array<const char*, N> names;
  std::size_t positional;
  std::size_t required;
};

/// The arguments of one vectorcall by parameter index, nullptr where not passed (borrowed).
template <std::size_t N>
std::array<PyObject*, N> ParseArgs(const FastParams<N>& params, PyObject* const* args, Py_ssize_t nargsf,
                                   PyObject* kwnames) {
  std::array<PyObject*, N> out{};
  const auto nargs = static_cast<std::size_t>(PyVectorcall_NARGS(nargsf));
  if (nargs > params.positional) {
    throw pybind11::type_error(detail::Concat(params.method, "() takes ", params.positional,
                                              " positional argument", params.positional == 1 ? "" : "s", " but ",
                                              nargs, nargs == 1 ? " was" : " were", " given"));
  }
  for (std::size_t i = 0; i < nargs; ++i) out[i] = args[i];
  const Py_ssize_t num_kw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t k = 0; k < num_kw; ++k) {
    PyObject* key = PyTuple_GET_ITEM(kwnames, k);
    std::size_t i = 0;
    while (i < N && PyUnicode_CompareWithASCIIString(key, params.names[i]) != 0) ++i;
    if (i == N) {
      throw pybind11::type_error(detail::Concat(params.method, "() got an unexpected keyword argument '",
                                                pybind11::str(key).cast<std::string>(), "'"));
    }
    if (out[i] != nullptr) {
      throw pybind11::type_error(
          detail::Concat(params.method, "() got multiple values for argument '", params.names[i], "'"));
    }
    out[i] = args[nargs + static_cast<std::size_t>(k)];
  }
  for (std::size_t i = 0; i < params.required; ++i) {
    if (out[i] == nullptr) {
      throw pybind11::type_error(
          detail::Concat(params.method, "() missing required argument '", params.names[i], "'"));
    }
  }
  return out;
}

/// A bool argument: True or False (or a numpy bool); anything else raises ValueError naming it.
inline bool ReadBool(PyObject* obj, const char* name) {
  if (obj == Py_True) return true;
  if (obj == Py_False) return false;
  const std::string type = Py_TYPE(obj)->tp_name;
  if (type == "numpy.bool" || type == "numpy.bool_") return PyObject_IsTrue(obj) == 1;
  ThrowInvalid(name, " must be a bool, got ", type);
}

/// The manager behind `self` (the method descriptor has checked its type already).
inline KVCacheManager& SelfOf(PyObject* self) {
  // An instance of one pybind11 class (Python subclasses included) has the simple layout: the
  // value pointer in place, and a flag for whether __init__ constructed it. Reading them is what
  // the type caster does after a type lookup that costs more than the rest of a short call.
  const auto* inst = reinterpret_cast<const pybind11::detail::instance*>(self);
  if (inst->simple_layout) {
    if (!inst->simple_holder_constructed) {
      throw std::runtime_error(kNotInitialized);
    }
    return *static_cast<KVCacheManager*>(inst->simple_value_holder[0]);
  }
  pybind11::detail::make_caster<KVCacheManager> caster;
  if (!caster.load(self, /*convert=*/false)) throw pybind11::type_error("expected a KVCacheManager");
  return pybind11::detail::cast_op<KVCacheManager&>(caster);
}

/// The body of a fast method: the manager and the call's vectorcall arguments; returns a new
/// reference (or throws).
using FastBody = PyObject* (*)(KVCacheManager& self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames);

/// The CPython entry point of `Body`: C++ exceptions become Python ones.
template <FastBody Body>
PyObject* FastEntry(PyObject* self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) noexcept {
  try {
    return Body(SelfOf(self), args, nargsf, kwnames);
  } catch (...) {
    pybind11::detail::try_translate_exceptions();
    return nullptr;
  }
}

/// A method definition for `Body`; `doc` starts with the typed signature (see the file comment).
template <FastBody Body>
constexpr PyMethodDef FastMethod(const char* name, const char* doc) {
  return PyMethodDef{name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&FastEntry<Body>)),
                     METH_FASTCALL | METH_KEYWORDS, doc};
}

/// Runs `fn` without the GIL when `release`, else holding it.
template <typename Fn>
auto WithoutGilIf(bool release, Fn&& fn) {
  if (!release) return fn();
  pybind11::gil_scoped_release unlocked;
  return fn();
}

/// Adds the methods of `defs` (static storage, ended by a null entry) to `cls`.
inline void AddFastMethods(pybind11::handle cls, PyMethodDef* defs) {
  for (PyMethodDef* d = defs; d->ml_name != nullptr; ++d) {
    PyObject* descr = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), d);
    if (descr == nullptr) throw pybind11::error_already_set();
    cls.attr(d->ml_name) = pybind11::reinterpret_steal<pybind11::object>(descr);
  }
}

}  // namespace kvcache::py
