#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings.h"
#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"



namespace kvcache::py {
namespace {

// ---- Argument conversion -------------------------------------------------------------------

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
        if (u.data()[i] > static_cast<std::uint64_t>(INT64_MAX)) ThrowInvalid(what, " value out of range");
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
    if (overflow != 0) ThrowInvalid(what, " value out of range");
    out.push_back(v);
  }
  return out;
}

template <typename T>
void CopyTokenValues(const T* data, std::size_t n, const char* what, std::vector<TokenId>* out) {
  out->resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const T v = data[i];
    if (v < 0) ThrowInvalid(what, "[", i, "] is negative (", static_cast<std::int64_t>(v), ")");
    if (static_cast<std::uint64_t>(v) > static_cast<std::uint64_t>(INT32_MAX)) {
      ThrowInvalid(what, "[", i, "] = ", static_cast<std::uint64_t>(v), " does not fit a 32-bit token id");
    }
    (*out)[i] = static_cast<TokenId>(v);
  }
}

/// Token ids from a 1-D integer ndarray (int32/int64 read in place) or a sequence of ints.
std::vector<TokenId> ToTokens(const pybind11::handle& obj, const char* what) {
  std::vector<TokenId> out;
  if (pybind11::isinstance<pybind11::array>(obj)) {
    auto arr = pybind11::reinterpret_borrow<pybind11::array>(obj);
    const bool contiguous = (arr.flags() & pybind11::array::c_style) != 0 && arr.ndim() == 1;
    if (contiguous && arr.dtype().is(pybind11::dtype::of<std::int32_t>())) {
      CopyTokenValues(static_cast<const std::int32_t*>(arr.data()), static_cast<std::size_t>(arr.size()), what, &out);
      return out;
    }
    if (contiguous && arr.dtype().is(pybind11::dtype::of<std::int64_t>())) {
      CopyTokenValues(static_cast<const std::int64_t*>(arr.data()), static_cast<std::size_t>(arr.size()), what, &out);
      return out;
    }
  }
  const std::vector<std::int64_t> raw = ToInt64Vector(obj, what);
  CopyTokenValues(raw.data(), raw.size(), what, &out);
  return out;
}

WindowSize ResolveWindow(const KVCacheManager& self, const std::optional<WindowSize>& window) {
  if (window.has_value()) return *window;
  if (self.window_sizes().size() != 1) {
    ThrowInvalid("window_size is required: this manager has ", self.window_sizes().size(), " windows");
  }
  return self.window_sizes().front();
}

// ---- DLPack (for device memory views) ------------------------------------------------------

struct DLDevice {
  std::int32_t device_type;
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
constexpr std::int32_t kDLCPU = 1;
constexpr std::int32_t kDLCUDA = 2;

struct DLContext {
  DLManagedTensor tensor{};
  std::int64_t shape[5]{};
  std::int64_t strides[5]{};
  PyObject* owner = nullptr;  // keeps the manager (and so the memory) alive
};

DLDataType ToDLDataType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return {2, 32, 1};
    case DType::kFloat16:
      return {2, 16, 1};
    case DType::kBFloat16:
      return {4, 16, 1};
    case DType::kFp8:
      return {1, 8, 1};  // raw bytes: DLPack has no portable fp8 code
    case DType::kInt8:
      return {0, 8, 1};
  }
  return {1, 8, 1};
}

/// A strided view of one layer's K/V memory that torch.from_dlpack and
/// __cuda_array_interface__ consumers accept. Keeps the manager alive.
class LayerBuffer {
 public:
  LayerBuffer(LayerView view, pybind11::object owner, bool device)
      : view_(view), owner_(std::move(owner)), device_(device) {}

