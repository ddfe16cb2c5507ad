#include "kvcache/eviction_policy.h"

#include "kvcache/errors.h"

namespace kvcache {

EvictionPolicy::EvictionPolicy(std::int32_t num_primary, std::int32_t num_secondary)
    : num_primary_(num_primary),
      links_(static_cast<std::size_t>(num_primary + num_secondary)) {
  head_.fill(kNullBlock);
  tail_.fill(kNullBlock);
}

void EvictionPolicy::Push(BlockId b, int priority, bool to_front) {
  KVC_CHECK(links_[b].queue < 0, detail::Concat("block ", b, " is already free"));
  KVC_CHECK(priority == kScratch || (priority >= kMinPriority && priority <= kMaxPriority),
            "priority out of range");
  const CacheLevel level = LevelOf(b);
  const int slot = priority + 1;
  const int q = QueueIndex(level, slot);
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
  const int lv = static_cast<int>(level);
  occupied_[lv][slot >> 6] |= std::uint64_t{1} << (slot & 63);
  ++num_free_[lv];
}

void EvictionPolicy::Remove(BlockId b) {
  const int q = links_[b].queue;
  KVC_CHECK(q >= 0, detail::Concat("block ", b, " is not free"));
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
}

int EvictionPolicy::QueuedPriority(BlockId b) const {
  KVC_CHECK(links_[b].queue >= 0, "block is not free");
  return links_[b].queue % kQueuesPerLevel - 1;
}

BlockId EvictionPolicy::Peek(CacheLevel level) const {
  const int lv = static_cast<int>(level);
  for (int word = 0; word < 2; ++word) {
    const std::uint64_t bits = occupied_[lv][word];
    if (bits != 0) {
      const int slot = word * 64 + __builtin_ctzll(bits);
      return head_[QueueIndex(level, slot)];
    }
  }
  return kNullBlock;
}

}  // namespace kvcache
