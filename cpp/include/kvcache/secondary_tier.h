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
/// caller); content a Put accepted must be returned by Get until the slot is Put again or
/// Erased. Get failing after an accepted Put is an environment fault (disk gone): it throws
/// KVCacheError.
class SecondaryTier {
 public:
  virtual ~SecondaryTier() = default;
  /// The `medium` that events report for blocks in this tier ("DISK" for the disk tier).
  virtual const char* Medium() const = 0;
  /// Stores the concatenation of `segments` as the content of `key`.
  virtual bool Put(const TierKey& key, const std::vector<TierSegment>& segments) = 0;
  /// Reads the content of `key` into `segments` (same sizes as its Put).
  virtual void Get(const TierKey& key, const std::vector<TierSegment>& segments) = 0;
  /// The slot no longer holds content (the tier may release its space).
  virtual void Erase(const TierKey& key) = 0;
};

/// A directory of files, one per window (`kvcache-<pid>-<n>-window-<W>.kvblocks`), a block at offset
/// `slot * block_bytes`; at most `slots * block_bytes` bytes per window, so the tier is bounded
/// by the slot counts the manager sizes from `disk_cache_size`. An empty `directory` makes a
/// private temporary directory (under $TMPDIR, else /tmp). The files it created (and the
/// temporary directory) are removed when the last window releases the tier. Throws
/// KVCacheError when the directory cannot be created or written.
std::shared_ptr<SecondaryTier> MakeDiskTier(const std::string& directory);

}  // namespace kvcache
