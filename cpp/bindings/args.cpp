// Argument conversion (see args.h).
#include "args.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <climits>
#include <string>
#include <type_traits>

#include "kvcache/errors.h"

namespace kvcache::py {
namespace {

/// Converts a 1-D integer ndarray or a sequence of ints to int64 values.
std::vector<std::int64_t> ToInt64Vector(const pybind11::handle& obj, const char* what) {
  std::vector<std::int64_t> out;
  if (pybind11::isinstance<pybind11::array>(obj)) {
    auto arr = pybind11::reinterpret_borrow<pybind11::array>(obj);
    if (arr.ndim() != 1) ThrowInvalid(what, " must be 1-D, got ", arr.ndim(), " dimensions");
    const char kind = arr.dtype().kind();
    if (kind != 'i' && kind != 'u') ThrowInvalid(what, " must hold integers, got dtype kind '", kind, "'");
    auto ints = pybind11::array_t<std::int64_t, pybind11::array::c_style | pybind11::array::forcecast>::ensure(arr);
    if (kind == 'u' && arr.itemsize() == 8) {
      auto u = pybind11::array_t<std::uint64_t, pybind11::array::c_style>::ensure(arr);
      for (pybind11::ssize_t i = 0; i < u.size(); ++i) {
        if (u.data()[i] > static_cast<std::uint64_t>(INT64_MAX)) {
          ThrowInvalid(what, "[", i, "] = ", u.data()[i], " is out of range (signed 64-bit)");
        }
      }
    }
    out.assign(ints.data(), ints.data() + ints.size());
    return out;
  }
  if (pybind11::isinstance<pybind11::str>(obj) || pybind11::isinstance<pybind11::bytes>(obj) ||
      !pybind11::isinstance<pybind11::sequence>(obj)) {
    ThrowInvalid(what, " must be a sequence of ints or a 1-D integer array");
  }
  auto seq = pybind11::reinterpret_borrow<pybind11::sequence>(obj);
  out.reserve(seq.size());
  for (pybind11::handle item : seq) {
    if (!PyLong_Check(item.ptr()) || PyBool_Check(item.ptr())) {
      ThrowInvalid(what, " must hold ints, got ", Py_TYPE(item.ptr())->tp_name);
    }
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(item.ptr(), &overflow);
    if (overflow != 0) {
      ThrowInvalid(what, "[", out.size(), "] = ", pybind11::str(item).cast<std::string>(),
                   " is out of range (signed 64-bit)");
    }
    out.push_back(v);
  }
  return out;
}

/// Reads an exact int of one digit (every token id and request id in practice) without the
/// general conversion; false: the caller uses PyLong_AsLongLongAndOverflow.
bool ReadOneDigitInt(PyObject* item, long long* v) {
#if PY_VERSION_HEX >= 0x030C0000
  auto* l = reinterpret_cast<PyLongObject*>(item);
  if (!PyUnstable_Long_IsCompact(l)) return false;
  *v = static_cast<long long>(PyUnstable_Long_CompactValue(l));
  return true;
#elif PY_VERSION_HEX >= 0x030B0000
  const Py_ssize_t size = Py_SIZE(item);
  if (size < -1 || size > 1) return false;
  *v = size == 0 ? 0 : size * static_cast<long long>(reinterpret_cast<PyLongObject*>(item)->ob_digit[0]);
  return true;
#else
  static_cast<void>(item);
  static_cast<void>(v);
  return false;
#endif
}

/// The fast path of the conversions below: a list or tuple (exactly) whose items are all
/// exact ints in [lo, hi] fills *out in one pass over the items (no iterator, no temporary
/// vector) and returns true. Anything else returns false (*out then holds garbage) and the
/// caller converts again the general way, which raises the error naming the bad item. Reads
/// only: converting an exact int runs no Python code, so the list cannot change meanwhile.
template <typename T>
[[gnu::always_inline]] inline bool IntsFromListOrTuple(PyObject* obj, long long lo, long long hi, std::vector<T>* out) {
  if (!PyList_CheckExact(obj) && !PyTuple_CheckExact(obj)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
  PyObject** items = PySequence_Fast_ITEMS(obj);
  out->resize(static_cast<std::size_t>(n));
  T* dst = out->data();
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    if (!PyLong_CheckExact(item)) return false;  // bool, int subclasses, numpy ints: general path
    long long v = 0;
    if (!ReadOneDigitInt(item, &v)) {
      int overflow = 0;
      v = PyLong_AsLongLongAndOverflow(item, &overflow);
      if (overflow != 0) return false;
    }
    if (v < lo || v > hi) return false;
    dst[i] = static_cast<T>(v);
  }
  return true;
}

template <typename T>
void CopyTokenValues(const T* data, std::size_t n, const char* what, std::vector<TokenId>* out) {
  // One branch-free pass finds whether any value is out of range (the common case: none, and
  // the loop vectorizes), then a plain copy; only a bad value takes the loop naming it.
  // OR of every value: a negative one sets the sign bit, one above INT32_MAX a bit >= 31.
  using U = std::make_unsigned_t<T>;
  U any = 0;
  for (std::size_t i = 0; i < n; ++i) any |= static_cast<U>(data[i]);
  const bool bad = (any >> 31) != 0;
  if (bad) {
    for (std::size_t i = 0; i < n; ++i) {
      const T v = data[i];
      if (v < 0) ThrowInvalid(what, "[", i, "] is negative (", static_cast<std::int64_t>(v), ")");
      if (static_cast<std::uint64_t>(v) > static_cast<std::uint64_t>(INT32_MAX)) {
        ThrowInvalid(what, "[", i, "] = ", static_cast<std::uint64_t>(v), " does not fit a 32-bit token id");
      }
    }
  }
  out->assign(data, data + n);  // no zero fill first
}

}  // namespace

std::map<WindowSize, std::int32_t> ToBlocksNeeded(const pybind11::handle& blocks) {
  if (!PyDict_Check(blocks.ptr())) {
    ThrowInvalid("blocks must be a dict {window: blocks}, got ", Py_TYPE(blocks.ptr())->tp_name);
  }
  std::map<WindowSize, std::int32_t> need;
  for (const auto& [w, n] : blocks.cast<BlocksNeeded>()) need[w] = n;
  return need;
}

std::vector<BlockId> ToBlockIds(const pybind11::handle& obj) {
  const std::vector<std::int64_t> ids = ToInt64Vector(obj, kBlockIds);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] > INT32_MAX) {
      ThrowInvalid(kBlockIds, "[", i, "] = ", ids[i], " is out of range [0, ", INT32_MAX, "]");
    }
  }
  return {ids.begin(), ids.end()};
}

