// A prompt converted and keyed once, accepted wherever a prompt is.
#pragma once

#include <cstdint>
#include <vector>

#include "kvcache/block_key.h"
#include "kvcache/types.h"

namespace kvcache {

/// A prompt converted and keyed once (KVCacheManager::Prepare): its tokens, its reuse extras and,
/// for every full block, the extras digest and the chained hash of the block key. A deferred
/// admission retried every step, a prefix lookup, a block-count query and a re-admission after
/// preemption then cost no conversion and no hashing. Immutable once made; valid for managers
/// with the same tokens_per_block (checked) and a max_seq_len it fits (checked).
struct PreparedPrompt {
  std::vector<TokenId> tokens;
  ReuseExtras extras;
  std::int32_t tokens_per_block = 0;
  std::vector<std::uint64_t> digests;  ///< Per full block: BlockExtrasDigest.
  std::vector<std::uint64_t> hashes;   ///< Per full block: chained hash (covers the prefix).
};

}  // namespace kvcache
