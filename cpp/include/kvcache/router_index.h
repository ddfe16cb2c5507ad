// A router's index of what every engine of a fleet caches, fed by the engines' KV events
// (vLLM's KVEventBatch wire format, either event form), and the lookup that predicts, for one
// prompt, how many of its tokens every engine would reuse: exactly what each engine's own
// KVCacheManager::GetReusablePrefixLength returns (without partial reuse), sliding windows,
// recurrent state groups and the fleet's shared store included. kvcache.router.KvIndexer is
// its Python face; docs/design.md ("The router index") gives the rule and the layout.
//
// Layout: one hash table for all engines, keyed by (group_idx, block hash); an entry holds the
// set of engines that hold that block in that group (a bitset over engine slots) and, per
// holder, the set of media it holds the block on. The shared store is one set keyed by
// (block_size, window, block hash). A lookup walks the prompt's blocks once for every engine
// and stops at the first block that no engine still matching holds in a full-attention group.
//
// Thread-safe: lookups share a lock, event application and the other changes take it alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kvcache/block_key.h"
#include "kvcache/types.h"

namespace kvcache {

/// A block hash as events carry it: an int in [-2**63, 2**64) or anything else (bytes, a
/// larger int), which the index interns. `opaque` is the interned form's bytes (kind kOpaque):
/// a tag byte ('b' bytes, 'i' an int's decimal digits) then the payload.
struct RouterHash {
  enum Kind : std::uint8_t { kUnsigned = 0, kNegative = 1, kOpaque = 2 };
  std::uint64_t value = 0;  ///< kUnsigned: the value; kNegative: the int64's bits.
  Kind kind = kUnsigned;
  std::string opaque;  ///< kOpaque only.
};

/// One KV event, fields as the index reads them (already validated: see RouterIndex).
struct RouterEvent {
  enum Type : std::uint8_t { kStored = 0, kRemoved = 1, kCleared = 2 };

  Type type = kCleared;
  std::vector<RouterHash> hashes;
  std::uint64_t group_idx = 0;        ///< None on the wire is 0.
  std::optional<std::string> medium;  ///< None: nil (a removal of every copy).
  std::uint64_t block_size = 0;       ///< BlockStored only.
  std::optional<std::string> spec_kind;
  std::uint64_t sliding_window = 0;  ///< Tokens; read only when spec_kind is "sliding_window".
  std::optional<std::string> lora_name;
  bool has_lora_id = false;
  bool lora_id_unsigned = false;  ///< lora_id >= 2**63 (held as its uint64 bits).
  std::int64_t lora_id = 0;
};

/// Decodes one raw msgpack KVEventBatch (vLLM's wire format) into events, validated whole:
/// std::invalid_argument naming the event and field, or the payload that is no msgpack batch
/// (router_events_msgpack.cpp).
std::vector<RouterEvent> DecodeRouterEventBatch(const char* data, std::size_t size);

/// The key of a lookup (what the prompt's block hashes are chained with).
struct RouterLookupKey {
  std::optional<std::string> lora_name;  ///< Resolved per engine through its events.
  std::optional<std::int64_t> lora_id;   ///< Used when lora_name is not set.
  std::optional<std::uint64_t> cache_salt;
  std::vector<MultimodalItem> multimodal;
};

/// Blocks the index believes the shared store holds for one (block_size, window).
struct RouterSharedCount {
  std::uint64_t block_size = 0;
  std::optional<std::uint64_t> window;  ///< nullopt: full attention.
  std::int64_t blocks = 0;
};

class RouterIndex {
 public:
  /// Engine slot meaning "not registered yet" for the Apply calls.
  static constexpr std::int32_t kNewEngine = -1;
  /// The medium name of the fleet's shared store.
  static constexpr const char* kSharedStorage = "SHARED_STORAGE";
  /// Distinct medium names (besides nil) an index tells apart.
  static constexpr int kMaxMedia = 63;

  /// An empty index; `shared_tier`: whether engines read the shared store unless declared.
  explicit RouterIndex(bool shared_tier = false);

  // ---- Engines. A slot names an engine; freed slots are reused. Slots are in [0, 2**31).
  /// Registers a new engine (no blocks) and returns its slot.
  std::int32_t AddEngine();
  /// Declares whether the engine reads the shared store (nullopt: keep what is known).
  void SetSharedTier(std::int32_t slot, std::optional<bool> shared_tier);
  bool ReadsSharedTier(std::int32_t slot) const;
  /// Forgets an engine: its blocks, groups and LoRA names (not the store's blocks).
  void RemoveEngine(std::int32_t slot);
  /// The live engines' slots in the order they were registered.
  std::vector<std::int32_t> Engines() const;
  /// Blocks held per group (group_idx, blocks), in the order the engine's groups appeared.
  std::vector<std::pair<std::uint64_t, std::int64_t>> NumBlocks(std::int32_t slot) const;

  // ---- The shared store.
  /// Non-empty (block_size, window) sets of the store, in the order they appeared.
  std::vector<RouterSharedCount> NumSharedBlocks() const;
  /// Forgets these blocks of every store set of `window` (nullopt: full attention); returns
  /// how many distinct ones it held.
  std::int64_t RemoveSharedBlocks(const std::vector<RouterHash>& hashes, std::optional<std::uint64_t> window);
  /// Forgets every block of the store (the store's group layout and LoRA names stay).
  void ClearSharedTier();

