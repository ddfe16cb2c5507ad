// The blocks of one attention window: pool memory, block state, free queues, eviction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/eviction_policy.h"
#include "kvcache/events.h"
#include "kvcache/memory_backend.h"
#include "kvcache/reuse_tree.h"
#include "kvcache/secondary_tier.h"
#include "kvcache/types.h"

namespace kvcache {

/// Shape of one pool: the layers of one window that share (KV-head count, head size, dtype).
/// Its memory is `[blocks, layers.size(), kv_factor, num_kv_heads, tokens_per_block, head_dim]`
/// of `dtype`, so one block holds every layer of the pool.
struct PoolLayout {
  std::int32_t num_kv_heads = 0;
  std::vector<std::int32_t> layers;  ///< Global layer indices, ascending.
  std::int32_t kv_factor = 2;
  std::int32_t tokens_per_block = 0;
  std::int32_t head_dim = 0;
  std::int32_t elem_bytes = 0;
  DType dtype = DType::kFloat16;

  /// Bytes of one K (or V) slab of one layer of one block: `[heads, tokens, head_dim]`.
  std::size_t SlabBytes() const {
    return static_cast<std::size_t>(num_kv_heads) * tokens_per_block * head_dim * elem_bytes;
  }
  /// Bytes of one block of this pool (all its layers, K and V).
  std::size_t BlockBytes() const { return layers.size() * kv_factor * SlabBytes(); }
};

/// Primary memory that the manager allocated for every window together, so that windows can
/// lend each other memory (ManagerConfig::lend_free_memory). Window block `b` of pool `p` lives
/// at `base + b * block_stride + pool_offsets[p]`; the arena is cut into slabs of
/// `blocks_per_slab` blocks of this window (the same bytes for every window), and a window owns
/// whole slabs: initially [first_slab, first_slab + owned_slabs).
struct SharedPrimary {
  unsigned char* base = nullptr;  ///< nullptr for a backend without memory
  std::size_t block_stride = 0;
  std::vector<std::size_t> pool_offsets;
  std::int32_t blocks_per_slab = 0;
  std::int32_t num_slabs = 0;  ///< Slabs of the whole arena.
  std::int32_t first_slab = 0;
  std::int32_t owned_slabs = 0;
};

/// How a window treats cached blocks.
struct WindowReuseOptions {
  /// Evicting a cached block also drops the part of the tree below it in this window (always for
  /// full attention; for sliding windows only under swa_reuse_policy "invalidate").
  bool cascade_on_evict = true;
  bool onboard_blocks = true;  ///< Evicted cached blocks may be offloaded to secondary blocks.
  int secondary_offload_min_priority = 30;
  /// Cached blocks that served a reuse hit are evicted after those that never did (same
  /// priority); false: one LRU order per priority.
  bool protect_hit_blocks = true;
  /// Share of the window's blocks (per level) that may wait in protected queues.
  double protected_fraction = EvictionPolicy::kDefaultProtectedFraction;
};

/// A disk slot's content could not be read back intact (I/O error, short read, missing or
/// overwritten data, a failed checksum). Thrown by the onboard and copy paths before anything
/// changed; the manager undoes the admission in progress, drops the slot (DropUnreadable) and
/// plans again, so the prefix hit stops before that block. Never reaches a caller.
class DiskReadError : public KVCacheError {
 public:
  DiskReadError(std::int32_t window_index, BlockId block, const std::string& what)
      : KVCacheError(what), window_index_(window_index), block_(block) {}
  std::int32_t window_index() const noexcept { return window_index_; }
  BlockId block() const noexcept { return block_; }

 private:
  std::int32_t window_index_;
  BlockId block_;
};

/// Owns the pools of one window and the state of each block: reference count and generation
/// (bumped at every Grant, i.e. whenever the block may be written again), the live
/// sequences that released it out of window, retention priority, and the link to the
/// reuse-tree node whose content it caches. Block ids are slots: primary [0, num_primary), secondary after.
/// An unreferenced block sits in the free queues: at its priority if it caches content, in the
/// scratch queue otherwise. Not thread-safe; the manager serializes access.
class WindowBlockManager {
 public:
  WindowBlockManager(WindowSize window, bool is_swa, std::int32_t window_index,
                     std::vector<PoolLayout> pools, std::int32_t num_primary,
                     std::int32_t num_secondary, MemoryBackend* backend, ReuseTree* tree,
                     WindowReuseOptions options, EventLog* events,
                     const SharedPrimary* shared = nullptr);
  ~WindowBlockManager();
  WindowBlockManager(const WindowBlockManager&) = delete;
  WindowBlockManager& operator=(const WindowBlockManager&) = delete;

