#include "kvcache/eviction_policy.h"

#include "kvcache/errors.h"

namespace kvcache {

EvictionPolicy::EvictionPolicy(std::int32_t num_primary, std::int32_t num_secondary)
    : num_primary_(num_primary),
      prev_(static_cast<std::size_t>(num_primary + num_secondary), kNullBlock),
      next_(static_cast<std::size_t>(num_primary + num_secondary), kNullBlock),
      queue_of_(static_cast<std::size_t>(num_primary + num_secondary), -1) {
  head_.fill(kNullBlock);
  tail_.fill(kNullBlock);
}

void EvictionPolicy::Push(BlockId b, int priority, bool to_front) {
  KVC_CHECK(queue_of_[b] < 0, detail::Concat("block ", b, " is already free"));
  KVC_CHECK(priority == kScratch || (priority >= kMinPriority && priority <= kMaxPriority),
            "priority out of range");
  const CacheLevel level = LevelOf(b);
  const int slot = priority + 1;
  const int q = QueueIndex(level, slot);
  queue_of_[b] = static_cast<std::int16_t>(q);
  if (head_[q] == kNullBlock) {
    prev_[b] = next_[b] = kNullBlock;
    head_[q] = tail_[q] = b;
  } else if (to_front) {
    prev_[b] = kNullBlock;
    next_[b] = head_[q];
    prev_[head_[q]] = b;
    head_[q] = b;
  } else {
    next_[b] = kNullBlock;
    prev_[b] = tail_[q];
    next_[tail_[q]] = b;
    tail_[q] = b;
  }
  const int lv = static_cast<int>(level);
  occupied_[lv][slot >> 6] |= std::uint64_t{1} << (slot & 63);
  ++num_free_[lv];
}

void EvictionPolicy::Remove(BlockId b) {
  const int q = queue_of_[b];
  KVC_CHECK(q >= 0, detail::Concat("block ", b, " is not free"));
  if (prev_[b] != kNullBlock) {
    next_[prev_[b]] = next_[b];
  } else {
    head_[q] = next_[b];
  }
  if (next_[b] != kNullBlock) {
    prev_[next_[b]] = prev_[b];
  } else {
    tail_[q] = prev_[b];
  }
  prev_[b] = next_[b] = kNullBlock;
  queue_of_[b] = -1;
  const int lv = q / kQueuesPerLevel;
  const int slot = q % kQueuesPerLevel;
  if (head_[q] == kNullBlock) occupied_[lv][slot >> 6] &= ~(std::uint64_t{1} << (slot & 63));
  --num_free_[lv];
}

int EvictionPolicy::QueuedPriority(BlockId b) const {
  KVC_CHECK(queue_of_[b] >= 0, "block is not free");
  return queue_of_[b] % kQueuesPerLevel - 1;
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