std::map<WindowSize, std::vector<BlockId>> ToPinnedBlocks(const pybind11::handle& obj) {
  std::map<WindowSize, std::vector<BlockId>> out;
  for (const auto& [key, ids] : pybind11::reinterpret_borrow<pybind11::dict>(obj)) {
    const WindowSize w = ReadInt<WindowSize>(key, kWindowSize, 1, INT32_MAX);
    if (PyUnicode_Check(ids.ptr()) || PyBytes_Check(ids.ptr()) || PyDict_Check(ids.ptr()) ||
        (!PySequence_Check(ids.ptr()) && !pybind11::isinstance<pybind11::array>(ids))) {
      ThrowInvalid("block_ids[", w, "] must be a list of block ids, got ", Py_TYPE(ids.ptr())->tp_name);
    }
    out[w] = ToBlockIds(ids);
  }
  return out;
}

void ToRequestIds(const pybind11::handle& obj, const char* what, std::vector<SeqId>* ids) {
  if (IntsFromListOrTuple(obj.ptr(), 0, INT64_MAX, ids)) return;
  if (pybind11::isinstance<pybind11::array>(obj)) {
    // A contiguous int64 array is read in place; with a negative id it takes the general path,
    // which names it.
    auto arr = pybind11::reinterpret_borrow<pybind11::array>(obj);
    if (arr.ndim() == 1 && (arr.flags() & pybind11::array::c_style) != 0 &&
        arr.dtype().is(pybind11::dtype::of<std::int64_t>())) {
      const auto* data = static_cast<const std::int64_t*>(arr.data());
      const auto n = static_cast<std::size_t>(arr.size());
      bool negative = false;
      for (std::size_t i = 0; i < n; ++i) negative |= data[i] < 0;
      if (!negative) {
        ids->assign(data, data + n);
        return;
      }
    }
  }
  *ids = ToInt64Vector(obj, what);
  for (std::size_t i = 0; i < ids->size(); ++i) {
    if ((*ids)[i] < 0) ThrowInvalid(what, "[", i, "] = ", (*ids)[i], " is out of range [0, ", INT64_MAX, "]");
  }
}

std::vector<SeqId> ToRequestIds(const pybind11::handle& obj, const char* what) {
  std::vector<SeqId> ids;
  ToRequestIds(obj, what, &ids);
  return ids;
}

