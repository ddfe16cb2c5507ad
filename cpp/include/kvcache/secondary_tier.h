// Tiers below host memory: where evicted host (secondary) blocks go next, and come back from.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvcache/types.h"

namespace kvcache {

/// Names one block's content in a tier. The core addresses a tier by (window, slot): it keeps
/// which slots hold what (the reuse tree links a node to a slot, slots are evicted LRU), so a
/// tier only stores bytes. `hash` is the block's chained key (the whole prefix), so a shared
/// store (LMCache, Redis, Mooncake) can key content across processes by (window, hash).
struct TierKey {
  WindowSize window = 0;
  BlockId slot = 0;          ///< 0-based slot inside the window's share of the tier.
  std::uint64_t hash = 0;    ///< Chained block hash of the content.
};

/// One contiguous piece of a block: a block is one segment per pool of its window.
struct TierSegment {
  void* data = nullptr;
  std::size_t bytes = 0;
};

/// A block store below host memory. Calls come from one thread at a time (under the manager's
/// lock). Put may refuse (returns false: the block is then dropped, never an error for the
/// caller). Get returns the content a Put accepted for the key, or false when it cannot return
/// exactly that content (I/O error, short read, missing or overwritten data, a failed check):
/// the manager then drops the block and the reuse hit stops there (a miss, never an error).
/// A tier must never fill `segments` with other content and return true.
class SecondaryTier {
 public:
  virtual ~SecondaryTier() = default;
  /// The `medium` that events report for blocks in this tier ("DISK" for the disk tier).
  virtual const char* Medium() const = 0;
  /// Stores the concatenation of `segments` as the content of `key`.
  virtual bool Put(const TierKey& key, const std::vector<TierSegment>& segments) = 0;
  /// Reads the content of `key` into `segments` (same sizes as its Put); false when it cannot
  /// (the segments' bytes are then unspecified). Never throws for a failed read.
  virtual bool Get(const TierKey& key, const std::vector<TierSegment>& segments) = 0;
  /// The slot no longer holds content (the tier may release its space).
  virtual void Erase(const TierKey& key) = 0;
};

/// A directory of files named by a random 64-bit instance id (16 hex digits), so two managers
/// never share a file, whatever their PIDs: `kvcache-<id>.lock`, created at once, and one
/// `kvcache-<id>-window-<W>.kvblocks` per window, created on its first write. Each is created
/// with O_EXCL (an id already taken is drawn again) and holds an exclusive flock while the tier
/// lives. A block is a slot of `kDiskSlotHeader + block_bytes` bytes at `slot * that`: a header
/// (magic, chained key hash, byte count, HashBytes checksum of the bytes), then the bytes; Get
/// verifies all four. At most `slots * (header + block_bytes)` bytes per window, so the tier is
/// bounded by the slot counts the manager sizes from `disk_cache_size`. An empty `directory`
/// makes a private temporary directory (under $TMPDIR, else /tmp). The files it created (and
/// the temporary directory) are removed when the last window releases the tier. Throws
/// KVCacheError, with the system's reason, when the directory cannot be created or a file
/// cannot be created in it.
std::shared_ptr<SecondaryTier> MakeDiskTier(const std::string& directory);

/// Bytes of the disk tier's per-slot header.
inline constexpr std::size_t kDiskSlotHeader = 32;

}  // namespace kvcache