  pybind11::tuple shape() const {
    return pybind11::make_tuple(view_.shape[0], view_.shape[1], view_.shape[2], view_.shape[3], view_.shape[4]);
  }
  pybind11::tuple strides() const {
    return pybind11::make_tuple(view_.strides[0], view_.strides[1], view_.strides[2], view_.strides[3],
                                view_.strides[4]);
  }
  std::uintptr_t data_ptr() const { return reinterpret_cast<std::uintptr_t>(view_.data); }
  std::string dtype() const { return DTypeName(view_.dtype); }
  std::string typestr() const {
    switch (view_.dtype) {
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
  pybind11::dict cuda_array_interface() const {
    if (!device_) throw pybind11::attribute_error("host memory has no __cuda_array_interface__");
    pybind11::dict d;
    d["shape"] = shape();
    d["strides"] = strides();
    d["typestr"] = typestr();
    d["data"] = pybind11::make_tuple(data_ptr(), false);
    d["version"] = 3;
    return d;
  }
  pybind11::tuple dlpack_device() const { return pybind11::make_tuple(device_ ? kDLCUDA : kDLCPU, 0); }

  pybind11::capsule dlpack(const pybind11::object& /*stream*/, const pybind11::object& /*max_version*/,
                          const pybind11::object& /*dl_device*/, const pybind11::object& /*copy*/) const {
    auto* ctx = new DLContext();
    const int elem = DTypeBytes(view_.dtype);
    for (int i = 0; i < 5; ++i) {
      ctx->shape[i] = view_.shape[i];
      ctx->strides[i] = view_.strides[i] / elem;  // DLPack strides count elements
    }
    ctx->owner = owner_.ptr();
    Py_INCREF(ctx->owner);
    DLTensor& t = ctx->tensor.dl_tensor;
    t.data = view_.data;
    t.device = {device_ ? kDLCUDA : kDLCPU, 0};
    t.ndim = 5;
    t.dtype = ToDLDataType(view_.dtype);
    t.shape = ctx->shape;
    t.strides = ctx->strides;
    t.byte_offset = 0;
    ctx->tensor.manager_ctx = ctx;
    ctx->tensor.deleter = [](DLManagedTensor* self) {
      auto* c = static_cast<DLContext*>(self->manager_ctx);
      {
        pybind11::gil_scoped_acquire gil;
        Py_XDECREF(c->owner);
      }
      delete c;
    };
    // A consumer renames the capsule to "used_dltensor" and takes over the deleter.
    PyObject* cap = PyCapsule_New(&ctx->tensor, "dltensor", [](PyObject* capsule) {
      if (PyCapsule_IsValid(capsule, "dltensor")) {
        auto* t2 = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
        if (t2 != nullptr && t2->deleter != nullptr) t2->deleter(t2);
      }
    });
    if (cap == nullptr) {
      ctx->tensor.deleter(&ctx->tensor);
      throw pybind11::error_already_set();
    }
    return pybind11::reinterpret_steal<pybind11::capsule>(cap);
  }

 private:
  LayerView view_;
  pybind11::object owner_;
  bool device_;
};

pybind11::object NumpyLayerView(const LayerView& v, const pybind11::object& owner) {
  std::string fmt;
  switch (v.dtype) {
    case DType::kFloat32:
      fmt = "float32";
      break;
    case DType::kFloat16:
      fmt = "float16";
      break;
    case DType::kBFloat16:
      fmt = "uint16";  // numpy has no bfloat16: the raw bits
      break;
    case DType::kFp8:
      fmt = "uint8";
      break;
    case DType::kInt8:
      fmt = "int8";
      break;
  }
  std::vector<pybind11::ssize_t> shape(v.shape.begin(), v.shape.end());
  std::vector<pybind11::ssize_t> strides(v.strides.begin(), v.strides.end());
  return pybind11::array(pybind11::dtype(fmt), shape, strides, v.data, owner);
}

ReuseExtras MakeExtras(std::optional<std::int64_t> lora_task_id, std::optional<std::uint64_t> cache_salt,
                       const std::vector<std::tuple<std::uint64_t, std::int32_t, std::int32_t>>& multimodal) {
  ReuseExtras extras;
  extras.lora_task_id = lora_task_id;
  extras.cache_salt = cache_salt;
  for (const auto& [hash, start, length] : multimodal) extras.multimodal.push_back(MultimodalItem{hash, start, length});
  return extras;
}

/// Binds a read-only query over a prompt and its reuse keys: converts the arguments, releases
/// the GIL and calls `query(tokens, n, extras)`.
template <typename R>
auto PromptQuery(R (KVCacheManager::*query)(const TokenId*, std::size_t, const ReuseExtras&) const) {
  return [query](const KVCacheManager& self, const pybind11::handle& tokens, std::optional<std::int64_t> lora_task_id,
                 std::optional<std::uint64_t> cache_salt,
                 const std::vector<std::tuple<std::uint64_t, std::int32_t, std::int32_t>>& multimodal) {
    const std::vector<TokenId> toks = ToTokens(tokens, "tokens");
    const ReuseExtras extras = MakeExtras(lora_task_id, cache_salt, multimodal);
    pybind11::gil_scoped_release release;
    return (self.*query)(toks.data(), toks.size(), extras);
  };
}

const char* EventKindName(EventKind kind) {
  switch (kind) {
    case EventKind::kCreated:
      return "created";
    case EventKind::kStored:
      return "stored";
    case EventKind::kRemoved:
      return "removed";
    case EventKind::kUpdated:
      return "updated";
  }
  return "?";
}

pybind11::dict EventToDict(const KVCacheEvent& e) {
  pybind11::dict d;
  d["event_id"] = e.event_id;
  d["window_size"] = e.window_size;
  d["kind"] = EventKindName(e.kind);
  switch (e.kind) {
    case EventKind::kCreated:
      d["num_blocks_per_cache_level"] = pybind11::make_tuple(e.num_primary_blocks, e.num_secondary_blocks);
      break;
    case EventKind::kStored: {
      d["parent_hash"] = e.parent_hash.has_value() ? pybind11::cast(*e.parent_hash) : pybind11::none();
      pybind11::list blocks;
      for (const auto& b : e.blocks) {
        pybind11::dict bd;
        bd["block_hash"] = b.hash;
        bd["tokens"] = b.tokens;
        bd["lora_task_id"] = b.lora_task_id.has_value() ? pybind11::cast(*b.lora_task_id) : pybind11::none();
        bd["cache_level"] = b.cache_level;
        bd["priority"] = b.priority;
        blocks.append(bd);
      }
      d["blocks"] = blocks;
      break;
    }
    case EventKind::kRemoved:
      d["block_hashes"] = e.hashes;
      break;
    case EventKind::kUpdated:
      d["block_hash"] = e.hash;
      d["cache_level"] = e.cache_level.has_value() ? pybind11::cast(*e.cache_level) : pybind11::none();
      d["priority"] = e.priority.has_value() ? pybind11::cast(*e.priority) : pybind11::none();
      break;
  }
  return d;
}

pybind11::dict StatsToDict(const KvCacheStats& s) {
  pybind11::dict d;
  d["max_num_blocks"] = s.max_num_blocks;
  d["free_num_blocks"] = s.free_num_blocks;
  d["used_num_blocks"] = s.used_num_blocks;
  d["tokens_per_block"] = s.tokens_per_block;
  d["alloc_total_blocks"] = s.alloc_total_blocks;
  d["alloc_new_blocks"] = s.alloc_new_blocks;
  d["reused_blocks"] = s.reused_blocks;
  d["missed_blocks"] = s.missed_blocks;
  d["cache_hit_rate"] = s.cache_hit_rate;
  d["num_free_blocks_per_window_size"] = s.num_free_blocks_per_window_size;
  d["allocated_bytes"] = s.allocated_bytes;
  d["offloaded_blocks"] = s.offloaded_blocks;
  d["onboarded_blocks"] = s.onboarded_blocks;
  d["reused_blocks_per_window_size"] = s.reused_blocks_per_window_size;
  d["missed_blocks_per_window_size"] = s.missed_blocks_per_window_size;
  d["num_cached_nodes"] = s.num_cached_nodes;
  return d;
}

}  // namespace

void BindManager(pybind11::module_& m) {
  pybind11::class_<LayerBuffer>(m, "LayerBuffer",
                                "Strided view of one layer's K/V memory (DLPack and "
                                "__cuda_array_interface__ producer).")
      .def_property_readonly("shape", &LayerBuffer::shape)
      .def_property_readonly("strides", &LayerBuffer::strides, "Strides in bytes.")
      .def_property_readonly("data_ptr", &LayerBuffer::data_ptr)
      .def_property_readonly("dtype", &LayerBuffer::dtype)
      .def_property_readonly("__cuda_array_interface__", &LayerBuffer::cuda_array_interface)
      .def("__dlpack_device__", &LayerBuffer::dlpack_device)
      .def("__dlpack__", &LayerBuffer::dlpack, pybind11::arg("stream") = pybind11::none(),
           pybind11::kw_only(), pybind11::arg("max_version") = pybind11::none(),
           pybind11::arg("dl_device") = pybind11::none(), pybind11::arg("copy") = pybind11::none());

  using M = KVCacheManager;
  pybind11::class_<M>(m, "KVCacheManager", "Native KV cache manager (see kvcache.KVCacheManager).")
      .def(pybind11::init([](std::int32_t num_layers, std::vector<std::int32_t> num_kv_heads, std::int32_t head_dim,
                             const std::string& dtype, std::int32_t kv_factor, std::int32_t tokens_per_block,
                             std::vector<std::int32_t> max_attention_window, std::int32_t max_seq_len,
                             std::int32_t max_batch_size,
                             const std::map<WindowSize, std::pair<std::int32_t, std::int32_t>>& blocks_per_window,
                             const std::string& backend, std::int32_t max_draft_tokens, bool enable_block_reuse,
                             bool enable_partial_reuse, bool copy_on_partial_reuse, bool onboard_blocks,
                             int secondary_offload_min_priority, std::size_t event_buffer_max_size,
                             const std::string& swa_reuse_policy) {
             ModelSpec model;
             model.num_layers = num_layers;
             model.num_kv_heads = std::move(num_kv_heads);
             model.head_dim = head_dim;
             model.dtype = ParseDType(dtype);
             model.kv_factor = kv_factor;
             ManagerConfig config;
             config.tokens_per_block = tokens_per_block;
             config.max_attention_window = std::move(max_attention_window);
             config.max_seq_len = max_seq_len;
             config.max_batch_size = max_batch_size;
             for (const auto& [w, counts] : blocks_per_window) {
               config.blocks_per_window[w] = WindowBlocks{counts.first, counts.second};
             }
             config.backend = ParseBackendKind(backend);
             config.max_draft_tokens = max_draft_tokens;
             config.enable_block_reuse = enable_block_reuse;
             config.enable_partial_reuse = enable_partial_reuse;
             config.copy_on_partial_reuse = copy_on_partial_reuse;
             config.onboard_blocks = onboard_blocks;
             config.secondary_offload_min_priority = secondary_offload_min_priority;
             config.event_buffer_max_size = event_buffer_max_size;
             if (swa_reuse_policy == "invalidate") {
               config.swa_reuse_policy = SwaReusePolicy::kInvalidate;
             } else if (swa_reuse_policy == "placeholder") {
               config.swa_reuse_policy = SwaReusePolicy::kPlaceholder;
             } else {
               ThrowInvalid("swa_reuse_policy must be 'invalidate' or 'placeholder', got '", swa_reuse_policy, "'");
             }
             pybind11::gil_scoped_release release;
             return std::make_unique<M>(model, config);
           }),
           pybind11::kw_only(), pybind11::arg("num_layers"), pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"),
           pybind11::arg("dtype"), pybind11::arg("kv_factor"), pybind11::arg("tokens_per_block"),
           pybind11::arg("max_attention_window"), pybind11::arg("max_seq_len"), pybind11::arg("max_batch_size"),
           pybind11::arg("blocks_per_window"), pybind11::arg("backend"), pybind11::arg("max_draft_tokens") = 0,
           pybind11::arg("enable_block_reuse") = false, pybind11::arg("enable_partial_reuse") = true,
           pybind11::arg("copy_on_partial_reuse") = true, pybind11::arg("onboard_blocks") = true,
           pybind11::arg("secondary_offload_min_priority") = 30, pybind11::arg("event_buffer_max_size") = 0,
           pybind11::arg("swa_reuse_policy") = "placeholder")
      .def_property_readonly("window_sizes", &M::window_sizes)
      .def_property_readonly("tokens_per_block", &M::tokens_per_block)
      .def_property_readonly("max_seq_len", &M::max_seq_len)
      .def_property_readonly("max_batch_size", &M::max_batch_size)
      .def_property_readonly("max_draft_tokens", &M::max_draft_tokens)
      .def_property_readonly("max_blocks_per_seq", &M::max_blocks_per_seq)
      .def_property_readonly("kv_factor", &M::kv_factor)
      .def_property_readonly("backend", [](const M& self) { return BackendName(self.backend()); })
      .def_property_readonly("blocks_per_window",
                             [](const M& self) {
                               std::map<WindowSize, std::pair<std::int32_t, std::int32_t>> out;
                               for (const auto& [w, c] : self.blocks_per_window()) out[w] = {c.primary, c.secondary};
                               return out;
                             })
      .def_property_readonly("num_pools", [](const M& self) { return self.pools().size(); })
      .def_property_readonly("layer_to_pool", &M::layer_to_pool,
                             "(global pool index, index inside the pool) for every layer.")
      .def_property_readonly(
          "pools",
          [](const M& self) {
            pybind11::list out;
            for (const auto& p : self.pools()) {
              pybind11::dict d;
              d["window_size"] = p.window;
              d["num_kv_heads"] = p.num_kv_heads;
              d["layers"] = p.layers;
              d["kv_factor"] = p.kv_factor;
              d["block_bytes"] = p.block_bytes;
              d["num_primary_blocks"] = p.num_primary;
              d["num_secondary_blocks"] = p.num_secondary;
              d["primary_ptr"] = p.primary_ptr;
              d["secondary_ptr"] = p.secondary_ptr;
              out.append(d);
            }
            return out;
          },
          "One dict per pool in global order (ascending window, then KV-head count).")
      .def(
          "_add_sequence",
          [](M& self, SeqId id, const pybind11::handle& tokens, std::optional<int> priority,
             std::optional<std::int64_t> lora_task_id, std::optional<std::uint64_t> cache_salt,
             const std::vector<std::tuple<std::uint64_t, std::int32_t, std::int32_t>>& multimodal,
             const std::vector<std::tuple<std::int32_t, std::int32_t, int, std::int64_t>>& priority_ranges,
             std::optional<int> decode_priority, std::int64_t decode_duration_ms) {
            std::vector<TokenId> toks = ToTokens(tokens, "tokens");
            SequenceOptions opts;
            opts.priority = priority;
            opts.extras = MakeExtras(lora_task_id, cache_salt, multimodal);
            for (const auto& [start, end, prio, duration] : priority_ranges) {
              opts.priority_ranges.push_back(PriorityRange{start, end, prio, duration});
            }
            opts.decode_priority = decode_priority;
            opts.decode_duration_ms = decode_duration_ms;
            pybind11::gil_scoped_release release;
            return self.AddSequence(id, toks.data(), toks.size(), opts);
          },
          pybind11::arg("request_id"), pybind11::arg("tokens"), pybind11::arg("priority") = pybind11::none(),
          pybind11::arg("lora_task_id") = pybind11::none(), pybind11::arg("cache_salt") = pybind11::none(),
          pybind11::arg("multimodal") = std::vector<std::tuple<std::uint64_t, std::int32_t, std::int32_t>>{},
          pybind11::arg("priority_ranges") = std::vector<std::tuple<std::int32_t, std::int32_t, int, std::int64_t>>{},
          pybind11::arg("decode_priority") = pybind11::none(), pybind11::arg("decode_duration_ms") = 0)
      .def("_get_reusable_prefix_length", PromptQuery(&M::GetReusablePrefixLength), pybind11::arg("tokens"),
           pybind11::arg("lora_task_id") = pybind11::none(), pybind11::arg("cache_salt") = pybind11::none(),
           pybind11::arg("multimodal") = std::vector<std::tuple<std::uint64_t, std::int32_t, std::int32_t>>{})
      .def("_get_num_blocks_to_allocate", PromptQuery(&M::GetNumBlocksToAllocate), pybind11::arg("tokens"),
           pybind11::arg("lora_task_id") = pybind11::none(), pybind11::arg("cache_salt") = pybind11::none(),
           pybind11::arg("multimodal") = std::vector<std::tuple<std::uint64_t, std::int32_t, std::int32_t>>{})
      .def("store_context_blocks", &M::StoreContextBlocks, pybind11::arg("request_id"),
           pybind11::call_guard<pybind11::gil_scoped_release>(),
           "Stores the sequence's full prompt blocks for reuse now; returns block positions newly stored.")
      .def("pin_blocks", &M::PinBlocks, pybind11::arg("request_id"),
           "Stores the sequence's full blocks and keeps them from eviction in every window.")
      .def("unpin_blocks_by_id", &M::UnpinBlocksById, pybind11::arg("block_ids"),
           pybind11::arg("window_size") = pybind11::none(),
           "Unpins the stored chains ending at these blocks (of window_size; default: the full-attention "
           "window, unpinning every window).")
      .def("refresh_blocks", &M::RefreshBlocks, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "Once per engine step: expired timed priorities return to the default; pending copies complete.")
      .def("is_sequence_valid_for_reuse", &M::IsSequenceValidForReuse, pybind11::arg("request_id"))
      .def(
          "get_request_stats",
          [](const M& self, SeqId id) {
            const RequestStats r = self.GetRequestStats(id);
            pybind11::dict d;
            d["reused_tokens"] = r.reused_tokens;
            d["reused_blocks"] = r.reused_blocks;
            d["missed_blocks"] = r.missed_blocks;
            d["new_blocks"] = r.new_blocks;
            return d;
          },
          pybind11::arg("request_id"), "Per-request reuse counters, summed over windows.")
      .def(
          "_latest_events",
          [](M& self, std::int64_t timeout_ms) {
            std::vector<KVCacheEvent> events;
            {
              pybind11::gil_scoped_release release;
              events = self.GetLatestEvents(timeout_ms);
            }
            pybind11::list out;
            for (const auto& e : events) out.append(EventToDict(e));
            return out;
          },
          pybind11::arg("timeout_ms") = 0)
      .def_property_readonly("reuse_enabled", &M::reuse_enabled)
      .def("_set_fake_time_ms", &M::SetFakeTimeMs, pybind11::arg("now_ms"),
           "Test hook: a fixed clock for timed priorities (negative: the real clock).")
      .def(
          "add_token",
          [](M& self, SeqId id, std::int64_t token) {
            if (token < 0 || token > INT32_MAX) ThrowInvalid("token ", token, " is not a valid token id");
            self.AddToken(id, static_cast<TokenId>(token));
          },
          pybind11::arg("request_id"), pybind11::arg("token"), "Appends one generated token.")
      .def(
          "add_tokens",
          [](M& self, const pybind11::handle& request_ids, const pybind11::handle& tokens) {
            std::vector<std::int64_t> ids = ToInt64Vector(request_ids, "request_ids");
            std::vector<TokenId> toks = ToTokens(tokens, "tokens");
            if (ids.size() != toks.size()) {
              ThrowInvalid("add_tokens: ", ids.size(), " request ids but ", toks.size(), " tokens");
            }
            pybind11::gil_scoped_release release;
            self.AddTokens(ids.data(), toks.data(), ids.size());
          },
          pybind11::arg("request_ids"), pybind11::arg("tokens"),
          "Appends tokens[i] to request_ids[i] for a whole batch; all or nothing.")
      .def(
          "remove_sequence",
          [](M& self, SeqId id, bool store_for_reuse, bool pin) {
            pybind11::gil_scoped_release release;
            self.RemoveSequence(id, store_for_reuse, pin);
          },
          pybind11::arg("request_id"), pybind11::kw_only(), pybind11::arg("store_for_reuse") = true,
          pybind11::arg("pin") = false, "Ends a sequence and releases its blocks.")
      .def("rewind", &M::Rewind, pybind11::arg("request_id"), pybind11::arg("num_tokens"),
           "Drops the last num_tokens tokens, releasing blocks that become empty.")
      .def("num_tokens", &M::NumTokens, pybind11::arg("request_id"))
      .def("has_sequence", &M::HasSequence, pybind11::arg("request_id"))
      .def_property_readonly("num_sequences", &M::NumSequences)
      .def(
          "get_cache_block_ids",
          [](const M& self, SeqId id, std::optional<WindowSize> window) {
            return self.GetCacheBlockIds(id, ResolveWindow(self, window));
          },
          pybind11::arg("request_id"), pybind11::arg("window_size") = pybind11::none(),
          "Block ids per position (NULL_BLOCK where a sliding window released the block).")
      .def(
          "get_num_free_blocks",
          [](const M& self, std::optional<WindowSize> window) {
            return window.has_value() ? self.GetNumFreeBlocks(*window) : self.GetMinNumFreeBlocks();
          },
          pybind11::arg("window_size") = pybind11::none(),
          "Primary blocks that can be handed out now; without window_size the minimum over windows.")
      .def(
          "copy_block_offsets",
          [](const M& self, const pybind11::handle& out_obj, const pybind11::handle& request_ids,
             std::int64_t slot_offset) {
            if (!pybind11::isinstance<pybind11::array>(out_obj)) ThrowInvalid("out must be a numpy.ndarray");
            auto out = pybind11::reinterpret_borrow<pybind11::array>(out_obj);
            if (!out.dtype().is(pybind11::dtype::of<std::int32_t>())) ThrowInvalid("out must have dtype int32");
            if (out.ndim() != 4) ThrowInvalid("out must be 4-D [num_pools, rows, kv_factor, width]");
            if ((out.flags() & pybind11::array::c_style) == 0) ThrowInvalid("out must be C-contiguous");
            if (!out.writeable()) ThrowInvalid("out must be writable");
            const auto num_pools = static_cast<pybind11::ssize_t>(self.pools().size());
            if (out.shape(0) != num_pools) ThrowInvalid("out.shape[0] must be num_pools = ", num_pools);
            if (out.shape(2) != self.kv_factor()) ThrowInvalid("out.shape[2] must be kv_factor = ", self.kv_factor());
            std::vector<std::int64_t> ids = ToInt64Vector(request_ids, "request_ids");
            auto* data = static_cast<std::int32_t*>(out.mutable_data());
            const std::int64_t rows = out.shape(1);
            const std::int64_t width = out.shape(3);
            pybind11::gil_scoped_release release;
            return self.CopyBlockOffsets(data, rows, width, ids.data(), ids.size(), slot_offset);
          },
          pybind11::arg("out"), pybind11::arg("request_ids"), pybind11::arg("slot_offset") = 0)
      .def(
          "get_buffers",
          [](pybind11::object self_obj, std::int32_t layer_idx) -> pybind11::object {
            const M& self = self_obj.cast<const M&>();
            const LayerView view = self.GetLayerView(layer_idx);
            if (view.backend == BackendKind::kHost) return NumpyLayerView(view, self_obj);
            return pybind11::cast(LayerBuffer(view, self_obj, /*device=*/true));
          },
          pybind11::arg("layer_idx"),
          "K/V memory of one layer, [primary_blocks, kv_factor, num_kv_heads, tokens_per_block, "
          "head_dim]: a numpy array on the host backend, a LayerBuffer on CUDA.")
      .def(
          "_layer_buffer",
          [](pybind11::object self_obj, std::int32_t layer_idx) {
            const M& self = self_obj.cast<const M&>();
            const LayerView view = self.GetLayerView(layer_idx);
            return LayerBuffer(view, self_obj, view.backend == BackendKind::kCuda);
          },
          pybind11::arg("layer_idx"), "LayerBuffer view on any backend with memory (tests).")
      .def("_stats_dict", [](const M& self) { return StatsToDict(self.GetStats()); })
      .def(
          "check_invariants",
          [](const M& self) {
            pybind11::gil_scoped_release release;
            self.CheckInvariants();
          },
          "Verifies every internal invariant; raises KVCacheError describing the first violation.");
}

}  // namespace kvcache::py