void ToChunkSizes(const pybind11::handle& obj, const char* what, std::vector<std::int32_t>* out) {
  if (IntsFromListOrTuple(obj.ptr(), 1, INT32_MAX, out)) return;
  const std::vector<std::int64_t> raw = ToInt64Vector(obj, what);
  out->clear();
  for (std::size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] < 1 || raw[i] > INT32_MAX) {
      ThrowInvalid(what, "[", i, "] = ", raw[i], " is out of range [1, ", INT32_MAX, "]");
    }
    out->push_back(static_cast<std::int32_t>(raw[i]));
  }
}

bool IsBatchArg(PyObject* obj) {
  if (PyLong_Check(obj)) return false;
  if (PyList_Check(obj) || PyTuple_Check(obj)) return true;
  if (pybind11::isinstance<pybind11::array>(obj)) return pybind11::reinterpret_borrow<pybind11::array>(obj).ndim() > 0;
  // A str or bytes is neither: the int reader rejects it with a TypeError.
  return PySequence_Check(obj) && !PyIndex_Check(obj) && !PyUnicode_Check(obj) && !PyBytes_Check(obj);
}

void ToTokens(const pybind11::handle& obj, const char* what, std::vector<TokenId>* out) {
  if (IntsFromListOrTuple(obj.ptr(), 0, INT32_MAX, out)) return;
  if (pybind11::isinstance<pybind11::array>(obj)) {
    auto arr = pybind11::reinterpret_borrow<pybind11::array>(obj);
    const bool contiguous = (arr.flags() & pybind11::array::c_style) != 0 && arr.ndim() == 1;
    if (contiguous && arr.dtype().is(pybind11::dtype::of<std::int32_t>())) {
      CopyTokenValues(static_cast<const std::int32_t*>(arr.data()), static_cast<std::size_t>(arr.size()), what, out);
      return;
    }
    if (contiguous && arr.dtype().is(pybind11::dtype::of<std::int64_t>())) {
      CopyTokenValues(static_cast<const std::int64_t*>(arr.data()), static_cast<std::size_t>(arr.size()), what, out);
      return;
    }
  }
  const std::vector<std::int64_t> raw = ToInt64Vector(obj, what);
  CopyTokenValues(raw.data(), raw.size(), what, out);
}

std::vector<TokenId> ToTokens(const pybind11::handle& obj, const char* what) {
  std::vector<TokenId> out;
  ToTokens(obj, what, &out);
  return out;
}

WindowSize ResolveWindow(const KVCacheManager& self, const std::optional<WindowSize>& window) {
  if (window.has_value()) return *window;
  if (self.window_sizes().size() != 1) {
    ThrowInvalid("window_size is required: this manager has ", self.window_sizes().size(), " windows");
  }
  return self.window_sizes().front();
}

ReuseExtras MakeExtras(const std::optional<LoraTaskId>& lora_task_id, const std::optional<CacheSalt>& cache_salt,
                       const std::vector<MultimodalArg>& multimodal) {
  ReuseExtras extras;
  extras.lora_task_id = Unwrap(lora_task_id);
  extras.cache_salt = Unwrap(cache_salt);
  for (const auto& [hash, start, length] : multimodal) extras.multimodal.push_back(MultimodalItem{hash, start, length});
  return extras;
}

std::shared_ptr<const PreparedPrompt> AsPrepared(const pybind11::handle& tokens,
                                                 const std::optional<LoraTaskId>& lora_task_id,
                                                 const std::optional<CacheSalt>& cache_salt,
                                                 const std::vector<MultimodalArg>& multimodal) {
  // One type lookup (the caster's), not two (isinstance, then cast); subclasses load too.
  pybind11::detail::make_caster<std::shared_ptr<PreparedPrompt>> caster;
  if (!caster.load(tokens, /*convert=*/false)) return nullptr;
  if (lora_task_id.has_value() || cache_salt.has_value() || !multimodal.empty()) {
    ThrowInvalid("lora_task_id, cache_salt and multimodal come from the prepared prompt: pass them to prepare()");
  }
  return pybind11::detail::cast_op<std::shared_ptr<PreparedPrompt>>(caster);
}

std::string NumpyDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "uint16";  // numpy has no bfloat16: the raw bits
    case DType::kFp8:
      return "uint8";
    case DType::kInt8:
      return "int8";
  }
  return "uint8";
}

std::string ArrayTypeStr(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "<f4";
    case DType::kFloat16:
      return "<f2";
    case DType::kBFloat16:
      return "<u2";  // raw bfloat16 bits: the interface has no bfloat16 type string
    case DType::kFp8:
      return "|u1";
    case DType::kInt8:
      return "|i1";
  }
  return "|u1";
}

}  // namespace kvcache::py
