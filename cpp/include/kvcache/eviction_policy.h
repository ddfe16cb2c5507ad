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
/// secondary slots; a block's level follows from its id. Every level has a *scratch* queue
/// (priority kScratch) for blocks that hold nothing reusable: those are always handed out first,
/// so transient blocks never push cached content out. Then, per priority 0..100, two queues: a
/// *probation* queue for cached blocks that never served a reuse hit and a *protected* queue
/// for those that did (segmented LRU: a stream of blocks written once cannot flush a prefix
/// that requests keep reusing). Lower priorities go first; inside one priority probation before
/// protected. At most `protected_cap` blocks of a level sit in protected queues (10 % of the
/// level by default: enough for the prefixes many requests share, small enough that a prefix
/// written in the last few steps, such as a conversation's previous turn, is not squeezed out
/// of a small pool by blocks that were hit long ago): pushing one more
/// demotes the oldest protected block of the same priority to the back of its probation queue.
/// Inside a queue the order is release order (oldest first) unless pushed to the front.
/// All operations are O(1) (the victim search scans a 256-bit occupancy mask).
/// Not thread-safe; the owning manager serializes access.
class EvictionPolicy {
 public:
  static constexpr int kScratch = -1;  ///< Priority of blocks without reusable content.

  /// Default share of a level's blocks that protected queues may hold.
  static constexpr double kDefaultProtectedFraction = 0.1;

  /// `protected_cap` per level: ceil(`protected_fraction` x the level's blocks).
  /// `slab_blocks` > 0 groups the primary ids into slabs of that many consecutive ids (the unit
  /// of memory that windows lend each other) and tracks which slabs have every block free.
  EvictionPolicy(std::int32_t num_primary, std::int32_t num_secondary,
                 double protected_fraction = kDefaultProtectedFraction, std::int32_t slab_blocks = 0);

  /// Recomputes the protected cap of `level` for a level of `num_blocks` blocks (the blocks a
  /// window owns changed). A lower cap demotes nothing now; later pushes demote one each.
  void SetLevelSize(CacheLevel level, std::int32_t num_blocks);

  /// Queues free block `b` at `priority` (kScratch or 0..100), in the protected queue of that
  /// priority if `protect`; at the back unless `to_front`. Returns the block demoted from
  /// protected to probation to keep the level within its cap, or kNullBlock.
  BlockId Push(BlockId b, int priority, bool to_front = false, bool protect = false);
  /// Removes queued block `b` (it is being claimed).
  void Remove(BlockId b);
  /// Takes up to `n` blocks off the front of `level`'s scratch queue into out[0..k) and returns
  /// k: the blocks k calls of Peek and Remove would take while the scratch queue lasts.
  std::int32_t PopScratch(CacheLevel level, std::int32_t n, BlockId* out);
  /// Push(b, kScratch, to_front) for a block the caller knows is not queued (no checks).
  void PushScratch(BlockId b, bool to_front);
  /// PushScratch of blocks[0..n) in that order (all of `level`), linked in one pass.
  void PushScratchN(CacheLevel level, const BlockId* blocks, std::int32_t n, bool to_front);
  /// True if `b` is queued (free).
  bool Contains(BlockId b) const { return links_[b].queue >= 0; }
  /// Priority `b` is queued at (kScratch or 0..100); `b` must be queued.
  int QueuedPriority(BlockId b) const;
  /// True if queued block `b` sits in a protected queue.
  bool QueuedProtected(BlockId b) const;
  /// Free blocks of `level` in protected queues.
  std::int32_t NumProtected(CacheLevel level) const { return num_protected_[static_cast<int>(level)]; }
  /// The block to hand out next at `level` (lowest priority, oldest), or kNullBlock if none.
  BlockId Peek(CacheLevel level) const;
  /// The first block Peek would hand out after every scratch block of `level`, or kNullBlock.
  BlockId PeekCached(CacheLevel level) const;
  /// Free blocks of `level` in the scratch queue.
  std::int32_t NumScratch(CacheLevel level) const { return num_scratch_[static_cast<int>(level)]; }
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