  // ---- Events. Both validate the whole batch first; a bad one throws std::invalid_argument
  // (naming the event's index and the field, as kvcache.router words it) and changes nothing,
  // an engine included. `slot` kNewEngine registers the engine once the batch is valid. Both
  // return the engine's slot.
  /// One raw msgpack KVEventBatch ([ts, events, rank]; events as tagged maps or arrays).
  std::int32_t ApplyMsgpack(std::int32_t slot, const char* data, std::size_t size);
  /// Events already decoded and validated (by the caller).
  std::int32_t ApplyEvents(std::int32_t slot, const std::vector<RouterEvent>& events);

  // ---- Lookups.
  /// Every listed engine's reusable prefix (tokens) for `tokens` (all live engines in
  /// registration order when `slots` is null), as KvIndexer.match defines it. Throws
  /// std::invalid_argument for an engine whose groups have different block sizes (or one the
  /// hashing refuses), std::out_of_range for a slot that is not a live engine.
  std::vector<std::int64_t> Scores(const TokenId* tokens, std::size_t num_tokens, const RouterLookupKey& key,
                                   const std::vector<std::int32_t>* slots) const;

  /// Distinct (group_idx, hash) entries of the table (for tests and benchmarks).
  std::size_t NumEntries() const;
  /// Interned non-int hashes still referenced (for tests: they are released with their
  /// entries).
  std::size_t NumInterned() const;

 private:
  struct Key {
    std::uint64_t space;  // group_idx (engines' table) or store set index (store's table)
    std::uint64_t value;
    std::uint8_t kind;
    bool operator==(const Key& o) const { return space == o.space && value == o.value && kind == o.kind; }
  };
  struct KeyHash {
    std::size_t operator()(const Key& k) const noexcept;
  };
  /// The engines holding one block: a bitset over slots (`nwords` words), then one media mask
  /// per set bit, in slot order.
  struct Entry {
    std::uint32_t nwords = 0;
    std::vector<std::uint64_t> data;
    bool Has(std::int32_t slot) const {
      const auto w = static_cast<std::uint32_t>(slot) / 64;
      return w < nwords && ((data[w] >> (static_cast<std::uint32_t>(slot) % 64)) & 1U) != 0;
    }
    std::uint64_t Word(std::uint32_t w) const { return w < nwords ? data[w] : 0; }
    std::size_t Rank(std::int32_t slot) const;
    /// Adds `media` to the slot's mask (adding the slot if absent); returns whether it was new.
    bool Add(std::int32_t slot, std::uint64_t media);
    /// Removes the slot; returns whether the entry is now empty.
    bool Erase(std::int32_t slot);
    std::uint64_t& Media(std::int32_t slot) { return data[nwords + Rank(slot)]; }
  };
  struct Group {
    std::uint64_t idx = 0;
    std::uint64_t block_size = 0;
    std::optional<std::uint64_t> window;  // nullopt: full attention (or a recurrent group)
    bool recurrent = false;
    std::int64_t blocks = 0;
  };
  struct LoraId {
    bool is_unsigned = false;
    std::int64_t value = 0;
  };
  struct Engine {
    bool live = false;
    std::optional<bool> shared_tier;
    std::vector<Group> groups;  // in the order they appeared
    std::unordered_map<std::string, LoraId> lora_ids;
  };
  struct SharedSet {
    std::uint64_t block_size = 0;
    std::optional<std::uint64_t> window;
    std::int64_t blocks = 0;
  };
  struct SharedSpec {
    std::uint64_t block_size = 0;
    std::optional<std::uint64_t> window;
  };
  struct Interned {
    std::uint64_t id = 0;
    std::int64_t refs = 0;
  };

  std::int32_t AddEngineLocked();
  std::int32_t ApplyLocked(std::int32_t slot, const std::vector<RouterEvent>& events);
  void ApplyOne(std::int32_t slot, const RouterEvent& e);
  void ApplyShared(std::int32_t slot, const RouterEvent& e);
  Group* FindGroup(Engine& engine, std::uint64_t idx);
  bool ReadsShared(const Engine& engine) const;
  Engine& Live(std::int32_t slot);
  const Engine& Live(std::int32_t slot) const;
  std::uint64_t MediumId(const std::optional<std::string>& medium);
  /// A hash as a table key: `intern` registers an opaque hash (one more reference), else an
  /// opaque hash never seen gives false.
  bool ToKey(const RouterHash& h, std::uint64_t space, bool intern, Key* key);
  void Release(const Key& key);
  std::optional<std::size_t> FindSharedSet(std::uint64_t block_size, const std::optional<std::uint64_t>& window) const;

  mutable std::shared_mutex mu_;
  bool shared_default_;
  std::vector<Engine> engines_;     // by slot
  std::vector<std::int32_t> order_;  // live slots, in registration order
  std::unordered_map<Key, Entry, KeyHash> table_;
  std::vector<std::string> media_;  // medium id - 1 -> name
  std::unordered_map<std::string, Interned> interned_;
  std::unordered_map<std::uint64_t, std::string> interned_names_;
  std::uint64_t next_interned_ = 0;
  // The store: its sets (in the order they appeared), their blocks, its group layout (in the
  // order its groups appeared) and the LoRA names its events carried.
  std::vector<SharedSet> shared_sets_;
  std::unordered_set<Key, KeyHash> shared_;
  std::vector<std::pair<std::uint64_t, SharedSpec>> shared_groups_;
  std::unordered_map<std::string, LoraId> shared_lora_ids_;
};

}  // namespace kvcache
