// kvcache._core.RouterIndex: the router's native index (cpp/src/router_index.cpp). Argument
// conversion and GIL handling only; kvcache.router.KvIndexer checks the Python-side arguments
// and maps engine ids to slots.
#include "init_guard.h"  // first: the guarded type casters must precede every use

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "args.h"
#include "bind_router.h"
#include "kvcache/router_index.h"

namespace kvcache::py {
inline constexpr char kRouterNotInitialized[] = "RouterIndex is not initialized: its __init__ never ran";
}  // namespace kvcache::py

namespace pybind11::detail {
template <>
class type_caster<kvcache::RouterIndex>
    : public GuardedCaster<kvcache::RouterIndex, kvcache::py::kRouterNotInitialized> {};
}  // namespace pybind11::detail

namespace kvcache::py {
namespace {

namespace py = pybind11;

/// A hash object (an int or bytes) as the index keys it; false for anything else.
bool ToRouterHash(py::handle obj, RouterHash* out) {
  PyObject* o = obj.ptr();
  if (PyLong_Check(o)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow == 0) {
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      out->kind = v < 0 ? RouterHash::kNegative : RouterHash::kUnsigned;
      out->value = static_cast<std::uint64_t>(v);
      return true;
    }
    if (overflow > 0) {
      const unsigned long long u = PyLong_AsUnsignedLongLong(o);
      if (!(u == static_cast<unsigned long long>(-1) && PyErr_Occurred())) {
        out->kind = RouterHash::kUnsigned;
        out->value = u;
        return true;
      }
      PyErr_Clear();
    }
    out->kind = RouterHash::kOpaque;
    out->opaque = "i" + py::str(obj).cast<std::string>();
    return true;
  }
  if (PyBytes_Check(o)) {
    out->kind = RouterHash::kOpaque;
    out->opaque = "b";
    out->opaque.append(PyBytes_AS_STRING(o), static_cast<std::size_t>(PyBytes_GET_SIZE(o)));
    return true;
  }
  return false;
}

std::uint64_t ToU64(py::handle obj, const char* what) {
  const unsigned long long u = PyLong_AsUnsignedLongLong(obj.ptr());
  if (u == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    ThrowInvalid(what, " = ", py::str(obj).cast<std::string>(), " is out of range [0, 18446744073709551615]");
  }
  return u;
}

std::optional<std::string> OptStr(py::handle obj) {
  if (obj.is_none()) return std::nullopt;
  return obj.cast<std::string>();
}

/// The events KvIndexer checked already, as tuples (type, hashes, group_idx, medium,
/// block_size, kv_cache_spec_kind, window, lora_id, lora_name).
std::vector<RouterEvent> ToEvents(const py::list& events) {
  std::vector<RouterEvent> out(events.size());
  for (std::size_t k = 0; k < out.size(); ++k) {
    const py::tuple t = events[k].cast<py::tuple>();
    if (t.size() != 9) ThrowInvalid("event ", k, ": expected a 9-tuple");
    RouterEvent& e = out[k];
    const int type = t[0].cast<int>();
    if (type < 0 || type > 2) ThrowInvalid("event ", k, ": unknown type code ", type);
    e.type = static_cast<RouterEvent::Type>(type);
    if (e.type == RouterEvent::kCleared) continue;
    const py::sequence hashes = t[1].cast<py::sequence>();
    e.hashes.resize(hashes.size());
    for (std::size_t j = 0; j < e.hashes.size(); ++j) {
      if (!ToRouterHash(hashes[j], &e.hashes[j])) ThrowInvalid("event ", k, ": block_hashes must be ints or bytes");
    }
    e.group_idx = t[2].is_none() ? 0 : ToU64(t[2], "group_idx");
    e.medium = OptStr(t[3]);
    if (e.type != RouterEvent::kStored) continue;
    e.block_size = ToU64(t[4], "block_size");
    e.spec_kind = OptStr(t[5]);
    if (!t[6].is_none()) {
      const unsigned long long w = PyLong_AsUnsignedLongLong(t[6].ptr());
      e.sliding_window = (w == static_cast<unsigned long long>(-1) && PyErr_Occurred()) ? UINT64_MAX : w;
      PyErr_Clear();
    }
    if (!t[7].is_none()) {
      e.has_lora_id = true;
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(t[7].ptr(), &overflow);
      if (overflow == 0) {
        e.lora_id = v;
      } else {
        e.lora_id_unsigned = true;
        e.lora_id = static_cast<std::int64_t>(ToU64(t[7], "lora_id"));
      }
    }
    e.lora_name = OptStr(t[8]);
  }
  return out;
}

}  // namespace

