#include "kvcache/window_block_manager.h"

#include <utility>

#include "kvcache/errors.h"

namespace kvcache {

WindowBlockManager::WindowBlockManager(WindowSize window, bool is_swa,
                                       std::vector<PoolLayout> pools, std::int32_t num_primary,
                                       std::int32_t num_secondary, MemoryBackend* backend)
    : window_(window),
      is_swa_(is_swa),
      pools_(std::move(pools)),
      num_primary_(num_primary),
      num_secondary_(num_secondary),
      backend_(backend),
      ref_count_(static_cast<std::size_t>(num_primary + num_secondary), 0),
      owner_(static_cast<std::size_t>(num_primary + num_secondary), -1),
      policy_(num_primary, num_secondary) {
  primary_.assign(pools_.size(), nullptr);
  secondary_.assign(pools_.size(), nullptr);
  try {
    for (std::size_t p = 0; p < pools_.size(); ++p) {
      const std::size_t primary_bytes = pools_[p].BlockBytes() * static_cast<std::size_t>(num_primary);
      const std::size_t secondary_bytes =
          pools_[p].BlockBytes() * static_cast<std::size_t>(num_secondary);
      primary_[p] = backend_->Allocate(CacheLevel::kPrimary, primary_bytes);
      if (backend_->HasMemory()) allocated_bytes_ += primary_bytes;
      if (secondary_bytes > 0) {
        secondary_[p] = backend_->Allocate(CacheLevel::kSecondary, secondary_bytes);
        if (backend_->HasMemory()) allocated_bytes_ += secondary_bytes;
      }
    }
  } catch (...) {
    for (std::size_t p = 0; p < pools_.size(); ++p) {
      backend_->Free(CacheLevel::kPrimary, primary_[p]);
      backend_->Free(CacheLevel::kSecondary, secondary_[p]);
    }
    throw;
  }
  // Every block starts free and empty, in id order.
  for (BlockId b = 0; b < num_primary + num_secondary; ++b) policy_.Push(b, EvictionPolicy::kScratch);
}

WindowBlockManager::~WindowBlockManager() {
  for (std::size_t p = 0; p < pools_.size(); ++p) {
    backend_->Free(CacheLevel::kPrimary, primary_[p]);
    backend_->Free(CacheLevel::kSecondary, secondary_[p]);
  }
}

BlockId WindowBlockManager::Acquire(SeqId owner) {
  const BlockId b = policy_.Peek(CacheLevel::kPrimary);
  KVC_CHECK(b != kNullBlock, detail::Concat("window ", window_, " has no free block to hand out"));
  policy_.Remove(b);
  ref_count_[b] = 1;
  owner_[b] = owner;
  return b;
}

void WindowBlockManager::AddRef(BlockId b) {
  KVC_CHECK(ref_count_[b] > 0, "AddRef on an unreferenced block");
  ++ref_count_[b];
}

void WindowBlockManager::Release(BlockId b, bool to_front) {
  KVC_CHECK(ref_count_[b] > 0, detail::Concat("window ", window_, ": release of free block ", b));
  if (--ref_count_[b] == 0) policy_.Push(b, EvictionPolicy::kScratch, to_front);
}

void WindowBlockManager::CheckInvariants(const std::vector<std::int32_t>& expected_refs) const {
  const auto total = static_cast<BlockId>(ref_count_.size());
  KVC_CHECK(static_cast<BlockId>(expected_refs.size()) == total, "reference table size");
  std::int32_t free_primary = 0;
  std::int32_t free_secondary = 0;
  for (BlockId b = 0; b < total; ++b) {
    if (ref_count_[b] != expected_refs[b]) {
      throw InternalError(detail::Concat("window ", window_, ": block ", b, " has ref count ",
                                         ref_count_[b], " but ", expected_refs[b],
                                         " references from sequences"));
    }
    const bool free = ref_count_[b] == 0;
    if (free != policy_.Contains(b)) {
      throw InternalError(detail::Concat("window ", window_, ": block ", b,
                                         free ? " is unreferenced but not in a free queue"
                                              : " is referenced but sits in a free queue"));
    }
    if (free) (b < num_primary_ ? free_primary : free_secondary)++;
  }
  std::int32_t visited = 0;
  policy_.ForEach(CacheLevel::kPrimary, [&](BlockId b) {
    KVC_CHECK(b >= 0 && b < num_primary_, "secondary block in the primary free queue");
    ++visited;
  });
  KVC_CHECK(visited == free_primary && policy_.NumFree(CacheLevel::kPrimary) == free_primary,
            detail::Concat("window ", window_, ": primary free count ",
                           policy_.NumFree(CacheLevel::kPrimary), " but ", free_primary,
                           " free blocks (", visited, " queued)"));
  visited = 0;
  policy_.ForEach(CacheLevel::kSecondary, [&](BlockId b) {
    KVC_CHECK(b >= num_primary_ && b < total, "primary block in the secondary free queue");
    ++visited;
  });
  KVC_CHECK(visited == free_secondary && policy_.NumFree(CacheLevel::kSecondary) == free_secondary,
            detail::Concat("window ", window_, ": secondary free count mismatch"));
}

}  // namespace kvcache
