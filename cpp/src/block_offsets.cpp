// KVCacheManager, the block-offset table: per pool, K/V and sequence, the offsets of its blocks
// from the pool's base, as an engine's attention kernel reads them.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"

namespace kvcache {

std::int32_t KVCacheManager::CopyBlockOffsets(std::int32_t* out, std::int64_t rows, std::int64_t width,
                                              const SeqId* ids, std::size_t n, std::int64_t slot_offset) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (slot_offset < 0) ThrowInvalid("slot_offset must be >= 0, got ", slot_offset);
  if (rows < 0 || width < 0) ThrowInvalid("copy_block_offsets: negative output shape ", rows, " x ", width);
  // Compared without forming slot_offset + n, which can overflow.
  if (slot_offset > rows || static_cast<std::uint64_t>(n) > static_cast<std::uint64_t>(rows - slot_offset)) {
    ThrowInvalid("copy_block_offsets: ", n, " rows from slot_offset ", slot_offset, " do not fit an output with ", rows,
                 " rows");
  }
  std::int32_t widest = 0;
  std::vector<const Sequence*> seqs;
  seqs.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    seqs.push_back(&Find(ids[i]));
    widest = std::max(widest, static_cast<std::int32_t>(seqs.back()->windows[0].blocks.size()));
  }
  if (widest > width) {
    ThrowInvalid("copy_block_offsets: a sequence spans ", widest, " blocks but the output is ", width, " wide");
  }
  const std::int64_t kv = kv_factor_;
  for (std::size_t g = 0; g < pool_index_.size(); ++g) {
    const auto [w, p] = pool_index_[g];
    // Offsets count K/V slabs of the pool from its base; a block is `stride` of them.
    const std::int64_t stride =
        static_cast<std::int64_t>(windows_[w]->primary_stride(p) / windows_[w]->pools()[p].SlabBytes());
    for (std::size_t i = 0; i < n; ++i) {
      const auto& blocks = seqs[i]->windows[w].blocks;
      for (std::int64_t k = 0; k < kv; ++k) {
        std::int32_t* row = out + ((static_cast<std::int64_t>(g) * rows + slot_offset + static_cast<std::int64_t>(i)) * kv + k) * width;
        std::int32_t j = 0;
        for (; j < static_cast<std::int32_t>(blocks.size()); ++j) {
          const BlockId b = blocks[static_cast<std::size_t>(j)];
          row[j] = b == kNullBlock ? kOffsetSentinel : static_cast<std::int32_t>(b * stride + k);
        }
        for (; j < widest; ++j) row[j] = kOffsetSentinel;
      }
    }
  }
  return widest;
}

}  // namespace kvcache
