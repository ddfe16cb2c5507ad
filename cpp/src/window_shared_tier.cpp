// WindowBlockManager: block bytes to and from host memory, for the shared tier.
#include "kvcache/errors.h"
#include "kvcache/window_block_manager.h"

namespace kvcache {

std::size_t WindowBlockManager::BlockBytes() const {
  std::size_t total = 0;
  for (const PoolLayout& pool : pools_) total += pool.BlockBytes();
  return total;
}

void WindowBlockManager::CopyOut(BlockId b, unsigned char* dst) const {
  KVC_CHECK(IsPrimary(b), "copy out of a block that is not primary");
  std::size_t offset = 0;
  for (std::size_t p = 0; p < pools_.size(); ++p) {
    const std::size_t bytes = pools_[p].BlockBytes();
    backend_->Copy2D(dst + offset, CacheLevel::kSecondary, bytes, Address(b, p), CacheLevel::kPrimary, bytes, bytes, 1);
    offset += bytes;
  }
  backend_->Synchronize();
}

void WindowBlockManager::CopyIn(BlockId b, const unsigned char* src) {
  KVC_CHECK(IsPrimary(b), "copy into a block that is not primary");
  std::size_t offset = 0;
  for (std::size_t p = 0; p < pools_.size(); ++p) {
    const std::size_t bytes = pools_[p].BlockBytes();
    backend_->Copy2D(Address(b, p), CacheLevel::kPrimary, bytes, src + offset, CacheLevel::kSecondary, bytes, bytes, 1);
    offset += bytes;
  }
}

}  // namespace kvcache
