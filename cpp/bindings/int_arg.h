// Integer arguments with a named range check.
//
// pybind11 reports an integer that does not fit the C++ parameter type as a TypeError listing
// the whole signature ("incompatible function arguments"). A parameter declared as
// `Int<T, kName, lo, hi>` instead raises ValueError naming the argument, for example
// "request_id = -1 is out of range [0, 9223372036854775807]". The check costs what pybind11's
// own conversion costs, so it is fine on the per-step calls.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "kvcache/errors.h"

namespace kvcache::py {

/// Whether `v` (a value that fit a long long) lies in [lo, hi].
template <typename T>
bool InRange(long long v, T lo, T hi) {
  if constexpr (std::is_signed_v<T>) {
    return v >= lo && v <= hi;
  } else {
    return v >= 0 && static_cast<unsigned long long>(v) >= lo && static_cast<unsigned long long>(v) <= hi;
  }
}

/// ReadInt's general path: bool, __index__ objects, values out of range and errors.
template <typename T>
[[gnu::noinline, gnu::cold]] T ReadIntSlow(pybind11::handle src, const char* name, T lo, T hi) {
  PyObject* obj = src.ptr();
  if (PyBool_Check(obj) || !PyIndex_Check(obj)) {
    ThrowInvalid(name, " must be an int, got ", Py_TYPE(obj)->tp_name);
  }
  pybind11::object index;
  if (!PyLong_Check(obj)) {
    index = pybind11::reinterpret_steal<pybind11::object>(PyNumber_Index(obj));
    if (!index) throw pybind11::error_already_set();
    obj = index.ptr();
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
  if (v == -1 && PyErr_Occurred() != nullptr) throw pybind11::error_already_set();
  if (overflow == 0 && InRange(v, lo, hi)) return static_cast<T>(v);
  if constexpr (std::is_unsigned_v<T>) {
    if (overflow > 0) {  // above INT64_MAX: only an unsigned 64-bit parameter can take it
      const unsigned long long u = PyLong_AsUnsignedLongLong(obj);
      if (PyErr_Occurred() == nullptr && u >= lo && u <= hi) return static_cast<T>(u);
      PyErr_Clear();
    }
  }
  ThrowInvalid(name, " = ", pybind11::str(obj).cast<std::string>(), " is out of range [", lo, ", ", hi, "]");
}

/// Reads a Python int (or an object with __index__, such as numpy.int64) as a T in [lo, hi].
/// Anything else raises ValueError naming the argument. bool is refused: Python counts it as an
/// int, but True is never a meaningful id, count or size.
template <typename T>
T ReadInt(pybind11::handle src, const char* name, T lo, T hi) {
  static_assert(std::is_integral_v<T> && sizeof(T) <= sizeof(long long), "64-bit at most");
  // The per-step calls pass plain ints: read those inline, everything else (bool, __index__
  // objects, out of range, errors) out of line.
  if (PyLong_CheckExact(src.ptr())) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(src.ptr(), &overflow);
    if (overflow == 0 && InRange(v, lo, hi)) return static_cast<T>(v);
  }
  return ReadIntSlow<T>(src, name, lo, hi);
}

/// An integer parameter in [Lo, Hi]; `Name` is the argument's name in error messages. Converts
/// implicitly to T. Only for functions without overloads: a bad value raises at once instead of
/// letting pybind11 try another overload.
template <typename T, const char* Name, T Lo = std::numeric_limits<T>::min(), T Hi = std::numeric_limits<T>::max()>
struct Int {
  T value = 0;
  operator T() const { return value; }  // NOLINT(google-explicit-constructor): used as a T
  /// Reads `src` as this parameter (the fast methods' conversion, see fast_method.h).
  static T Read(pybind11::handle src) { return ReadInt<T>(src, Name, Lo, Hi); }
};

}  // namespace kvcache::py

namespace pybind11::detail {

template <typename T, const char* Name, T Lo, T Hi>
struct type_caster<kvcache::py::Int<T, Name, Lo, Hi>> {
  using Value = kvcache::py::Int<T, Name, Lo, Hi>;
  // Parameters take what ReadInt takes: ints and __index__ objects.
  PYBIND11_TYPE_CASTER(Value, io_name("typing.SupportsIndex", "int"));

  bool load(handle src, bool /*convert*/) {
    value.value = kvcache::py::ReadInt<T>(src, Name, Lo, Hi);
    return true;
  }

  static handle cast(const Value& src, return_value_policy, handle) {
    return make_caster<T>::cast(src.value, return_value_policy::copy, handle());
  }
};

}  // namespace pybind11::detail
