// The recurrent-state pool of KVCacheManager (kv_cache_manager_state.cpp): constructor
// arguments, slots, state views, checkpoint copies and chunk limits.
#include "init_guard.h"  // first: the guarded type casters must precede every use

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "args.h"
#include "bindings.h"
#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"

namespace kvcache::py {
namespace {

namespace py = pybind11;
using M = KVCacheManager;

/// A state view on device memory: `__cuda_array_interface__` for torch.as_tensor and friends.
class StateBuffer {
 public:
  StateBuffer(StateView view, py::object owner) : view_(std::move(view)), owner_(std::move(owner)) {}
  py::tuple shape() const { return py::cast(view_.shape); }
  py::tuple strides() const { return py::cast(view_.strides); }
  std::uintptr_t data_ptr() const { return reinterpret_cast<std::uintptr_t>(view_.data); }
  std::string dtype() const { return DTypeName(view_.dtype); }
  py::dict cuda_array_interface() const {
    py::dict d;
    d["shape"] = shape();
    d["strides"] = strides();
    d["typestr"] = ArrayTypeStr(view_.dtype);
    d["data"] = py::make_tuple(data_ptr(), false);
    d["version"] = 3;
    return d;
  }

 private:
  StateView view_;
  py::object owner_;  // keeps the manager (and its memory) alive
};

py::list CopiesToList(const std::vector<StateCopy>& copies) {
  py::list out;
  for (const StateCopy& c : copies) out.append(py::make_tuple(c.group, c.src, c.dst));
  return out;
}

bool PolicyBool(const py::dict& d, const char* key, bool fallback) {
  if (!d.contains(key)) return fallback;
  const py::handle v = d[key];
  if (!py::isinstance<py::bool_>(v)) ThrowInvalid("checkpoint_policy['", key, "'] must be a bool");
  return v.cast<bool>();
}

std::int32_t PolicyInt(const py::dict& d, const char* key) {
  if (!d.contains(key)) return 0;
  const py::handle v = d[key];
  if (py::isinstance<py::bool_>(v) || !py::isinstance<py::int_>(v)) ThrowInvalid("checkpoint_policy['", key, "'] must be an int");
  const auto x = v.cast<std::int64_t>();
  if (x < 0 || x > INT32_MAX) ThrowInvalid("checkpoint_policy['", key, "'] must be in 0..2**31-1, got ", x);
  return static_cast<std::int32_t>(x);
}

}  // namespace

void ParseStateArgs(const py::handle& recurrent_layers, std::int64_t state_slots, std::int64_t state_secondary_slots,
                    const py::handle& checkpoint_policy, ModelSpec* model, ManagerConfig* config) {
  if (state_slots < 0 || state_slots > INT32_MAX) ThrowInvalid("state_slots must be in 0..2**31-1, got ", state_slots);
  if (state_secondary_slots < 0 || state_secondary_slots > INT32_MAX) {
    ThrowInvalid("state_secondary_slots must be in 0..2**31-1, got ", state_secondary_slots);
  }
  config->state_slots = static_cast<std::int32_t>(state_slots);
  config->state_secondary_slots = static_cast<std::int32_t>(state_secondary_slots);
  std::size_t l = 0;
  for (const py::handle layer : recurrent_layers) {
    std::vector<StateTensorSpec> tensors;
    for (const py::handle t : layer) {
      const py::tuple pair = py::reinterpret_borrow<py::object>(t).cast<py::tuple>();
      if (pair.size() != 2) ThrowInvalid("recurrent_layers[", l, "]: each state tensor is a (shape, dtype) pair");
      StateTensorSpec spec;
      for (const py::handle d : pair[0]) {
        if (py::isinstance<py::bool_>(d) || !py::isinstance<py::int_>(d)) {
          ThrowInvalid("recurrent_layers[", l, "]: shape entries must be ints");
        }
        spec.shape.push_back(d.cast<std::int64_t>());
      }
      spec.dtype = ParseDType(pair[1].cast<std::string>());
      tensors.push_back(std::move(spec));
    }
    model->recurrent_layers.push_back(std::move(tensors));
    ++l;
  }
  if (!checkpoint_policy.is_none()) {
    if (!py::isinstance<py::dict>(checkpoint_policy)) ThrowInvalid("checkpoint_policy must be a dict");
    const py::dict d = py::reinterpret_borrow<py::dict>(checkpoint_policy);
    for (const auto& kv : d) {
      const std::string k = py::str(kv.first);
      if (k != "prompt_end" && k != "finish" && k != "junction" && k != "chunk_end" && k != "interval_blocks" &&
          k != "max_per_path") {
        ThrowInvalid("checkpoint_policy: unknown key '", k,
                     "' (known: prompt_end, finish, junction, chunk_end, interval_blocks, max_per_path)");
      }
    }
    CheckpointPolicy& p = config->checkpoint_policy;
    p.prompt_end = PolicyBool(d, "prompt_end", p.prompt_end);
    p.finish = PolicyBool(d, "finish", p.finish);
    p.junction = PolicyBool(d, "junction", p.junction);
    p.chunk_end = PolicyBool(d, "chunk_end", p.chunk_end);
    p.interval_blocks = PolicyInt(d, "interval_blocks");
    p.max_per_path = PolicyInt(d, "max_per_path");
  }
}

void AddStateStats(const KvCacheStats& s, py::dict* d) {
  (*d)["state_slots"] = s.state_slots;
  (*d)["working_state_slots"] = s.working_state_slots;
  (*d)["pending_checkpoints"] = s.pending_checkpoints;
  (*d)["cached_checkpoints"] = s.cached_checkpoints;
  (*d)["free_state_slots"] = s.free_state_slots;
  (*d)["checkpoints_stored"] = s.checkpoints_stored;
  (*d)["checkpoints_restored"] = s.checkpoints_restored;
  (*d)["checkpoints_skipped"] = s.checkpoints_skipped;
  (*d)["checkpoints_evicted"] = s.checkpoints_evicted;
  (*d)["checkpoints_offloaded"] = s.checkpoints_offloaded;
  (*d)["checkpoints_onboarded"] = s.checkpoints_onboarded;
  (*d)["host_cached_checkpoints"] = s.host_cached_checkpoints;
  (*d)["lost_hit_tokens_attention"] = s.lost_hit_tokens_attention;
  (*d)["lost_hit_tokens_sliding_window"] = s.lost_hit_tokens_sliding_window;
  (*d)["lost_hit_tokens_no_checkpoint"] = s.lost_hit_tokens_no_checkpoint;
}

void BindState(py::module_& m) {
  py::class_<StateBuffer>(m, "StateBuffer", "Strided view of one recurrent state tensor on device memory "
                                            "(__cuda_array_interface__ producer).")
      .def_property_readonly("shape", &StateBuffer::shape)
      .def_property_readonly("strides", &StateBuffer::strides, "Strides in bytes.")
      .def_property_readonly("data_ptr", &StateBuffer::data_ptr)
      .def_property_readonly("dtype", &StateBuffer::dtype)
      .def_property_readonly("__cuda_array_interface__", &StateBuffer::cuda_array_interface);

  auto cls = py::reinterpret_borrow<py::class_<M>>(m.attr("KVCacheManager"));
  cls.def_property_readonly("num_state_groups", &M::num_state_groups)
      .def_property_readonly(
          "group_kinds",
          [](const M& self) {
            py::list out;
            for (std::size_t w = 0; w < self.window_sizes().size(); ++w) {
              const AttentionKind& k = self.window_kind(w);
              out.append(py::make_tuple(k.name(), k.ReleasesBlocks() ? py::cast(k.window()) : py::none()));
            }
            for (std::size_t g = 0; g < self.num_state_groups(); ++g) {
              out.append(py::make_tuple(GroupKindName(GroupKindId::kRecurrentState), py::none()));
            }
            return out;
          },
          "(kind, sliding window or None) of every group: the windows in window_sizes order "
          "('full_attention', 'sliding_window'), then the state groups ('recurrent_state').")
      .def(
          "state_groups",
          [](const M& self) {
            py::list out;
            for (const StateGroupInfo& g : self.state_groups()) {
              py::dict d;
              d["layers"] = g.layers;
              py::list tensors;
              for (const StateTensorSpec& t : g.tensors) tensors.append(py::make_tuple(py::cast(t.shape), DTypeName(t.dtype)));
              d["tensors"] = tensors;
              d["slot_bytes"] = g.slot_bytes;
              d["num_slots"] = g.num_slots;
              d["num_secondary"] = g.num_secondary;
              d["ptr"] = g.ptr;
              out.append(d);
            }
            return out;
          },
          "One dict per state group (recurrent layers with identical state tensors): layers, tensors "
          "[(shape, dtype)], slot_bytes, num_slots, ptr.")
      .def(
          "get_state_slot", [](const M& self, RequestId id, std::int32_t group) { return self.GetStateSlot(id, group); },
          py::arg("request_id"), py::arg("group") = 0, "The working state slot of a registered sequence.")
      .def(
          "get_state_view",
          [](py::object self_obj, std::int32_t layer, std::int32_t tensor) -> py::object {
            const M& self = self_obj.cast<const M&>();
            StateView v = self.GetStateView(layer, tensor);
            if (v.backend == BackendKind::kHost) {
              std::vector<py::ssize_t> shape(v.shape.begin(), v.shape.end());
              std::vector<py::ssize_t> strides(v.strides.begin(), v.strides.end());
              return py::array(py::dtype(NumpyDTypeName(v.dtype)), shape, strides, v.data, self_obj);
            }
            return py::cast(StateBuffer(std::move(v), self_obj));
          },
          py::arg("layer"), py::arg("tensor"),
          "State tensor `tensor` of recurrent layer `layer` over every slot, [num_slots, *shape]: a numpy "
          "array on the host backend (bfloat16 as uint16 bits), a StateBuffer on CUDA.")
      .def(
          "take_state_copies",
          [](M& self) {
            std::vector<StateCopy> after;
            self.TakeStateCopies(&after);
            return CopiesToList(after);
          },
          "The checkpoint copies (group, src_slot, dst_slot) the engine makes after this step's forward pass "
          "(working state into checkpoint slot); forgets them.")
      .def(
          "save_checkpoints",
          [](M& self) {
            py::gil_scoped_release release;
            return self.SaveCheckpoints();
          },
          "Makes the checkpoint copies itself (after the forward pass); returns how many.")
      .def(
          "get_chunk_limit",
          [](const M& self, RequestId id, std::int32_t num_tokens) { return self.GetChunkLimit(id, num_tokens); },
          py::arg("request_id"), py::arg("num_tokens"),
          "The largest next prefill chunk (<= num_tokens) that does not straddle a checkpoint to take.")
      .def(
          "get_prompt_chunk_limit",
          [](const M& self, const PreparedPrompt& prompt, std::int32_t num_tokens) {
            return self.GetPromptChunkLimit(prompt, num_tokens);
          },
          py::arg("prompt"), py::arg("num_tokens"), "get_chunk_limit for the first chunk of a prepared prompt.")
      .def(
          "get_reusable_by_kind",
          [](const M& self, const PreparedPrompt& prompt) {
            const ReusableByKind r = self.GetReusableByKind(prompt);
            py::dict d;
            d["matched"] = r.matched;
            d["full_attention"] = r.full_attention;
            d["sliding_window"] = r.sliding_window;
            d["recurrent_state"] = r.recurrent_state;
            d["reused"] = r.reused;
            return d;
          },
          py::arg("prompt"),
          "How far each kind of group could resume a prepared prompt now: matched, full_attention, "
          "sliding_window, recurrent_state, reused (tokens).");
}

}  // namespace kvcache::py