  /// Slabs (see the constructor) whose blocks are all free; 0 without slabs.
  std::int32_t NumFreeSlabs() const { return num_free_slabs_; }
  /// The slab that has had every block free the longest, or -1.
  std::int32_t OldestFreeSlab() const { return slab_head_; }
  /// The wholly free slab after `s` in that order, or -1.
  std::int32_t NextFreeSlab(std::int32_t s) const { return slab_next_[static_cast<std::size_t>(s)]; }
  /// Free blocks of slab `s`.
  std::int32_t SlabFree(std::int32_t s) const { return slab_free_[static_cast<std::size_t>(s)]; }
  /// True if slab `s` is in the list of slabs with every block free.
  bool SlabListed(std::int32_t s) const { return slab_listed_[static_cast<std::size_t>(s)] != 0; }

 private:
  // Slot 0: scratch; then (probation, protected) for each priority 0..100.
  static constexpr int kQueuesPerLevel = 2 * (kMaxPriority + 1) + 1;
  static constexpr int kMaskWords = (kQueuesPerLevel + 63) / 64;
  static int QueueIndex(CacheLevel level, int slot) {
    return static_cast<int>(level) * kQueuesPerLevel + slot;
  }
  static int Slot(int priority, bool protect) {
    return priority == kScratch ? 0 : 1 + 2 * priority + (protect ? 1 : 0);
  }
  static bool IsProtectedSlot(int slot) { return slot > 0 && slot % 2 == 0; }
  void Insert(BlockId b, int q, bool to_front);
  void Chain(BlockId b, int q, bool to_front);  // into queue q's list only (no counters)
  void Erase(BlockId b);
  void SlabGained(BlockId b);  // primary block b became free
  void SlabLost(BlockId b);    // primary block b stopped being free

  std::int32_t num_primary_;
  struct Link {  // one per block: its neighbours and queue, together in memory
    BlockId prev = kNullBlock;
    BlockId next = kNullBlock;
    std::int16_t queue = -1;  // queue index, or -1 when not queued
  };
  std::vector<Link> links_;
  std::array<BlockId, 2 * kQueuesPerLevel> head_;
  std::array<BlockId, 2 * kQueuesPerLevel> tail_;
  std::array<std::array<std::uint64_t, kMaskWords>, 2> occupied_{};  // per level, bit per slot
  std::array<std::int32_t, 2> num_free_{};
  std::array<std::int32_t, 2> num_protected_{};
  std::array<std::int32_t, 2> num_scratch_{};
  std::array<std::int32_t, 2> protected_cap_{};
  double protected_fraction_;
  // Slabs: free blocks per slab and an intrusive FIFO of the slabs with every block free.
  std::int32_t slab_blocks_ = 0;
  std::vector<std::int32_t> slab_free_;
  std::vector<std::int32_t> slab_prev_;
  std::vector<std::int32_t> slab_next_;
  std::vector<char> slab_listed_;
  std::int32_t slab_head_ = -1;
  std::int32_t slab_tail_ = -1;
  std::int32_t num_free_slabs_ = 0;
};

inline void EvictionPolicy::Chain(BlockId b, int q, bool to_front) {
  Link& l = links_[b];
  l.queue = static_cast<std::int16_t>(q);
  if (head_[q] == kNullBlock) {
    l.prev = l.next = kNullBlock;
    head_[q] = tail_[q] = b;
  } else if (to_front) {
    l.prev = kNullBlock;
    l.next = head_[q];
    links_[head_[q]].prev = b;
    head_[q] = b;
  } else {
    l.next = kNullBlock;
    l.prev = tail_[q];
    links_[tail_[q]].next = b;
    tail_[q] = b;
  }
}

inline void EvictionPolicy::PushScratch(BlockId b, bool to_front) {
  const int lv = static_cast<int>(LevelOf(b));
  Chain(b, QueueIndex(LevelOf(b), 0), to_front);
  occupied_[lv][0] |= 1;  // slot 0: the scratch queue
  ++num_free_[lv];
  ++num_scratch_[lv];
  if (slab_blocks_ > 0 && lv == 0) SlabGained(b);
}

}  // namespace kvcache