  WindowSize window() const { return window_; }
  bool is_swa() const { return is_swa_; }
  std::int32_t num_primary() const { return num_primary_; }
  std::int32_t num_secondary() const { return num_secondary_; }
  const std::vector<PoolLayout>& pools() const { return pools_; }
  void* primary_base(std::size_t pool) const { return primary_[pool]; }
  /// Bytes from one primary block of `pool` to the next (its block bytes unless the memory is
  /// shared between windows).
  std::size_t primary_stride(std::size_t pool) const { return primary_stride_[pool]; }
  void* secondary_base(std::size_t pool) const { return secondary_[pool]; }
  std::size_t allocated_bytes() const { return allocated_bytes_; }
  std::int64_t offloaded_blocks() const { return offloaded_; }
  std::int64_t onboarded_blocks() const { return onboarded_; }
  /// Disk slots dropped because their content could not be read back intact.
  std::int64_t disk_read_failures() const { return disk_read_failures_; }

  /// Gives this window `num_disk` slots in `tier` below its secondary pool (call once, before
  /// any other call). Disk slots are block ids [num_primary + num_secondary, num_blocks()): a
  /// free cached secondary block that is about to be reused has its content written to a disk
  /// slot (the least recently used one is dropped when none is free) instead of being dropped,
  /// and a reuse hit on a disk slot onboards it into a primary block. `tier` may be null for a
  /// backend without memory (bookkeeping only).
  void AttachTier(std::int32_t num_disk, std::shared_ptr<SecondaryTier> tier);
  /// Every block id of the window: primary, secondary, disk.
  std::int32_t num_blocks() const { return num_primary_ + num_secondary_ + num_disk_; }
  bool IsDisk(BlockId b) const { return b >= num_primary_ + num_secondary_; }
  /// Cache level reported by events: 0 primary, 1 secondary (host), 2 disk.
  int LevelOf(BlockId b) const { return IsPrimary(b) ? 0 : IsDisk(b) ? 2 : 1; }

  std::int32_t NumFreePrimary() const { return policy_.NumFree(CacheLevel::kPrimary); }

  // Memory lending (SharedPrimary). Block ids [0, num_primary) span the whole arena; the window
  // owns the ids of its slabs, and only those are ever free or handed out.
  std::int32_t blocks_per_slab() const { return slab_blocks_; }
  /// Primary blocks the window owns now (num_primary without lending).
  std::int32_t NumOwnedPrimary() const { return owned_primary_; }
  bool OwnsSlab(std::int32_t slab) const { return slab_owned_[static_cast<std::size_t>(slab)] != 0; }
  /// True if primary block `b` lies in a slab this window owns (always, without lending).
  bool Owns(BlockId b) const { return slab_blocks_ == 0 || slab_owned_[static_cast<std::size_t>(b / slab_blocks_)] != 0; }
  /// Owned slabs whose blocks are all free (what the window can lend now).
  std::int32_t NumFreeSlabs() const { return policy_.NumFreeSlabs(); }
  /// The owned slab to lend when one must be: wholly free and holding none of `keep` (may be
  /// null); the slab of the next eviction victim if it qualifies, else the one wholly free the
  /// longest that does. Precondition: one qualifies.
  std::int32_t SlabToLend(const std::vector<BlockId>* keep) const;
  /// Cached blocks that Acquire evicted since the last call (and resets the count).
  std::int64_t TakeCachedEvictions() {
    const std::int64_t n = cached_evictions_;
    cached_evictions_ = 0;
    return n;
  }
  /// Gives up wholly free slab `slab`: each of its blocks ends its cached identity (offloaded
  /// when allowed, else dropped from the tree) and gets a new generation; live sequences that
  /// had released one out of window are appended to *displaced.
  void LendSlab(std::int32_t slab, std::vector<SeqId>* displaced);

