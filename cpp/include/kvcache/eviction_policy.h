// Free-block queues of one window: per cache level and retention priority, LRU inside each.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "kvcache/types.h"

namespace kvcache {

/// Holds the free (unreferenced) blocks of one window and chooses which one to hand out next.
///
/// Block ids [0, num_primary) are primary slots, [num_primary, num_primary + num_secondary)
/// secondary slots; a block's level follows from its id. Every level has one queue per
/// priority 0..100 plus a *scratch* queue (priority kScratch) for blocks that hold nothing
/// reusable: those are always handed out first, so transient blocks never push cached content
/// out. Inside a queue the order is release order (oldest first) unless pushed to the front.
/// All operations are O(1) (the victim search scans a 128-bit occupancy mask).
/// Not thread-safe; the owning manager serializes access.
class EvictionPolicy {
 public:
  static constexpr int kScratch = -1;  ///< Priority of blocks without reusable content.

  EvictionPolicy(std::int32_t num_primary, std::int32_t num_secondary);

  /// Queues free block `b` at `priority` (kScratch or 0..100); at the back unless `to_front`.
  void Push(BlockId b, int priority, bool to_front = false);
  /// Removes queued block `b` (it is being claimed).
  void Remove(BlockId b);
  /// True if `b` is queued (free).
  bool Contains(BlockId b) const { return links_[b].queue >= 0; }
  /// Priority `b` is queued at (kScratch or 0..100); `b` must be queued.
  int QueuedPriority(BlockId b) const;
  /// The block to hand out next at `level` (lowest priority, oldest), or kNullBlock if none.
  BlockId Peek(CacheLevel level) const;
  /// Number of free blocks at `level`.
  std::int32_t NumFree(CacheLevel level) const { return num_free_[static_cast<int>(level)]; }
  /// Visits the queued blocks of `level` in hand-out order.
  template <typename F>
  void ForEach(CacheLevel level, F&& visit) const {
    for (int q = 0; q < kQueuesPerLevel; ++q) {
      for (BlockId b = head_[QueueIndex(level, q)]; b != kNullBlock; b = links_[b].next) visit(b);
    }
  }
  CacheLevel LevelOf(BlockId b) const {
    return b < num_primary_ ? CacheLevel::kPrimary : CacheLevel::kSecondary;
  }

 private:
  static constexpr int kQueuesPerLevel = kMaxPriority + 2;  // scratch + 0..100
  static int QueueIndex(CacheLevel level, int slot) {
    return static_cast<int>(level) * kQueuesPerLevel + slot;
  }

  std::int32_t num_primary_;
  struct Link {  // one per block: its neighbours and queue, together in memory
    BlockId prev = kNullBlock;
    BlockId next = kNullBlock;
    std::int16_t queue = -1;  // queue index, or -1 when not queued
  };
  std::vector<Link> links_;
  std::array<BlockId, 2 * kQueuesPerLevel> head_;
  std::array<BlockId, 2 * kQueuesPerLevel> tail_;
  std::array<std::array<std::uint64_t, 2>, 2> occupied_{};  // per level, bit per queue slot
  std::array<std::int32_t, 2> num_free_{};
};

}  // namespace kvcache
