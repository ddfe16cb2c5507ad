// The per-step methods of KVCacheManager, on the vectorcall protocol (see fast_method.h): what an
// engine calls for every request or every step. Everything else is bound in bind_manager.cpp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "fast_method.h"  // first: it brings the KVCacheManager type caster
#include "args.h"
#include "bindings.h"
#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"

namespace kvcache::py {
namespace {

using M = KVCacheManager;

/// An optional integer argument: absent or None is nullopt.
template <typename Arg>
auto ReadOptional(PyObject* obj) -> std::optional<decltype(Arg::Read(obj))> {
  if (obj == nullptr || obj == Py_None) return std::nullopt;
  return Arg::Read(obj);
}

PyObject* NewInt(long long v) {
  PyObject* out = PyLong_FromLongLong(v);
  if (out == nullptr) throw pybind11::error_already_set();
  return out;
}

PyObject* NewBool(bool v) { return pybind11::bool_(v).release().ptr(); }

PyObject* NewNone() { return pybind11::none().release().ptr(); }

/// {window: count} as a new dict.
PyObject* NewCountDict(const std::map<WindowSize, std::int32_t>& counts) {
  pybind11::dict out;
  for (const auto& [w, n] : counts) {
    const pybind11::object key = pybind11::reinterpret_steal<pybind11::object>(NewInt(w));
    const pybind11::object value = pybind11::reinterpret_steal<pybind11::object>(NewInt(n));
    if (PyDict_SetItem(out.ptr(), key.ptr(), value.ptr()) != 0) throw pybind11::error_already_set();
  }
  return out.release().ptr();
}

PyObject* Prefill(M& self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
  static constexpr FastParams<2> kParams{"prefill", {"request_id", "num_tokens"}, 2, 2};
  const auto a = ParseArgs(kParams, args, nargsf, kwnames);
  if (!IsBatchArg(a[0])) {
    const SeqId id = RequestId::Read(a[0]);
    const std::int32_t num_tokens = ChunkTokens::Read(a[1]);
    WithoutGilIf(self.MayCopyBlocks(), [&] { self.Prefill(id, num_tokens); });
    return NewNone();
  }
  // A step's chunks at once. Per-thread buffers, as in add_tokens.
  thread_local std::vector<SeqId> ids;
  thread_local std::vector<std::int32_t> counts;
  ToRequestIds(a[0], "request_id", &ids);
  if (!IsBatchArg(a[1])) ThrowInvalid("prefill: with a list of request ids, num_tokens must be a list as long");
  ToChunkSizes(a[1], "num_tokens", &counts);
  if (ids.size() != counts.size()) {
    ThrowInvalid("prefill: ", ids.size(), " request ids but ", counts.size(), " num_tokens");
  }
  WithoutGilIf(self.MayCopyBlocks(), [&] { self.Prefill(ids.data(), counts.data(), ids.size()); });
  return NewNone();
}

PyObject* StoreContextBlocks(M& self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
  static constexpr FastParams<1> kParams{"store_context_blocks", {"request_id"}, 1, 1};
  const auto a = ParseArgs(kParams, args, nargsf, kwnames);
  if (!IsBatchArg(a[0])) return NewInt(self.StoreContextBlocks(RequestId::Read(a[0])));  // never copies
  thread_local std::vector<SeqId> ids;
  ToRequestIds(a[0], "request_id", &ids);
  return NewInt(self.StoreContextBlocks(ids.data(), ids.size()));
}

PyObject* NumTokensOf(M& self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
  static constexpr FastParams<1> kParams{"num_tokens", {"request_id"}, 1, 1};
  const auto a = ParseArgs(kParams, args, nargsf, kwnames);
  return NewInt(self.NumTokens(RequestId::Read(a[0])));
}

PyObject* PromptLength(M& self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
  static constexpr FastParams<1> kParams{"prompt_length", {"request_id"}, 1, 1};
  const auto a = ParseArgs(kParams, args, nargsf, kwnames);
  return NewInt(self.PromptLength(RequestId::Read(a[0])));
}

PyObject* RemoveSequence(M& self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
  static constexpr FastParams<3> kParams{"remove_sequence", {"request_id", "store_for_reuse", "pin"}, 1, 1};
  const auto a = ParseArgs(kParams, args, nargsf, kwnames);
  const SeqId id = RequestId::Read(a[0]);
  const bool store = a[1] == nullptr || ReadBool(a[1], "store_for_reuse");
  const bool pin = a[2] != nullptr && ReadBool(a[2], "pin");
  // Storing and releasing never copy: bookkeeping proportional to the sequence's blocks.
  const std::map<WindowSize, std::vector<BlockId>> pinned = self.RemoveSequence(id, store, pin);
  if (!pin) return NewNone();
  return pybind11::cast(pinned).release().ptr();
}

PyObject* RefreshBlocks(M& self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
  static constexpr FastParams<0> kParams{"refresh_blocks", {}, 0, 0};
  ParseArgs(kParams, args, nargsf, kwnames);
  WithoutGilIf(self.MayCopyBlocks(), [&] { self.RefreshBlocks(); });  // waits for pending copies
  return NewNone();
}

PyObject* CanAllocate(M& self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
  static constexpr FastParams<1> kParams{"can_allocate", {"blocks"}, 1, 1};
  const auto a = ParseArgs(kParams, args, nargsf, kwnames);
  return NewBool(self.CanAllocate(ToBlocksNeeded(a[0])));
}

PyObject* AddTokens(M& self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
  static constexpr FastParams<2> kParams{"add_tokens", {"request_ids", "tokens"}, 2, 2};
  const auto a = ParseArgs(kParams, args, nargsf, kwnames);
  // Per-thread buffers: a decode step allocates nothing here (AddTokens runs no Python code, so
  // nothing can reenter and reuse them meanwhile).
  thread_local std::vector<SeqId> ids;
  thread_local std::vector<TokenId> toks;
  ToRequestIds(a[0], "request_ids", &ids);
  ToTokens(a[1], "tokens", &toks);
  if (ids.size() != toks.size()) ThrowInvalid("add_tokens: ", ids.size(), " request ids but ", toks.size(), " tokens");
  WithoutGilIf(self.MayCopyBlocks(), [&] { self.AddTokens(ids.data(), toks.data(), ids.size()); });
  return NewNone();
}

PyObject* AddGenerated(M& self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
  // The list form of a decode step in one call: checks every generation request's cached length
  // against its generated tokens (bases[i] + len(generated[i]) = num_tokens, bases[i] being its
  // prompt length less one) and appends each one's newest token, generated[i][-1]. Reads the
  // lists in place; returns -1 once added, else the first index that failed a check (nothing
  // added: the caller checks request by request, which names the error).
  static constexpr FastParams<3> kParams{"_add_generated", {"request_ids", "generated", "bases"}, 3, 3};
  const auto a = ParseArgs(kParams, args, nargsf, kwnames);
  thread_local std::vector<SeqId> ids;
  thread_local std::vector<std::int32_t> lengths;
  thread_local std::vector<TokenId> toks;
  ToRequestIds(a[0], "request_ids", &ids);
  PyObject* gens = a[1];
  PyObject* bases = a[2];
  const auto n = static_cast<Py_ssize_t>(ids.size());
  if (!PyList_Check(gens) || !PyList_Check(bases) || PyList_GET_SIZE(gens) != n || PyList_GET_SIZE(bases) != n) {
    ThrowInvalid("_add_generated: request_ids, generated and bases must be lists of equal length");
  }
  lengths.resize(ids.size());
  toks.resize(ids.size());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* g = PyList_GET_ITEM(gens, i);
    PyObject* b = PyList_GET_ITEM(bases, i);
    if (!PyList_Check(g) || PyList_GET_SIZE(g) == 0 || !PyLong_CheckExact(b)) return NewInt(i);
    PyObject* last = PyList_GET_ITEM(g, PyList_GET_SIZE(g) - 1);
    if (!PyLong_CheckExact(last)) return NewInt(i);  // a bool, numpy int, ...: the caller's path
    int overflow = 0;
    const long long base = PyLong_AsLongLongAndOverflow(b, &overflow);
    const long long token = overflow == 0 ? PyLong_AsLongLongAndOverflow(last, &overflow) : 0;
    const long long length = base + static_cast<long long>(PyList_GET_SIZE(g));
    if (overflow != 0 || token < 0 || token > INT32_MAX || length < 0 || length > INT32_MAX) return NewInt(i);
    lengths[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(length);
    toks[static_cast<std::size_t>(i)] = static_cast<TokenId>(token);
  }
  // One lookup per sequence for the check and the append (KVCacheManager::AddTokensIfLengths).
  return NewInt(WithoutGilIf(self.MayCopyBlocks(), [&] {
    return self.AddTokensIfLengths(ids.data(), toks.data(), lengths.data(), ids.size());
  }));
}

PyObject* AddSequencePlain(M& self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
  // The common admission (no priorities, keys from the prompt): few arguments to parse.
  static constexpr FastParams<3> kParams{"_add_sequence_plain", {"request_id", "tokens", "prefill"}, 3, 2};
  const auto a = ParseArgs(kParams, args, nargsf, kwnames);
  const SeqId id = RequestId::Read(a[0]);
  const std::optional<std::int32_t> prefill = ReadOptional<PrefillArg>(a[2]);
  if (std::shared_ptr<const PreparedPrompt> p = AsPrepared(a[1], std::nullopt, std::nullopt, {})) {
    return NewInt(WithoutGilIf(self.MayCopyBlocks(),
                               [&] { return self.AddSequence(id, std::move(p), SequenceOptions{}, prefill); }));
  }
  const std::vector<TokenId> toks = ToTokens(a[1], "tokens");
  // Keys the prompt first: hashing is long enough to release the GIL for.
  return NewInt(WithoutGilIf(true, [&] { return self.AddSequence(id, toks.data(), toks.size(), SequenceOptions{}, prefill); }));
}

PyObject* BlocksToAllocatePlain(M& self, PyObject* const* args, Py_ssize_t nargsf, PyObject* kwnames) {
  static constexpr FastParams<2> kParams{"_blocks_to_allocate_plain", {"tokens", "prefill"}, 2, 1};
  const auto a = ParseArgs(kParams, args, nargsf, kwnames);
  const std::optional<std::int32_t> prefill = ReadOptional<PrefillArg>(a[1]);
  std::map<WindowSize, std::int32_t> need;
  if (const std::shared_ptr<const PreparedPrompt> p = AsPrepared(a[0], std::nullopt, std::nullopt, {})) {
    need = self.GetNumBlocksToAllocate(*p, prefill);  // a lookup: never copies
  } else {
    const std::vector<TokenId> toks = ToTokens(a[0], "tokens");
    pybind11::gil_scoped_release unlocked;  // keys the prompt first
    need = self.GetNumBlocksToAllocate(toks.data(), toks.size(), ReuseExtras{}, prefill);
  }
  return NewCountDict(need);
}

PyMethodDef step_methods[] = {
    FastMethod<Prefill>("prefill",
                        "prefill(self: kvcache._core.KVCacheManager, request_id: object, num_tokens: object) -> "
                        "None\n\n"
                        "Chunked prefill: gives blocks for the next num_tokens prompt tokens, first releasing the "
                        "sliding-window blocks no query of the chunk can attend; all or nothing. With equal-length "
                        "lists, a step's chunks in one call.\n"),
    FastMethod<StoreContextBlocks>(
        "store_context_blocks",
        "store_context_blocks(self: kvcache._core.KVCacheManager, request_id: object) -> int\n\n"
        "Stores the sequence's full prompt blocks for reuse now (a list: each sequence's); returns block positions "
        "newly stored.\n"),
    FastMethod<NumTokensOf>(
        "num_tokens", "num_tokens(self: kvcache._core.KVCacheManager, request_id: typing.SupportsIndex) -> int\n"),
    FastMethod<PromptLength>(
        "prompt_length",
        "prompt_length(self: kvcache._core.KVCacheManager, request_id: typing.SupportsIndex) -> int\n\n"
        "Prompt tokens of the sequence (num_tokens counts those with blocks).\n"),
    FastMethod<RemoveSequence>(
        "remove_sequence",
        "remove_sequence(self: kvcache._core.KVCacheManager, request_id: typing.SupportsIndex, *, store_for_reuse: "
        "bool = True, pin: bool = False) -> object\n\n"
        "Ends a sequence and releases its blocks (stored for reuse first). With pin=True returns the pinned block ids "
        "per window, which unpin_blocks_by_id takes back; else None.\n"),
    FastMethod<RefreshBlocks>("refresh_blocks",
                              "refresh_blocks(self: kvcache._core.KVCacheManager) -> None\n\n"
                              "Once per engine step: expired timed priorities return to the default; pending copies "
                              "complete.\n"),
    FastMethod<CanAllocate>(
        "can_allocate",
        "can_allocate(self: kvcache._core.KVCacheManager, blocks: dict) -> bool\n\n"
        "Whether every window can hand out blocks[window] blocks at once now (windows not named need none; a negative "
        "count is a credit: the window frees that many first); under lend_free_memory the windows compete for the "
        "same lendable memory.\n"),
    FastMethod<AddTokens>("add_tokens",
                          "add_tokens(self: kvcache._core.KVCacheManager, request_ids: object, tokens: object) -> None\n\n"
                          "Appends tokens[i] to request_ids[i] for a whole batch; all or nothing.\n"),
    FastMethod<AddGenerated>("_add_generated",
                             "_add_generated(self: kvcache._core.KVCacheManager, request_ids: object, generated: "
                             "list, bases: list) -> int\n\n"
                             "A decode step's newest tokens from the requests' generated lists: checks each cached "
                             "length (bases[i] + len(generated[i])), then appends each generated[i][-1]; -1 once "
                             "added, else the first index that failed a check (nothing added).\n"),
    FastMethod<AddSequencePlain>("_add_sequence_plain",
                                 "_add_sequence_plain(self: kvcache._core.KVCacheManager, request_id: "
                                 "typing.SupportsIndex, tokens: object, prefill: typing.SupportsIndex | None = None) "
                                 "-> int\n"),
    FastMethod<BlocksToAllocatePlain>("_blocks_to_allocate_plain",
                                      "_blocks_to_allocate_plain(self: kvcache._core.KVCacheManager, tokens: object, "
                                      "prefill: typing.SupportsIndex | None = None) -> dict\n"),
    PyMethodDef{nullptr, nullptr, 0, nullptr},
};

}  // namespace

void BindStepMethods(pybind11::handle manager_class) { AddFastMethods(manager_class, step_methods); }

}  // namespace kvcache::py
