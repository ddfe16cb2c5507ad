// The recurrent-state kind: one pool of fixed-size state slots per group of recurrent layers
// (Mamba, Gated DeltaNet, short convolution), holding each live sequence's working state and the
// checkpoints that prefix reuse resumes from.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kvcache/events.h"
#include "kvcache/memory_backend.h"
#include "kvcache/reuse_tree.h"
#include "kvcache/types.h"

namespace kvcache {

using SlotId = std::int32_t;
inline constexpr SlotId kNoSlot = -1;

/// One state tensor of a recurrent layer, C-contiguous (e.g. conv `(channels, kernel - 1)`, SSM
/// `(heads, head_dim, state)`).
struct StateTensorSpec {
  std::vector<std::int64_t> shape;
  DType dtype = DType::kFloat32;
  std::size_t Bytes() const;
  bool operator==(const StateTensorSpec& o) const { return shape == o.shape && dtype == o.dtype; }
};

/// Where recurrent checkpoints are taken (each costs one slot and one copy of the working state).
struct CheckpointPolicy {
  /// At the last block boundary before a prompt's last token (an identical or longer prompt hits).
  bool prompt_end = true;
  /// At every block boundary a decoding sequence reaches, in one slot per sequence that each
  /// boundary overwrites; stored when the sequence ends (multi-turn chat resumes there). One
  /// state copy per tokens_per_block decoded tokens per sequence. The slot is taken only from
  /// free slots (no cached checkpoint is evicted for it), except at the last boundary of a
  /// sequence whose final length is known.
  bool finish = true;
  /// At the end of the attention prefix a lookup matched past the deepest checkpoint there: the
  /// next request that shares that prefix resumes from it (Marconi-style admission).
  bool junction = true;
  /// At the end of every prefill chunk that ends on a block boundary (vLLM's "align" mode).
  bool chunk_end = false;
  /// Every this many blocks of a prompt (0: off).
  std::int32_t interval_blocks = 0;
  /// Most checkpoints on one root-to-leaf path of a group (0: no cap); storing one more evicts
  /// the shallowest, which saves the least recomputation.
  std::int32_t max_per_path = 0;
};

/// A group of recurrent layers with identical state tensors, and its slot layout: a slot holds
/// every layer of the group, layer after layer, each layer its tensors in order.
struct StateGroupLayout {
  std::vector<std::int32_t> layers;  ///< Recurrent-layer indices (0-based among recurrent layers).
  std::vector<StateTensorSpec> tensors;
  std::vector<std::size_t> tensor_offsets;  ///< Byte offset of each tensor inside one layer.
  std::size_t layer_bytes = 0;
  std::size_t slot_bytes = 0;
};

/// One copy of a whole slot an engine makes: `src` -> `dst` (src == kNoSlot: zero `dst`).
struct StateCopy {
  std::int32_t group = 0;
  SlotId src = kNoSlot;
  SlotId dst = kNoSlot;
};

/// The slots of one state group: free, working (a live sequence's state), pending (a checkpoint a
/// live sequence is writing) or cached (a checkpoint in the reuse tree, evictable unless held).
/// Cached checkpoints sit in column `column` of the reuse tree at the node whose tokens end at
/// the checkpoint position; they leave by LRU within retention priority. With secondary (host)
/// slots, ids [num_slots, num_slots + num_secondary), an evicted checkpoint is copied to the host
/// (evicting the host's least valuable one when it is full) and a hit restores from there
/// directly into the working slot. Not thread-safe.
class StatePool {
 public:
  /// `events` (may be null) receives a stored event per cached checkpoint and a removed event
  /// per evicted one.
  StatePool(StateGroupLayout layout, std::int32_t group, std::int32_t num_slots, std::int32_t num_secondary,
            MemoryBackend* backend, ReuseTree* tree, std::int32_t column, EventLog* events);
  ~StatePool();
  StatePool(const StatePool&) = delete;
  StatePool& operator=(const StatePool&) = delete;

  const StateGroupLayout& layout() const { return layout_; }
  /// Primary slots (working states and checkpoints); secondary ids follow them.
  std::int32_t num_slots() const { return num_primary_; }
  std::int32_t num_secondary() const { return static_cast<std::int32_t>(slots_.size()) - num_primary_; }
  bool IsSecondary(SlotId s) const { return s >= num_primary_; }
  /// Where slot `s` lives (nullptr without memory) and on which level.
  void* Address(SlotId s) const;
  CacheLevel Level(SlotId s) const { return IsSecondary(s) ? CacheLevel::kSecondary : CacheLevel::kPrimary; }
  std::int32_t column() const { return column_; }
  void* memory() const { return memory_; }
  /// Slots that can be taken now: free ones plus cached checkpoints that are not held.
  std::int32_t NumAvailable() const { return static_cast<std::int32_t>(free_.size() + evictable_.size()); }
  std::int32_t NumFree() const { return static_cast<std::int32_t>(free_.size()); }
  std::int32_t NumCached() const { return num_cached_; }
  std::int32_t NumCachedSecondary() const { return num_cached_secondary_; }
  std::int64_t offloaded() const { return offloaded_; }
  std::int32_t NumWorking() const { return num_working_; }
  std::int32_t NumPending() const { return num_pending_; }

