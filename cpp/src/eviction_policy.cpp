#include "kvcache/eviction_policy.h"

#include <cmath>

#include "kvcache/errors.h"

namespace kvcache {

EvictionPolicy::EvictionPolicy(std::int32_t num_primary, std::int32_t num_secondary, double protected_fraction,
                               std::int32_t slab_blocks)
    : num_primary_(num_primary),
      links_(static_cast<std::size_t>(num_primary + num_secondary)),
      protected_fraction_(protected_fraction),
      slab_blocks_(slab_blocks) {
  KVC_CHECK(protected_fraction >= 0.0 && protected_fraction <= 1.0, "protected fraction out of [0, 1]");
  KVC_CHECK(slab_blocks >= 0 && (slab_blocks == 0 || num_primary % slab_blocks == 0),
            "primary blocks must be whole slabs");
  head_.fill(kNullBlock);
  tail_.fill(kNullBlock);
  SetLevelSize(CacheLevel::kPrimary, num_primary);
  SetLevelSize(CacheLevel::kSecondary, num_secondary);
  if (slab_blocks > 0) {
    const auto slabs = static_cast<std::size_t>(num_primary / slab_blocks);
    slab_free_.assign(slabs, 0);
    slab_prev_.assign(slabs, -1);
    slab_next_.assign(slabs, -1);
    slab_listed_.assign(slabs, 0);
  }
}

void EvictionPolicy::SetLevelSize(CacheLevel level, std::int32_t num_blocks) {
  protected_cap_[static_cast<std::size_t>(level)] =
      static_cast<std::int32_t>(std::ceil(num_blocks * protected_fraction_));
}

void EvictionPolicy::SlabGained(BlockId b) {
  const std::int32_t s = b / slab_blocks_;
  const auto i = static_cast<std::size_t>(s);
  if (++slab_free_[i] < slab_blocks_) return;
  slab_listed_[i] = 1;  // every block free: append (newest last)
  slab_prev_[i] = slab_tail_;
  slab_next_[i] = -1;
  if (slab_tail_ >= 0) {
    slab_next_[static_cast<std::size_t>(slab_tail_)] = s;
  } else {
    slab_head_ = s;
  }
  slab_tail_ = s;
  ++num_free_slabs_;
}

void EvictionPolicy::SlabLost(BlockId b) {
  const std::int32_t s = b / slab_blocks_;
  const auto i = static_cast<std::size_t>(s);
  if (slab_free_[i]-- < slab_blocks_) return;
  slab_listed_[i] = 0;
  const std::int32_t prev = slab_prev_[i];
  const std::int32_t next = slab_next_[i];
  if (prev >= 0) {
    slab_next_[static_cast<std::size_t>(prev)] = next;
  } else {
    slab_head_ = next;
  }
  if (next >= 0) {
    slab_prev_[static_cast<std::size_t>(next)] = prev;
  } else {
    slab_tail_ = prev;
  }
  --num_free_slabs_;
}

void EvictionPolicy::Insert(BlockId b, int q, bool to_front) {
  Chain(b, q, to_front);
  const int lv = q / kQueuesPerLevel;
  const int slot = q % kQueuesPerLevel;
  occupied_[lv][slot >> 6] |= std::uint64_t{1} << (slot & 63);
  ++num_free_[lv];
  if (IsProtectedSlot(slot)) ++num_protected_[lv];
  if (slot == 0) ++num_scratch_[lv];
  if (slab_blocks_ > 0 && lv == 0) SlabGained(b);
}

void EvictionPolicy::PushScratchN(CacheLevel level, const BlockId* blocks, std::int32_t n, bool to_front) {
  if (n <= 0) return;
  const int lv = static_cast<int>(level);
  const int q = QueueIndex(level, 0);
  const auto queue = static_cast<std::int16_t>(q);
  // The blocks in the order they end up queued: each pushed to the front goes before the last.
  auto at = [&](std::int32_t i) { return blocks[to_front ? n - 1 - i : i]; };
  for (std::int32_t i = 0; i < n; ++i) {
    Link& l = links_[at(i)];
    l.queue = queue;
    l.prev = i > 0 ? at(i - 1) : kNullBlock;
    l.next = i + 1 < n ? at(i + 1) : kNullBlock;
  }
  // Then the run is spliced in whole, as Chain does with one block.
  const BlockId first = at(0);
  const BlockId last = at(n - 1);
  if (head_[q] == kNullBlock) {
    head_[q] = first;
    tail_[q] = last;
  } else if (to_front) {
    links_[last].next = head_[q];
    links_[head_[q]].prev = last;
    head_[q] = first;
  } else {
    links_[first].prev = tail_[q];
    links_[tail_[q]].next = first;
    tail_[q] = last;
  }
  occupied_[lv][0] |= 1;
  num_free_[lv] += n;
  num_scratch_[lv] += n;
  if (slab_blocks_ > 0 && lv == 0) {
    for (std::int32_t i = 0; i < n; ++i) SlabGained(blocks[i]);
  }
}

std::int32_t EvictionPolicy::PopScratch(CacheLevel level, std::int32_t n, BlockId* out) {
  const int lv = static_cast<int>(level);
  const int q = QueueIndex(level, 0);
  const std::int32_t k = n < num_scratch_[lv] ? n : num_scratch_[lv];
  BlockId b = head_[q];
  for (std::int32_t i = 0; i < k; ++i) {
    out[i] = b;
    Link& l = links_[b];
    l.queue = -1;
    l.prev = kNullBlock;
    b = l.next;
    l.next = kNullBlock;
  }
  if (slab_blocks_ > 0 && lv == 0) {
    for (std::int32_t i = 0; i < k; ++i) SlabLost(out[i]);
  }
  head_[q] = b;  // the first block left, or kNullBlock
  if (b != kNullBlock) {
    links_[b].prev = kNullBlock;
  } else {
    tail_[q] = kNullBlock;
    occupied_[lv][0] &= ~std::uint64_t{1};
  }
  num_free_[lv] -= k;
  num_scratch_[lv] -= k;
  return k;
}

void EvictionPolicy::Erase(BlockId b) {
  const int q = links_[b].queue;
  if (links_[b].prev != kNullBlock) {
    links_[links_[b].prev].next = links_[b].next;
  } else {
    head_[q] = links_[b].next;
  }
  if (links_[b].next != kNullBlock) {
    links_[links_[b].next].prev = links_[b].prev;
  } else {
    tail_[q] = links_[b].prev;
  }
  links_[b].prev = links_[b].next = kNullBlock;
  links_[b].queue = -1;
  const int lv = q / kQueuesPerLevel;
  const int slot = q % kQueuesPerLevel;
  if (head_[q] == kNullBlock) occupied_[lv][slot >> 6] &= ~(std::uint64_t{1} << (slot & 63));
  --num_free_[lv];
  if (IsProtectedSlot(slot)) --num_protected_[lv];
  if (slot == 0) --num_scratch_[lv];
  if (slab_blocks_ > 0 && lv == 0) SlabLost(b);
}

BlockId EvictionPolicy::Push(BlockId b, int priority, bool to_front, bool protect) {
  KVC_CHECK(links_[b].queue < 0, detail::Concat("block ", b, " is already free"));
  KVC_CHECK(priority == kScratch || (priority >= kMinPriority && priority <= kMaxPriority),
            "priority out of range");
  const CacheLevel level = LevelOf(b);
  const int lv = static_cast<int>(level);
  const int slot = Slot(priority, protect && priority != kScratch);
  const int q = QueueIndex(level, slot);
  Insert(b, q, to_front);
  if (!IsProtectedSlot(slot) || num_protected_[lv] <= protected_cap_[lv]) return kNullBlock;
  const BlockId oldest = head_[q];  // may be b itself when the cap is 0
  Erase(oldest);
  Insert(oldest, q - 1, /*to_front=*/false);
  return oldest;
}

void EvictionPolicy::Remove(BlockId b) {
  KVC_CHECK(links_[b].queue >= 0, detail::Concat("block ", b, " is not free"));
  Erase(b);
}

int EvictionPolicy::QueuedPriority(BlockId b) const {
  KVC_CHECK(links_[b].queue >= 0, "block is not free");
  const int slot = links_[b].queue % kQueuesPerLevel;
  return slot == 0 ? kScratch : (slot - 1) / 2;
}

bool EvictionPolicy::QueuedProtected(BlockId b) const {
  KVC_CHECK(links_[b].queue >= 0, "block is not free");
  return IsProtectedSlot(links_[b].queue % kQueuesPerLevel);
}

BlockId EvictionPolicy::PeekCached(CacheLevel level) const {
  const int lv = static_cast<int>(level);
  for (int word = 0; word < kMaskWords; ++word) {
    std::uint64_t bits = occupied_[lv][word];
    if (word == 0) bits &= ~std::uint64_t{1};  // not the scratch queue
    if (bits != 0) return head_[QueueIndex(level, word * 64 + __builtin_ctzll(bits))];
  }
  return kNullBlock;
}

BlockId EvictionPolicy::Peek(CacheLevel level) const {
  const int lv = static_cast<int>(level);
  for (int word = 0; word < kMaskWords; ++word) {
    const std::uint64_t bits = occupied_[lv][word];
    if (bits != 0) {
      const int slot = word * 64 + __builtin_ctzll(bits);
      return head_[QueueIndex(level, slot)];
    }
  }
  return kNullBlock;
}

}  // namespace kvcache