  /// Where a free primary block stands in the eviction order: scratch blocks first (rank -1),
  /// then cached ones by priority, probation before protected (rank 2 * priority + protected),
  /// and by the time they were queued. Comparable across windows that share `clock`.
  struct EvictionKey {
    int rank = 0;
    std::uint64_t stamp = 0;
    bool operator<(const EvictionKey& o) const { return rank != o.rank ? rank < o.rank : stamp < o.stamp; }
  };
  /// Stamps every primary block queued from now on from `clock` (shared by the windows); the
  /// blocks queued already are stamped now, in hand-out order. Without it every stamp is 0, so
  /// keys of one rank tie whenever they were queued.
  void EnableEvictionKeys(std::uint64_t* clock);
  EvictionKey EvictionKeyOf(BlockId b) const;
  /// The slab of this window's next victim if lending it costs less than evicting a block of
  /// key `than`: the slab is wholly free and none of its blocks ranks at or above `than`. -1
  /// otherwise.
  std::int32_t CheaperSlab(const EvictionKey& than) const;
  /// Takes ownership of slab `slab` (given up by another window): its blocks join the scratch
  /// queue.
  void AdoptSlab(std::int32_t slab);
  bool IsPrimary(BlockId b) const { return b < num_primary_; }
  std::int32_t RefCount(BlockId b) const { return state_[b].ref_count; }
  /// Sum over primary blocks of (references - 1) for blocks with more than one: how many
  /// releases of held blocks would free nothing. Kept as references change (O(1)).
  std::int64_t NumSharedRefs() const { return shared_refs_; }
  std::uint32_t Generation(BlockId b) const { return state_[b].generation; }
  NodeId NodeOf(BlockId b) const { return state_[b].node; }
  int Priority(BlockId b) const { return state_[b].priority; }
  const EvictionPolicy& policy() const { return policy_; }

  /// The one way a block becomes writable by a sequence: takes free block `b` out of the free
  /// queues and ends its cached identity (offloaded to a secondary block when `offload` and
  /// allowed, else dropped from the tree), then gives it one reference, a new generation,
  /// `priority` and `expiry_ms`. Every live sequence that had released `b` out of window (its
  /// record of `b`'s content is now stale) is appended to *displaced.
  BlockId Grant(BlockId b, int priority, std::int64_t expiry_ms, bool offload, std::vector<SeqId>* displaced);
  /// Grant of the next free primary block (the eviction victim). Precondition: a free block.
  BlockId Acquire(int priority, std::int64_t expiry_ms, std::vector<SeqId>* displaced);
  /// `n` calls of Acquire in one: out[0..n) get the blocks those calls would hand out, in that
  /// order (scratch blocks in one pass, then cached victims). Throws, with nothing changed, if
  /// fewer than `n` blocks are free.
  void AcquireN(std::int32_t n, int priority, std::int64_t expiry_ms, BlockId* out, std::vector<SeqId>* displaced);
  /// Takes a read-only reference on `b` (cached blocks may be free: they leave the free queues).
  void Claim(BlockId b);
  /// Records that cached block `b` served a reuse hit: once free it waits in a protected queue
  /// (see EvictionPolicy). Ends with the block's cached identity or a demotion.
  void MarkHit(BlockId b);
  /// Drops one reference; at zero the block is queued (cached: at its priority; else scratch,
  /// at the front if `to_front`). `released_by` >= 0 names a running sequence that releases `b`
  /// out of window and keeps a record of its content (until the next Grant or ForgetRelease).
  void Release(BlockId b, bool to_front = false, SeqId released_by = -1);
  /// Release of blocks[0..n) with the same arguments, last first if `reverse`.
  void ReleaseN(const BlockId* blocks, std::int32_t n, bool reverse, bool to_front = false, SeqId released_by = -1);
  /// Removes one record of `seq` from `b`'s releasers (the sequence ended).
  void ForgetRelease(BlockId b, SeqId seq);
  /// Adds `seq` to `b`'s releasers without a release (a fork copies its parent's record of `b`).
  void RecordRelease(BlockId b, SeqId seq);
  /// Whether a live sequence released `b` out of window since its last Grant.
  bool HasReleasers(BlockId b) const { return state_[b].releaser >= 0; }
  /// Live sequences that released `b` out of window since its last Grant (checks and tests).
  std::vector<SeqId> Releasers(BlockId b) const;
  /// Moves the content of claimed secondary or disk block `s` into a Grant-ed primary block and
  /// relinks the tree node to it; releases `s`. Returns the primary block. A disk slot is read
  /// first: if the tier cannot return its content intact, throws DiskReadError with nothing
  /// changed.
  BlockId Onboard(BlockId s, int priority, std::int64_t expiry_ms, std::vector<SeqId>* displaced);
  /// Copies the first `num_tokens` tokens of every layer, K/V and head of `src` into `dst`.
  /// Throws DiskReadError, with `dst` untouched, when disk slot `src` cannot be read intact.
  void CopyTokens(BlockId dst, BlockId src, std::int32_t num_tokens);
  /// Drops unreferenced disk slot `d`, whose content could not be read back (DiskReadError),
  /// like Drop (with what cascades below it; nothing if a drop unlinked it meanwhile), and
  /// counts it in disk_read_failures().
  void DropUnreadable(BlockId d);

