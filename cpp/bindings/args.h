// Argument conversion shared by the binding translation units: the name and range of every
// integer parameter, and the conversions of token lists, request-id lists, block counts and
// reuse keys. Conversion only: no call into the manager happens here.
#pragma once

#include "init_guard.h"  // first: the guarded type casters must precede every use

#include <pybind11/pybind11.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "int_arg.h"
#include "kvcache/types.h"
#include "kvcache/kv_cache_manager.h"
#include "kvcache/prepared_prompt.h"

namespace kvcache::py {

// ---- Integer parameters: the name and range of each ----------------------------------------
// Ranges are what the C++ type and the argument's meaning allow; the core checks the rest
// (a known window, a registered id, a prompt that fits max_seq_len, ...).

inline constexpr char kRequestId[] = "request_id";
inline constexpr char kToken[] = "token";
inline constexpr char kPriority[] = "priority";
inline constexpr char kDecodePriority[] = "decode_priority";
inline constexpr char kDecodeDurationMs[] = "decode_duration_ms";
inline constexpr char kLoraTaskId[] = "lora_task_id";
inline constexpr char kCacheSalt[] = "cache_salt";
inline constexpr char kMultimodalHash[] = "multimodal content_hash";
inline constexpr char kMultimodalStart[] = "multimodal start";
inline constexpr char kMultimodalLength[] = "multimodal length";
inline constexpr char kRangeStart[] = "priority_ranges start";
inline constexpr char kRangeEnd[] = "priority_ranges end";
inline constexpr char kRangePriority[] = "priority_ranges priority";
inline constexpr char kRangeDurationMs[] = "priority_ranges duration_ms";
inline constexpr char kNumTokens[] = "num_tokens";
inline constexpr char kPrefill[] = "prefill";
inline constexpr char kWindowSize[] = "window_size";
inline constexpr char kBlockIds[] = "block_ids";
inline constexpr char kSlotOffset[] = "slot_offset";
inline constexpr char kTimeoutMs[] = "timeout_ms";
inline constexpr char kNowMs[] = "now_ms";
inline constexpr char kLayerIdx[] = "layer_idx";
inline constexpr char kNumLayers[] = "num_layers";
inline constexpr char kNumKvHeads[] = "num_kv_heads";
inline constexpr char kHeadDim[] = "head_dim";
inline constexpr char kHeadDims[] = "head_dims";
inline constexpr char kKvFactor[] = "kv_factor";
inline constexpr char kTokensPerBlock[] = "tokens_per_block";
inline constexpr char kMaxAttentionWindow[] = "max_attention_window";
inline constexpr char kMaxSeqLen[] = "max_seq_len";
inline constexpr char kMaxBatchSize[] = "max_batch_size";
inline constexpr char kBlocksPerWindowKey[] = "blocks_per_window window";
inline constexpr char kBlocksPerWindowCount[] = "blocks_per_window count";
inline constexpr char kMaxDraftTokens[] = "max_draft_tokens";
inline constexpr char kOffloadMinPriority[] = "secondary_offload_min_priority";
inline constexpr char kEventBufferMaxSize[] = "event_buffer_max_size";
inline constexpr char kDiskBlocksKey[] = "disk_blocks_per_window window";
inline constexpr char kDiskBlocksCount[] = "disk_blocks_per_window count";
inline constexpr char kSharedCacheTimeoutMs[] = "shared_cache_timeout_ms";
inline constexpr char kSharedCacheQueueBytes[] = "shared_cache_queue_bytes";
inline constexpr char kNeedWindow[] = "blocks window";
inline constexpr char kNeedCount[] = "blocks count";

using RequestId = Int<SeqId, kRequestId, 0>;  // API: 0 <= id < 2**63
using AnyRequestId = Int<SeqId, kRequestId>;  // has_sequence: a negative id is simply not there
using Token = Int<TokenId, kToken, 0>;
using Priority = Int<int, kPriority, kMinPriority, kMaxPriority>;
using DecodePriority = Int<int, kDecodePriority, kMinPriority, kMaxPriority>;
using DecodeDurationMs = Int<std::int64_t, kDecodeDurationMs, 0>;
using LoraTaskId = Int<std::int64_t, kLoraTaskId>;
using CacheSalt = Int<std::uint64_t, kCacheSalt>;
using MultimodalArg = std::tuple<Int<std::uint64_t, kMultimodalHash>, Int<std::int32_t, kMultimodalStart, 0>,
                                 Int<std::int32_t, kMultimodalLength, 0>>;
using PriorityRangeArg = std::tuple<Int<std::int32_t, kRangeStart, 0>, Int<std::int32_t, kRangeEnd, -1>,
                                    Int<int, kRangePriority, kMinPriority, kMaxPriority>,
                                    Int<std::int64_t, kRangeDurationMs, 0>>;
using NumTokens = Int<std::int32_t, kNumTokens, 0>;
using PrefillArg = Int<std::int32_t, kPrefill, 1>;
using ChunkTokens = Int<std::int32_t, kNumTokens, 1>;
using WindowSizeArg = Int<WindowSize, kWindowSize, 1>;
using BlockIdArg = Int<BlockId, kBlockIds, 0>;
using SlotOffset = Int<std::int64_t, kSlotOffset, 0>;
using TimeoutMs = Int<std::int64_t, kTimeoutMs, 0>;
using NowMs = Int<std::int64_t, kNowMs>;
using LayerIdx = Int<std::int32_t, kLayerIdx, 0>;
using NumLayers = Int<std::int32_t, kNumLayers, 1>;
using NumKvHeads = Int<std::int32_t, kNumKvHeads, 1>;
using HeadDim = Int<std::int32_t, kHeadDim, 1>;
using LayerHeadDim = Int<std::int32_t, kHeadDims, 1>;
using KvFactor = Int<std::int32_t, kKvFactor, 1, 2>;
using TokensPerBlock = Int<std::int32_t, kTokensPerBlock, 1>;
using AttentionWindow = Int<std::int32_t, kMaxAttentionWindow>;  // <= 0: full attention
using MaxSeqLen = Int<std::int32_t, kMaxSeqLen, 1>;
using MaxBatchSize = Int<std::int32_t, kMaxBatchSize, 0>;
using BlocksPerWindow = std::map<Int<WindowSize, kBlocksPerWindowKey, 1>,
                                 std::pair<Int<std::int32_t, kBlocksPerWindowCount, 0>,
                                           Int<std::int32_t, kBlocksPerWindowCount, 0>>>;
using MaxDraftTokens = Int<std::int32_t, kMaxDraftTokens, 0>;
using OffloadMinPriority = Int<int, kOffloadMinPriority, kMinPriority, kMaxPriority>;
using EventBufferMaxSize = Int<std::size_t, kEventBufferMaxSize>;
using DiskBlocksPerWindow = std::map<Int<WindowSize, kDiskBlocksKey, 1>, Int<std::int32_t, kDiskBlocksCount, 0>>;
using SharedCacheTimeoutMs = Int<std::int32_t, kSharedCacheTimeoutMs, 1>;
using SharedCacheQueueBytes = Int<std::int64_t, kSharedCacheQueueBytes, 0>;
using BlocksNeeded = std::map<Int<WindowSize, kNeedWindow, 1>, Int<std::int32_t, kNeedCount>>;

template <typename T, const char* Name, T Lo, T Hi>
std::optional<T> Unwrap(const std::optional<Int<T, Name, Lo, Hi>>& arg) {
  if (!arg.has_value()) return std::nullopt;
  return arg->value;
}

/// can_allocate / fits_when_empty: {window: blocks} with every key and count range-checked;
/// anything but a dict raises ValueError.
std::map<WindowSize, std::int32_t> ToBlocksNeeded(const pybind11::handle& blocks);

/// Block ids (each in [0, 2**31)) from a 1-D integer ndarray or a sequence of ints; anything
/// else raises ValueError naming block_ids.
std::vector<BlockId> ToBlockIds(const pybind11::handle& obj);

/// unpin_blocks_by_id's dict form, {window: [block ids]} as pin_blocks returns it, checked the
/// same way (ValueError naming the bad key or item).
std::map<WindowSize, std::vector<BlockId>> ToPinnedBlocks(const pybind11::handle& obj);

/// Request ids from a 1-D integer ndarray or a sequence of ints into *ids; each must be in
/// [0, 2**63).
void ToRequestIds(const pybind11::handle& obj, const char* what, std::vector<SeqId>* ids);
std::vector<SeqId> ToRequestIds(const pybind11::handle& obj, const char* what);

/// Chunk sizes (prefill's num_tokens, each in [1, 2**31)) from a 1-D integer ndarray or a
/// sequence of ints into *out.
void ToChunkSizes(const pybind11::handle& obj, const char* what, std::vector<std::int32_t>* out);

/// Whether a per-step argument names a batch (a list, tuple, 1-D array or other sequence of
/// ints) rather than one request (an int, or an object with __index__).
bool IsBatchArg(PyObject* obj);

/// Token ids from a 1-D integer ndarray (int32/int64 read in place) or a sequence of ints into
/// *out.
void ToTokens(const pybind11::handle& obj, const char* what, std::vector<TokenId>* out);
std::vector<TokenId> ToTokens(const pybind11::handle& obj, const char* what);

/// The window a call names, or the only window when it names none.
WindowSize ResolveWindow(const KVCacheManager& self, const std::optional<WindowSize>& window);

ReuseExtras MakeExtras(const std::optional<LoraTaskId>& lora_task_id, const std::optional<CacheSalt>& cache_salt,
                       const std::vector<MultimodalArg>& multimodal);

/// The PreparedPrompt passed where tokens go (its shared holder, which a sequence keeps instead
/// of copying the prompt), or null. Its reuse keys are fixed, so passing lora_task_id,
/// cache_salt or multimodal as well is a mistake.
std::shared_ptr<const PreparedPrompt> AsPrepared(const pybind11::handle& tokens,
                                                 const std::optional<LoraTaskId>& lora_task_id,
                                                 const std::optional<CacheSalt>& cache_salt,
                                                 const std::vector<MultimodalArg>& multimodal);

/// numpy's dtype name for a KV or state element (bfloat16 and fp8 as their raw bits).
std::string NumpyDTypeName(DType dtype);
/// The array interface's type string (`__cuda_array_interface__`) for the same element.
std::string ArrayTypeStr(DType dtype);

}  // namespace kvcache::py
