#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "init_guard.h"  // first: the KVCacheManager type caster must precede every use
#include "args.h"
#include "bindings.h"
#include "fast_method.h"
#include "int_arg.h"
#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"

namespace kvcache::py {
namespace {

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
  std::string typestr() const { return ArrayTypeStr(view_.dtype); }
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

inline constexpr char kLayerBufferNotInitialized[] =
    "LayerBuffer is not initialized: it was made with __new__; get one from KVCacheManager.get_buffers()";

}  // namespace
}  // namespace kvcache::py

// A LayerBuffer made with __new__ has no view: refuse it (init_guard.h) instead of reporting a
// garbage shape and pointer or handing them to a DLPack consumer.
namespace pybind11::detail {
template <>
class type_caster<kvcache::py::LayerBuffer>
    : public GuardedCaster<kvcache::py::LayerBuffer, kvcache::py::kLayerBufferNotInitialized> {};
}  // namespace pybind11::detail

namespace kvcache::py {
namespace {

pybind11::object NumpyLayerView(const LayerView& v, const pybind11::object& owner) {
  std::vector<pybind11::ssize_t> shape(v.shape.begin(), v.shape.end());
  std::vector<pybind11::ssize_t> strides(v.strides.begin(), v.strides.end());
  return pybind11::array(pybind11::dtype(NumpyDTypeName(v.dtype)), shape, strides, v.data, owner);
}

/// Binds a read-only query over a prompt and its reuse keys: converts the arguments, releases
/// the GIL and calls `query(tokens, n, extras)`.
template <typename R>
auto PromptQuery(R (KVCacheManager::*query)(const TokenId*, std::size_t, const ReuseExtras&) const,
                 R (KVCacheManager::*prepared_query)(const PreparedPrompt&) const) {
  return [query, prepared_query](const KVCacheManager& self, const pybind11::handle& tokens,
                                 const std::optional<LoraTaskId>& lora_task_id,
                                 const std::optional<CacheSalt>& cache_salt,
                                 const std::vector<MultimodalArg>& multimodal) {
    if (const std::shared_ptr<const PreparedPrompt> p = AsPrepared(tokens, lora_task_id, cache_salt, multimodal)) {
      pybind11::gil_scoped_release release;
      return (self.*prepared_query)(*p);
    }
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
  if (e.state_group >= 0) d["state_group"] = e.state_group;
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
  d["disk_read_failures"] = s.disk_read_failures;
  d["shared_hits"] = s.shared_hits;
  d["shared_writes"] = s.shared_writes;
  d["shared_write_drops"] = s.shared_write_drops;
  d["shared_errors"] = s.shared_errors;
  d["shared_auth_failures"] = s.shared_auth_failures;
  d["reused_blocks_per_window_size"] = s.reused_blocks_per_window_size;
  d["missed_blocks_per_window_size"] = s.missed_blocks_per_window_size;
  d["num_cached_nodes"] = s.num_cached_nodes;
  d["lent_slabs"] = s.lent_slabs;
  d["num_owned_blocks_per_window_size"] = s.num_owned_blocks_per_window_size;
  d["forked_blocks"] = s.forked_blocks;
  d["copied_on_write_blocks"] = s.copied_on_write_blocks;
  AddStateStats(s, &d);
  return d;
}

SwaReusePolicy ParseSwaReusePolicy(const std::string& name) {
  if (name == "invalidate") return SwaReusePolicy::kInvalidate;
  if (name == "placeholder") return SwaReusePolicy::kPlaceholder;
  ThrowInvalid("swa_reuse_policy must be 'invalidate' or 'placeholder', got '", name, "'");
}

/// The native constructor: every argument converted and range-checked, then the GIL released
/// while the pools are allocated.
std::unique_ptr<KVCacheManager> MakeManager(
    NumLayers num_layers, const std::vector<NumKvHeads>& num_kv_heads, HeadDim head_dim, const std::string& dtype,
    KvFactor kv_factor, TokensPerBlock tokens_per_block, const std::vector<AttentionWindow>& max_attention_window,
    MaxSeqLen max_seq_len, MaxBatchSize max_batch_size, const BlocksPerWindow& blocks_per_window,
    const std::string& backend, MaxDraftTokens max_draft_tokens, bool enable_block_reuse, bool enable_partial_reuse,
    bool copy_on_partial_reuse, bool onboard_blocks, OffloadMinPriority secondary_offload_min_priority,
    EventBufferMaxSize event_buffer_max_size, const std::string& swa_reuse_policy,
    const std::vector<LayerHeadDim>& head_dims, const std::vector<std::string>& dtypes, bool protect_reused_blocks,
    const DiskBlocksPerWindow& disk_blocks_per_window, const std::string& disk_cache_dir, bool lend_free_memory,
    const std::string& shared_cache_url, const std::string& shared_cache_namespace,
    SharedCacheTimeoutMs shared_cache_timeout_ms, SharedCacheQueueBytes shared_cache_queue_bytes,
    const pybind11::object& recurrent_layers, std::int64_t state_slots, std::int64_t state_secondary_slots,
    const pybind11::object& checkpoint_policy) {
  ModelSpec model;
  model.num_layers = num_layers;
  model.num_kv_heads.assign(num_kv_heads.begin(), num_kv_heads.end());
  model.head_dim = head_dim;
  model.dtype = ParseDType(dtype);
  model.kv_factor = kv_factor;
  model.head_dims.assign(head_dims.begin(), head_dims.end());
  for (const auto& name : dtypes) model.dtypes.push_back(ParseDType(name));
  ManagerConfig config;
  config.tokens_per_block = tokens_per_block;
  config.max_attention_window.assign(max_attention_window.begin(), max_attention_window.end());
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
  config.swa_reuse_policy = ParseSwaReusePolicy(swa_reuse_policy);
  config.protect_hit_blocks = protect_reused_blocks;
  for (const auto& [w, count] : disk_blocks_per_window) config.disk_blocks_per_window[w] = count;
  config.disk_cache_dir = disk_cache_dir;
  config.lend_free_memory = lend_free_memory;
  config.shared_cache_url = shared_cache_url;
  config.shared_cache_namespace = shared_cache_namespace;
  config.shared_cache_timeout_ms = shared_cache_timeout_ms;
  config.shared_cache_queue_bytes = static_cast<std::size_t>(shared_cache_queue_bytes.value);
  ParseStateArgs(recurrent_layers, state_slots, state_secondary_slots, checkpoint_policy, &model, &config);
  pybind11::gil_scoped_release release;
  return std::make_unique<KVCacheManager>(model, config);
}

/// copy_block_offsets: checks the output table and the row range, then fills it natively.
std::int32_t CopyBlockOffsets(const KVCacheManager& self, const pybind11::handle& out_obj,
                              const pybind11::handle& request_ids, SlotOffset slot_offset) {
  if (!pybind11::isinstance<pybind11::array>(out_obj)) ThrowInvalid("out must be a numpy.ndarray");
  auto out = pybind11::reinterpret_borrow<pybind11::array>(out_obj);
  if (!out.dtype().is(pybind11::dtype::of<std::int32_t>())) ThrowInvalid("out must have dtype int32");
  if (out.ndim() != 4) ThrowInvalid("out must be 4-D [num_pools, rows, kv_factor, width]");
  if ((out.flags() & pybind11::array::c_style) == 0) ThrowInvalid("out must be C-contiguous");
  if (!out.writeable()) ThrowInvalid("out must be writable");
  const auto num_pools = static_cast<pybind11::ssize_t>(self.pools().size());
  if (out.shape(0) != num_pools) ThrowInvalid("out.shape[0] must be num_pools = ", num_pools);
  if (out.shape(2) != self.kv_factor()) ThrowInvalid("out.shape[2] must be kv_factor = ", self.kv_factor());
  const std::vector<SeqId> ids = ToRequestIds(request_ids, "request_ids");
  const std::int64_t rows = out.shape(1);
  const std::int64_t width = out.shape(3);
  // Written as a subtraction: slot_offset + len(ids) overflows for slot_offset near 2**63.
  const auto n = static_cast<std::int64_t>(ids.size());
  if (slot_offset > rows - n) {
    ThrowInvalid("copy_block_offsets: slot_offset = ", slot_offset.value, " plus ", n,
                 " request ids does not fit an output with ", rows, " rows");
  }
  auto* data = static_cast<std::int32_t*>(out.mutable_data());
  pybind11::gil_scoped_release release;
  return self.CopyBlockOffsets(data, rows, width, ids.data(), ids.size(), slot_offset);
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

  pybind11::class_<PreparedPrompt, std::shared_ptr<PreparedPrompt>>(
      m, "PreparedPrompt",
      "A prompt converted and keyed once (KVCacheManager.prepare): accepted wherever a prompt is, so "
      "retried admissions, lookups and block counts convert and hash nothing again. Immutable.")
      .def("__len__", [](const PreparedPrompt& p) { return p.tokens.size(); })
      .def_property_readonly(
          "tokens",
          [](const PreparedPrompt& p) {
            return pybind11::array_t<std::int32_t>(static_cast<pybind11::ssize_t>(p.tokens.size()), p.tokens.data());
          },
          "A copy of the token ids (int32 ndarray).")
      .def_property_readonly("tokens_per_block", [](const PreparedPrompt& p) { return p.tokens_per_block; })
      .def_property_readonly("lora_task_id", [](const PreparedPrompt& p) { return p.extras.lora_task_id; })
      .def_property_readonly("num_keyed_blocks", [](const PreparedPrompt& p) { return p.hashes.size(); },
                             "Full blocks keyed (chained hash computed) at preparation.")
      .def("__repr__", [](const PreparedPrompt& p) {
        return detail::Concat("PreparedPrompt(", p.tokens.size(), " tokens, tokens_per_block=", p.tokens_per_block,
                              ")");
      });

  using M = KVCacheManager;
  pybind11::class_<M> cls(m, "KVCacheManager", "Native KV cache manager (see kvcache.KVCacheManager).");
  cls.def(pybind11::init(&MakeManager), pybind11::kw_only(), pybind11::arg("num_layers"),
          pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("dtype"), pybind11::arg("kv_factor"),
          pybind11::arg("tokens_per_block"), pybind11::arg("max_attention_window"), pybind11::arg("max_seq_len"),
          pybind11::arg("max_batch_size"), pybind11::arg("blocks_per_window"), pybind11::arg("backend"),
          pybind11::arg("max_draft_tokens") = 0, pybind11::arg("enable_block_reuse") = false,
          pybind11::arg("enable_partial_reuse") = true, pybind11::arg("copy_on_partial_reuse") = true,
          pybind11::arg("onboard_blocks") = true, pybind11::arg("secondary_offload_min_priority") = 30,
          pybind11::arg("event_buffer_max_size") = 0, pybind11::arg("swa_reuse_policy") = "placeholder",
          pybind11::arg("head_dims") = std::vector<LayerHeadDim>{}, pybind11::arg("dtypes") = std::vector<std::string>{},
          pybind11::arg("protect_reused_blocks") = true,
          pybind11::arg("disk_blocks_per_window") = DiskBlocksPerWindow{}, pybind11::arg("disk_cache_dir") = "",
          pybind11::arg("lend_free_memory") = false, pybind11::arg("shared_cache_url") = "",
          pybind11::arg("shared_cache_namespace") = "", pybind11::arg("shared_cache_timeout_ms") = 5,
          pybind11::arg("shared_cache_queue_bytes") = std::int64_t{64} << 20,
          pybind11::arg("recurrent_layers") = pybind11::list(), pybind11::arg("state_slots") = 0,
          pybind11::arg("state_secondary_slots") = 0, pybind11::arg("checkpoint_policy") = pybind11::none());
  RejectSecondInit(cls);
  cls.def_property_readonly("window_sizes", &M::window_sizes)
      .def_property_readonly("tokens_per_block", &M::tokens_per_block)
      .def_property_readonly("max_seq_len", &M::max_seq_len)
      .def_property_readonly("max_batch_size", &M::max_batch_size)
      .def_property_readonly("max_draft_tokens", &M::max_draft_tokens)
      .def_property_readonly("max_blocks_per_seq", &M::max_blocks_per_seq)
      .def_property_readonly("kv_factor", &M::kv_factor)
      .def_property_readonly("backend", [](const M& self) { return BackendName(self.backend()); })
      .def_property_readonly("shared_cache_namespace", &M::shared_cache_namespace,
                             "The shared tier's key prefix ('' without a shared tier).")
      .def(
          "flush_shared_cache",
          [](M& self, TimeoutMs timeout_ms) {
            pybind11::gil_scoped_release release;
            return self.FlushSharedCache(static_cast<std::int32_t>(std::min<std::int64_t>(timeout_ms, 1 << 30)));
          },
          pybind11::arg("timeout_ms") = 1000,
          "Waits up to timeout_ms until every block queued for the shared tier was written (or failed); "
          "True if the queue drained (always True without a shared tier).")
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
              d["head_dim"] = p.head_dim;
              d["dtype"] = DTypeName(p.dtype);
              d["block_bytes"] = p.block_bytes;
              d["block_stride"] = p.block_stride;
              d["num_primary_blocks"] = p.num_primary;
              d["num_secondary_blocks"] = p.num_secondary;
              d["primary_ptr"] = p.primary_ptr;
              d["secondary_ptr"] = p.secondary_ptr;
              out.append(d);
            }
            return out;
          },
          "One dict per pool in global order (ascending window, then KV-head count, head size, dtype).")
      .def(
          "_add_sequence",
          [](M& self, RequestId id, const pybind11::handle& tokens, const std::optional<Priority>& priority,
             const std::optional<LoraTaskId>& lora_task_id, const std::optional<CacheSalt>& cache_salt,
             const std::vector<MultimodalArg>& multimodal, const std::vector<PriorityRangeArg>& priority_ranges,
             const std::optional<DecodePriority>& decode_priority, DecodeDurationMs decode_duration_ms,
             const std::optional<PrefillArg>& prefill) {
            std::shared_ptr<const PreparedPrompt> prepared = AsPrepared(tokens, lora_task_id, cache_salt, multimodal);
            std::vector<TokenId> toks;
            if (prepared == nullptr) toks = ToTokens(tokens, "tokens");
            SequenceOptions opts;
            opts.priority = Unwrap(priority);
            if (prepared == nullptr) opts.extras = MakeExtras(lora_task_id, cache_salt, multimodal);
            for (const auto& [start, end, prio, duration] : priority_ranges) {
              opts.priority_ranges.push_back(PriorityRange{start, end, prio, duration});
            }
            opts.decode_priority = Unwrap(decode_priority);
            opts.decode_duration_ms = decode_duration_ms;
            pybind11::gil_scoped_release release;
            if (prepared != nullptr) return self.AddSequence(id, std::move(prepared), opts, Unwrap(prefill));
            return self.AddSequence(id, toks.data(), toks.size(), opts, Unwrap(prefill));
          },
          pybind11::arg("request_id"), pybind11::arg("tokens"), pybind11::arg("priority") = pybind11::none(),
          pybind11::arg("lora_task_id") = pybind11::none(), pybind11::arg("cache_salt") = pybind11::none(),
          pybind11::arg("multimodal") = std::vector<MultimodalArg>{},
          pybind11::arg("priority_ranges") = std::vector<PriorityRangeArg>{},
          pybind11::arg("decode_priority") = pybind11::none(), pybind11::arg("decode_duration_ms") = 0,
          pybind11::arg("prefill") = pybind11::none())
      .def(
          "_prepare",
          [](const M& self, const pybind11::handle& tokens, const std::optional<LoraTaskId>& lora_task_id,
             const std::optional<CacheSalt>& cache_salt, const std::vector<MultimodalArg>& multimodal) {
            if (pybind11::isinstance<PreparedPrompt>(tokens)) ThrowInvalid("prepare: the prompt is already prepared");
            std::vector<TokenId> toks = ToTokens(tokens, "tokens");
            const ReuseExtras extras = MakeExtras(lora_task_id, cache_salt, multimodal);
            pybind11::gil_scoped_release release;
            return std::make_shared<PreparedPrompt>(self.Prepare(std::move(toks), extras));
          },
          pybind11::arg("tokens"), pybind11::arg("lora_task_id") = pybind11::none(),
          pybind11::arg("cache_salt") = pybind11::none(), pybind11::arg("multimodal") = std::vector<MultimodalArg>{})
      .def("_get_reusable_prefix_length",
           PromptQuery<std::int32_t>(&M::GetReusablePrefixLength, &M::GetReusablePrefixLength), pybind11::arg("tokens"),
           pybind11::arg("lora_task_id") = pybind11::none(), pybind11::arg("cache_salt") = pybind11::none(),
           pybind11::arg("multimodal") = std::vector<MultimodalArg>{})
      .def(
          "_get_num_blocks_to_allocate",
          [](const M& self, const pybind11::handle& tokens, const std::optional<LoraTaskId>& lora_task_id,
             const std::optional<CacheSalt>& cache_salt, const std::vector<MultimodalArg>& multimodal,
             const std::optional<PrefillArg>& prefill) {
            if (const std::shared_ptr<const PreparedPrompt> p = AsPrepared(tokens, lora_task_id, cache_salt, multimodal)) {
              pybind11::gil_scoped_release release;
              return self.GetNumBlocksToAllocate(*p, Unwrap(prefill));
            }
            const std::vector<TokenId> toks = ToTokens(tokens, "tokens");
            const ReuseExtras extras = MakeExtras(lora_task_id, cache_salt, multimodal);
            pybind11::gil_scoped_release release;
            return self.GetNumBlocksToAllocate(toks.data(), toks.size(), extras, Unwrap(prefill));
          },
          pybind11::arg("tokens"), pybind11::arg("lora_task_id") = pybind11::none(),
          pybind11::arg("cache_salt") = pybind11::none(), pybind11::arg("multimodal") = std::vector<MultimodalArg>{},
          pybind11::arg("prefill") = pybind11::none())
      .def(
          "pin_blocks",
          [](M& self, RequestId id) {
            pybind11::gil_scoped_release release;
            return self.PinBlocks(id);
          },
          pybind11::arg("request_id"),
          "Stores the sequence's full blocks and pins, in every window, the cached block of each stored "
          "position; returns the pinned block ids per window, which unpin_blocks_by_id takes back.")
      .def(
          "unpin_blocks_by_id",
          [](M& self, const pybind11::handle& block_ids, const std::optional<WindowSizeArg>& window) {
            if (pybind11::isinstance<pybind11::dict>(block_ids)) {
              if (window.has_value()) ThrowInvalid("unpin_blocks_by_id: window_size goes with a list of block ids, not a dict");
              const auto exact = ToPinnedBlocks(block_ids);
              pybind11::gil_scoped_release release;
              self.UnpinBlocks(exact);
              return;
            }
            if (PyUnicode_Check(block_ids.ptr()) || PyBytes_Check(block_ids.ptr()) ||
                (!PySequence_Check(block_ids.ptr()) && !pybind11::isinstance<pybind11::array>(block_ids))) {
              ThrowInvalid("unpin_blocks_by_id: block_ids must be a list of block ids or the {window: [block ids]} "
                           "dict pin_blocks returns, got ", Py_TYPE(block_ids.ptr())->tp_name);
            }
            std::vector<BlockId> ids = ToBlockIds(block_ids);
            pybind11::gil_scoped_release release;
            self.UnpinBlocksById(std::move(ids), Unwrap(window));
          },
          pybind11::arg("block_ids"), pybind11::arg("window_size") = pybind11::none(),
          "With the dict that pin_blocks / remove_sequence(pin=True) returned: drops exactly those pins "
          "(all or nothing). With a list: unpins the stored chains ending at these blocks (of window_size; "
          "default: the full-attention window, unpinning every window).")
      .def(
          "is_sequence_valid_for_reuse", [](const M& self, RequestId id) { return self.IsSequenceValidForReuse(id); },
          pybind11::arg("request_id"))
      .def(
          "get_request_stats",
          [](const M& self, RequestId id) {
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
          [](M& self, TimeoutMs timeout_ms) {
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
      .def(
          "_set_fake_time_ms", [](M& self, NowMs now_ms) { self.SetFakeTimeMs(now_ms); }, pybind11::arg("now_ms"),
          "Test hook: a fixed clock for timed priorities (negative: the real clock).")
      .def(
          "add_token", [](M& self, RequestId id, Token token) { self.AddToken(id, token); },
          pybind11::arg("request_id"), pybind11::arg("token"), "Appends one generated token.")
      .def(
          "rewind",
          [](M& self, RequestId id, NumTokens num_tokens) {
            // Copies a shared tail block wherever the backend has memory.
            WithoutGilIf(self.backend() != BackendKind::kVirtual, [&] { self.Rewind(id, num_tokens); });
          },
          pybind11::arg("request_id"), pybind11::arg("num_tokens"),
          "Drops the last num_tokens tokens, releasing blocks that become empty.")
      .def(
          "fork_sequence",
          [](M& self, RequestId parent, const pybind11::handle& child_ids) {
            std::vector<SeqId> ids;
            // One id: a Python int or any integer scalar (numpy's too); else a sequence or array.
            const bool single = pybind11::isinstance<pybind11::int_>(child_ids) ||
                                (PyIndex_Check(child_ids.ptr()) != 0 && !pybind11::isinstance<pybind11::array>(child_ids));
            if (single) {
              if (PyBool_Check(child_ids.ptr())) ThrowInvalid("child_ids must be an int or a sequence of ints, got bool");
              auto index = pybind11::reinterpret_steal<pybind11::object>(PyNumber_Index(child_ids.ptr()));
              if (!index) throw pybind11::error_already_set();
              pybind11::list one;
              one.append(index);
              ToRequestIds(one, "child_ids", &ids);
            } else {
              ToRequestIds(child_ids, "child_ids", &ids);
            }
            self.ForkSequence(parent, ids.data(), ids.size());  // bookkeeping only: no copy
          },
          pybind11::arg("parent_id"), pybind11::arg("child_ids"),
          "Registers each child id (one id or a list) as a copy of request parent_id that shares every "
          "block the parent holds, in every window (no block is taken, nothing is copied). The first "
          "write into a shared block (add_tokens, prefill, rewind into it) copies that block first. "
          "Unknown parent: KeyError; a child id that is registered, repeated or the parent: ValueError. "
          "All or nothing.")
      .def(
          "has_sequence", [](const M& self, AnyRequestId id) { return id >= 0 && self.HasSequence(id); },
          pybind11::arg("request_id"))
      .def_property_readonly("num_sequences", &M::NumSequences)
      .def(
          "get_cache_block_ids",
          [](const M& self, RequestId id, const std::optional<WindowSizeArg>& window) {
            return self.GetCacheBlockIds(id, ResolveWindow(self, Unwrap(window)));
          },
          pybind11::arg("request_id"), pybind11::arg("window_size") = pybind11::none(),
          "Block ids per position (NULL_BLOCK where a sliding window released the block).")
      .def(
          "get_num_free_blocks",
          [](const M& self, const std::optional<WindowSizeArg>& window) {
            return window.has_value() ? self.GetNumFreeBlocks(*window) : self.GetMinNumFreeBlocks();
          },
          pybind11::arg("window_size") = pybind11::none(),
          "Primary blocks that can be handed out now; without window_size the minimum over windows.")
      .def(
          "fits_when_empty",
          [](const M& self, const pybind11::handle& blocks) { return self.FitsWhenEmpty(ToBlocksNeeded(blocks)); },
          pybind11::arg("blocks"),
          "Whether an empty manager could hold blocks[window] blocks of every window at once.")
      .def(
          "get_num_used_blocks",
          [](const M& self, const WindowSizeArg& window) { return self.GetNumUsedBlocks(window); },
          pybind11::arg("window_size"), "Primary blocks of the window referenced by sequences or pins.")
      .def_property_readonly("lends_free_memory", &M::lends_free_memory)
      .def("copy_block_offsets", &CopyBlockOffsets, pybind11::arg("out"), pybind11::arg("request_ids"),
           pybind11::arg("slot_offset") = 0)
      .def(
          "get_buffers",
          [](pybind11::object self_obj, LayerIdx layer_idx) -> pybind11::object {
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
          [](pybind11::object self_obj, LayerIdx layer_idx) {
            const M& self = self_obj.cast<const M&>();
            const LayerView view = self.GetLayerView(layer_idx);
            return LayerBuffer(view, self_obj, view.backend == BackendKind::kCuda);
          },
          pybind11::arg("layer_idx"), "LayerBuffer view on any backend with memory (tests).")
      .def("_stats_dict", [](const M& self) { return StatsToDict(self.GetStats()); })
      .def(
          "reset_prefix_cache",
          [](M& self) {
            pybind11::gil_scoped_release release;
            return self.ResetPrefixCache();
          },
          "Drops every cached prefix (removed events as for an eviction; host and disk tiers too, the "
          "shared tier is not touched) and returns True; False, changing nothing, while any sequence "
          "is registered or any block is pinned.")
      .def(
          "check_invariants",
          [](const M& self) {
            pybind11::gil_scoped_release release;
            self.CheckInvariants();
          },
          "Verifies every internal invariant; raises KVCacheError describing the first violation.");
  BindStepMethods(cls);
}

}  // namespace kvcache::py