  /// Links unlinked block `b` to tree node `node` (whose slot for this window is empty).
  void Link(BlockId b, NodeId node);
  /// Unlinks cached block `b` (with cascade_on_evict, also every block below it in this window),
  /// emits removed events, re-queues unlinked free blocks as scratch and prunes empty nodes.
  void Drop(BlockId b);
  /// Sets `b`'s retention priority (and expiry, 0 = none); re-queues it if free; emits an
  /// updated event when a cached block's priority changes.
  void SetPriority(BlockId b, int priority, std::int64_t expiry_ms);
  /// Timed priorities that expired at `now_ms` return to the default priority.
  void RefreshPriorities(std::int64_t now_ms);

  /// Verifies reference counts against `expected_refs` (counted by the manager), queue
  /// membership and levels, and tree back-links. Throws InternalError.
  void CheckInvariants(const std::vector<std::int32_t>& expected_refs) const;

  /// Bytes of one block of this window (all its pools).
  std::size_t BlockBytes() const;
  /// Copies primary block `b`'s bytes (pool after pool) to host memory `dst` and waits.
  void CopyOut(BlockId b, unsigned char* dst) const;
  /// Copies BlockBytes() bytes from host memory `src` into primary block `b` (issued; the
  /// backend's Synchronize completes it).
  void CopyIn(BlockId b, const unsigned char* src);

 private:
  unsigned char* Address(BlockId b, std::size_t pool) const;
  /// Takes free primary block `b` out of the free queues and ends what it was: its cached
  /// identity (offloaded when `offload`, else dropped) and the other sequences' records of its
  /// content (appended to *displaced). Its generation is bumped. Grant and LendSlab use it.
  void Reclaim(BlockId b, bool offload, std::vector<SeqId>* displaced);
  /// Acquire's body, inlined into AcquireN's loop over cached victims.
  BlockId TakeVictim(int priority, std::int64_t expiry_ms, std::vector<SeqId>* displaced);
  /// Reclaim's last step: the other sequences' records of `b`'s content end (appended to
  /// *displaced), the hit mark clears and the generation is bumped.
  void Renew(BlockId b, std::vector<SeqId>* displaced);
  /// Grant's last step: one reference, priority and expiry.
  void Hand(BlockId b, int priority, std::int64_t expiry_ms);
  void ReleaseOne(BlockId b, bool to_front, SeqId released_by);  // Release, inlined into ReleaseN
  int QueuePriority(BlockId b) const;
  bool QueueProtected(BlockId b) const;
  /// Puts free block `b` in the queue its state says (at the front only if `to_front` and it
  /// holds nothing reusable); clears the hit mark of a demoted block.
  void Enqueue(BlockId b, bool to_front = false);
  void EvictCached(BlockId victim);
  void Requeue(BlockId b);
  /// Drop's work for one node `m` whose block here is `x`: unlinks x and queues it as what it
  /// now is (scratch, or a free disk slot). The node is pruned by the caller.
  void UnlinkDropped(NodeId m, BlockId x);
  void EmitUpdated(BlockId b, std::optional<std::pair<int, int>> level,
                   std::optional<std::pair<int, int>> priority);
  // Disk tier (window_disk_tier.cpp).
  bool InPolicy(BlockId b) const { return !IsDisk(b) && policy_.Contains(b); }
  /// Writes free cached secondary block `s` (out of the free queues) to a disk slot and relinks
  /// its node there. False when there is no disk tier, the priority is too low or the write
  /// was refused: the caller drops `s` then.
  bool SpillToDisk(BlockId s);
  void DiskQueue(BlockId d);    ///< Unreferenced disk slot: LRU if it caches content, else free.
  void DiskUnqueue(BlockId d);  ///< Out of the LRU or the free list (being claimed).
  /// Reads disk slot `d` into `buffer` (resized once); returns one segment per pool, into it.
  /// Throws DiskReadError when the tier cannot return the slot's content intact.
  std::vector<TierSegment> ReadDisk(BlockId d, std::vector<unsigned char>* buffer);
  TierKey KeyOf(BlockId d) const;
  void CheckDiskSlot(BlockId d) const;
  // CheckInvariants' parts.
  /// Block `b`'s state: `expected_refs` references, releasers, queue membership and priority,
  /// tree back-link. False for a block of a slab lent to another window (nothing of this window's).
  bool CheckBlock(BlockId b, std::int32_t expected_refs) const;
  /// Every tree node's block of this window points back to it; full attention's are prefix-closed.
  void CheckTreeLinks() const;
  /// Lending: slab free counts and ownership match the blocks.
  void CheckSlabs() const;
  /// The free queues hold exactly the free blocks of their level.
  void CheckFreeCounts(std::int32_t free_primary, std::int32_t free_secondary) const;