void BindRouter(py::module_& m) {
  using R = RouterIndex;
  py::class_<R> cls(m, "RouterIndex",
                    "A router's index of every engine's cached blocks, fed by KV events (see kvcache.router.KvIndexer).");
  cls.def(py::init<bool>(), py::arg("shared_tier") = false)
      .def("add_engine", &R::AddEngine, "Registers an engine; returns its slot.")
      .def("set_shared_tier", &R::SetSharedTier, py::arg("slot"), py::arg("shared_tier"))
      .def("reads_shared_tier", &R::ReadsSharedTier, py::arg("slot"))
      .def(
          "remove_engine",
          [](R& self, std::int32_t slot) {
            py::gil_scoped_release release;
            self.RemoveEngine(slot);
          },
          py::arg("slot"))
      .def("engines", &R::Engines, "Live slots in registration order.")
      .def("num_blocks", &R::NumBlocks, py::arg("slot"), "[(group_idx, blocks)] in the order the groups appeared.")
      .def(
          "num_shared_blocks",
          [](const R& self) {
            std::vector<std::tuple<std::uint64_t, std::optional<std::uint64_t>, std::int64_t>> out;
            for (const RouterSharedCount& c : self.NumSharedBlocks()) out.emplace_back(c.block_size, c.window, c.blocks);
            return out;
          },
          "[(block_size, window, blocks)] of the store's non-empty sets.")
      .def(
          "remove_shared_blocks",
          [](R& self, const py::iterable& hashes, std::optional<std::uint64_t> window) {
            std::vector<RouterHash> keys;
            for (const py::handle h : hashes) {
              RouterHash rh;
              if (ToRouterHash(h, &rh)) keys.push_back(std::move(rh));
            }
            py::gil_scoped_release release;
            return self.RemoveSharedBlocks(keys, window);
          },
          py::arg("hashes"), py::arg("window"))
      .def("clear_shared_tier", &R::ClearSharedTier)
      .def(
          "apply_msgpack",
          [](R& self, std::int32_t slot, const py::object& payload) {
            if (PyBytes_Check(payload.ptr())) {
              const char* data = PyBytes_AS_STRING(payload.ptr());  // immutable, and `payload` keeps it
              const auto size = static_cast<std::size_t>(PyBytes_GET_SIZE(payload.ptr()));
              py::gil_scoped_release release;
              return self.ApplyMsgpack(slot, data, size);
            }
            const std::string copy = py::bytes(payload);  // a bytearray or memoryview may change
            py::gil_scoped_release release;
            return self.ApplyMsgpack(slot, copy.data(), copy.size());
          },
          py::arg("slot"), py::arg("payload"),
          "Applies one raw msgpack KVEventBatch whole (ValueError, nothing applied, if any of it is bad); slot -1 "
          "registers a new engine. Returns the engine's slot.")
      .def(
          "apply_events",
          [](R& self, std::int32_t slot, const py::list& events) {
            const std::vector<RouterEvent> parsed = ToEvents(events);
            py::gil_scoped_release release;
            return self.ApplyEvents(slot, parsed);
          },
          py::arg("slot"), py::arg("events"),
          "Applies checked events (type, hashes, group_idx, medium, block_size, kv_cache_spec_kind, window, lora_id, "
          "lora_name); slot -1 registers a new engine. Returns the engine's slot.")
      .def(
          "scores",
          [](const R& self, const py::handle& tokens, const std::optional<std::string>& lora_name,
             const std::optional<LoraTaskId>& lora_id, const std::optional<CacheSalt>& cache_salt,
             const std::vector<MultimodalArg>& multimodal, const std::optional<std::vector<std::int32_t>>& slots) {
            RouterLookupKey key;
            key.lora_name = lora_name;
            if (lora_id.has_value()) key.lora_id = lora_id->value;
            if (cache_salt.has_value()) key.cache_salt = cache_salt->value;
            key.multimodal = MakeExtras(std::nullopt, std::nullopt, multimodal).multimodal;
            const std::vector<TokenId> toks = ToTokens(tokens, "tokens");
            py::gil_scoped_release release;
            return self.Scores(toks.data(), toks.size(), key, slots.has_value() ? &*slots : nullptr);
          },
          py::arg("tokens"), py::arg("lora_name") = py::none(), py::arg("lora_id") = py::none(),
          py::arg("cache_salt") = py::none(), py::arg("multimodal") = std::vector<MultimodalArg>{},
          py::arg("slots") = py::none(),
          "Every listed engine's reusable prefix of `tokens` (all engines, in registration order, without slots).")
      .def_property_readonly("num_entries", &R::NumEntries)
      .def_property_readonly("num_interned", &R::NumInterned);
  RejectSecondInit(cls);
}

}  // namespace kvcache::py
