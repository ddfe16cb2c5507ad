#include "kvcache/eviction_policy.h"

#include <cmath>

#include "kvcache/errors.h"

namespace kvcache {

EvictionPolicy::EvictionPolicy(std::int32_t num_primary, std::int32_t num_secondary, double protected_fraction)
    : num_primary_(num_primary),
      links_(static_cast<std::size_t>(num_primary + num_secondary)) {
  KVC_CHECK(protected_fraction >= 0.0 && protected_fraction <= 1.0, "protected fraction out of [0, 1]");
  head_.fill(kNullBlock);
  tail_.fill(kNullBlock);
  auto cap = [&](std::int32_t n) { return static_cast<std::int32_t>(std::ceil(n * protected_fraction)); };
  protected_cap_ = {cap(num_primary), cap(num_secondary)};
}

void EvictionPolicy::Insert(BlockId b, int q, bool to_front) {
  links_[b].queue = static_cast<std::int16_t>(q);
  if (head_[q] == kNullBlock) {
    links_[b].prev = links_[b].next = kNullBlock;
    head_[q] = tail_[q] = b;
  } else if (to_front) {
    links_[b].prev = kNullBlock;
    links_[b].next = head_[q];
    links_[head_[q]].prev = b;
    head_[q] = b;
  } else {
    links_[b].next = kNullBlock;
    links_[b].prev = tail_[q];
    links_[tail_[q]].next = b;
    tail_[q] = b;
  }
  const int lv = q / kQueuesPerLevel;
  const int slot = q % kQueuesPerLevel;
  occupied_[lv][slot >> 6] |= std::uint64_t{1} << (slot & 63);
  ++num_free_[lv];
  if (IsProtectedSlot(slot)) ++num_protected_[lv];
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