  WindowSize window_;
  bool is_swa_;
  std::int32_t index_;
  std::vector<PoolLayout> pools_;
  std::int32_t num_primary_;
  std::int32_t num_secondary_;
  MemoryBackend* backend_;
  ReuseTree* tree_;
  WindowReuseOptions options_;
  EventLog* events_;
  std::vector<void*> primary_;
  std::vector<std::size_t> primary_stride_;
  bool own_primary_ = true;  // false: the manager's shared arena
  std::vector<void*> secondary_;
  // Lending: blocks per slab (0 = no lending), slab ownership, blocks owned.
  std::int32_t slab_blocks_ = 0;
  std::vector<char> slab_owned_;
  std::int32_t owned_primary_ = 0;
  std::vector<NodeId> drop_nodes_;    // Drop's work list, kept to avoid an allocation per drop
  std::vector<BlockId> release_scratch_;  // ReleaseN's blocks bound for the scratch queue
  std::uint64_t* clock_ = nullptr;    // eviction stamps (lending only)
  std::int64_t cached_evictions_ = 0;  // Acquire's victims that held cached content
  std::vector<std::uint64_t> stamp_;  // per primary block: when it was last queued
  std::size_t allocated_bytes_ = 0;
  // Per-block state, one struct per block, so a hand-out or a release touches one cache line.
  struct BlockState {
    std::int32_t ref_count = 0;
    std::uint32_t generation = 0;
    NodeId node = kNoNode;  // the tree node whose content the block caches
    std::int8_t priority = static_cast<std::int8_t>(kDefaultPriority);
    bool hit = false;            // served a reuse hit since it was linked (protected when free)
    // A live sequence holding a record of the content (released out of window), -1: none. Nearly
    // always one at most: the others, if any, are in more_releasers_[b] (no allocation per block).
    SeqId releaser = -1;
    std::int64_t expiry_ms = 0;
  };
  std::vector<BlockState> state_;
  std::int64_t shared_refs_ = 0;  // NumSharedRefs()
  std::vector<std::vector<SeqId>> more_releasers_;  // releasers after state_[b].releaser
  std::vector<BlockId> timed_;  // blocks with an expiry
  std::int64_t offloaded_ = 0;
  std::int64_t onboarded_ = 0;
  std::int64_t disk_read_failures_ = 0;
  EvictionPolicy policy_;
  // Disk slots: an unreferenced slot sits in the LRU set (ordered by the stamp of its last
  // queueing) when it caches content, in the free list otherwise.
  std::int32_t num_disk_ = 0;
  std::shared_ptr<SecondaryTier> tier_;
  std::uint64_t disk_clock_ = 0;
  std::vector<std::uint64_t> disk_stamp_;  // per disk slot: LRU stamp, 0 when not in the LRU
  std::vector<std::uint64_t> disk_hash_;   // per disk slot: key hash of the content last stored
  std::set<std::pair<std::uint64_t, BlockId>> disk_lru_;
  std::vector<BlockId> disk_free_;
  std::vector<bool> disk_in_free_;
  std::vector<unsigned char> disk_buffer_;  // one block read from disk (kept: no re-allocation)
};

}  // namespace kvcache
