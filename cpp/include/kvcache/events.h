// KV cache events: what was created, stored, removed or updated, per window, in order.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <vector>

#include "kvcache/types.h"

namespace kvcache {

enum class EventKind : std::uint8_t { kCreated, kStored, kRemoved, kUpdated };

/// cache_level of a block queued for the shared tier (vLLM's medium "SHARED_STORAGE").
inline constexpr int kSharedStorageLevel = 3;

/// One stored block as reported by a kStored event.
struct StoredBlock {
  std::uint64_t hash = 0;
  std::vector<TokenId> tokens;
  std::optional<std::int64_t> lora_task_id;
  int cache_level = 0;  ///< 0 = primary, 1 = secondary, 2 = disk, kSharedStorageLevel = shared tier.
  int priority = kDefaultPriority;
};

/// One event. Which fields are meaningful depends on `kind`.
struct KVCacheEvent {
  std::uint64_t event_id = 0;  ///< Monotonic over the manager's lifetime (gaps = dropped).
  WindowSize window_size = 0;
  /// >= 0: the event is about the checkpoints of this state group (window_size is then 0); a
  /// stored "block" is a checkpoint of the state after the chain ending at its hash.
  std::int32_t state_group = -1;
  EventKind kind = EventKind::kCreated;
  // kCreated: blocks per cache level.
  std::int32_t num_primary_blocks = 0;
  std::int32_t num_secondary_blocks = 0;
  // kStored: the parent of the first block (none for a chain starting at the root) and the blocks.
  std::optional<std::uint64_t> parent_hash;
  std::vector<StoredBlock> blocks;
  // kRemoved: hashes of removed blocks (consecutive removals of one window are merged).
  std::vector<std::uint64_t> hashes;
  // kUpdated: one block's cache level and/or priority change.
  std::uint64_t hash = 0;
  std::optional<std::pair<int, int>> cache_level;  ///< (old, new)
  std::optional<std::pair<int, int>> priority;     ///< (old, new)
};

/// Bounded, thread-safe event buffer: the oldest events are dropped when it is full.
class EventLog {
 public:
  explicit EventLog(std::size_t max_size) : max_size_(max_size) {}
  void Push(KVCacheEvent event);
  /// Records one removed block hash, merged into the previous event if that is a removal of
  /// the same window.
  void PushRemoved(WindowSize window, std::uint64_t hash, std::int32_t state_group = -1);
  /// Takes every buffered event; waits up to `timeout_ms` for one if the buffer is empty (no
  /// wait for `timeout_ms <= 0`; a timeout too long for the clock waits until an event arrives).
  std::vector<KVCacheEvent> Take(std::int64_t timeout_ms);

 private:
  void PushLocked(KVCacheEvent event);
  /// Waits on `lock` (held on mu_) until an event is buffered or `timeout_ms` > 0 has passed.
  void WaitLocked(std::unique_lock<std::mutex>& lock, std::int64_t timeout_ms);

  std::size_t max_size_;
  std::deque<KVCacheEvent> events_;
  std::uint64_t next_id_ = 0;
  mutable std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace kvcache