  /// Takes a slot (a free one, else evicts the least valuable unheld checkpoint) as a working
  /// slot (`pending` false) or a pending checkpoint; kNoSlot when none is available.
  SlotId Take(bool pending);
  /// Returns a working or pending slot to the free list.
  void Free(SlotId s);
  /// The checkpoint cached at `node`, or kNoSlot.
  SlotId CheckpointAt(NodeId node) const { return tree_->Block(node, column_); }
  /// Turns pending slot `s` into the checkpoint of `node` (which has none), retained at
  /// `priority`; with a per-path cap the shallowest checkpoint on the path beyond it is evicted.
  void Cache(SlotId s, NodeId node, int priority, std::int32_t max_per_path,
             std::optional<std::int64_t> lora_task_id = std::nullopt);
  /// Checkpoint `s` is used: it becomes the most recently used of its priority and segment;
  /// `hit` (a restore from it) moves it to the segment of checkpoints that served a hit.
  void Touch(SlotId s, bool hit);
  /// Holds (or lets go of) cached checkpoint `s` while a queued copy reads it: a held
  /// checkpoint is not evicted.
  void Hold(SlotId s);
  void Unhold(SlotId s);
  /// Evicts every unheld checkpoint (ResetPrefixCache). Returns how many.
  std::int64_t DropAll();
  std::int64_t evicted() const { return evicted_; }
  /// Verifies the slot states against the free list, the LRU set and the tree.
  void CheckInvariants(std::int64_t expected_working, std::int64_t expected_pending,
                       std::int64_t expected_holds) const;

 private:
  enum class State : std::uint8_t { kFree, kWorking, kPending, kCached };
  struct Slot {
    State state = State::kFree;
    NodeId node = kNoNode;
    std::int32_t holds = 0;
    int priority = kDefaultPriority;
    bool hit = false;  ///< A cached checkpoint that served a restore.
    std::uint64_t stamp = 0;
  };
  /// (priority, served a hit, last use, slot): the smallest is evicted first, so within a
  /// priority a checkpoint that never served a hit (a unique prompt's tail) goes before one
  /// that did (a shared prefix's junction), each segment least recently used first.
  using Key = std::tuple<int, bool, std::uint64_t, SlotId>;
  Key KeyOf(SlotId s) const { return Key{slots_[s].priority, slots_[s].hit, slots_[s].stamp, s}; }
  std::set<Key>& Evictable(SlotId s) { return IsSecondary(s) ? evictable_secondary_ : evictable_; }
  const std::set<Key>& Evictable(SlotId s) const { return IsSecondary(s) ? evictable_secondary_ : evictable_; }
  /// Evicts cached checkpoint `s`: a primary one moves to the host when the host has (or can
  /// free) a slot, else it is dropped; a secondary one is dropped.
  void Evict(SlotId s);
  /// Drops cached checkpoint `s` from the tree and frees its slot.
  void Drop(SlotId s);

  StateGroupLayout layout_;
  std::int32_t group_;
  MemoryBackend* backend_;
  ReuseTree* tree_;
  std::int32_t column_;
  EventLog* events_;
  void* memory_ = nullptr;
  void* host_ = nullptr;  // secondary slots
  std::int32_t num_primary_ = 0;
  std::vector<Slot> slots_;
  std::vector<SlotId> free_;
  std::vector<SlotId> free_secondary_;
  std::set<Key> evictable_;
  std::set<Key> evictable_secondary_;
  std::int32_t num_cached_secondary_ = 0;
  std::int64_t offloaded_ = 0;
  std::uint64_t clock_ = 0;
  std::int32_t num_cached_ = 0;
  std::int32_t num_working_ = 0;
  std::int32_t num_pending_ = 0;
  std::int64_t evicted_ = 0;
};

/// Groups the recurrent layers by their state tensors (first appearance order) and lays out each
/// group's slot. Throws std::invalid_argument on an empty tensor list or a non-positive dimension.
std::vector<StateGroupLayout> PlanStateGroups(const std::vector<std::vector<StateTensorSpec>>& layers);

}  // namespace kvcache
