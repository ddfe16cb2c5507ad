// WindowBlockManager: the disk tier below the secondary (host) pool.
#include <utility>

#include "kvcache/errors.h"
#include "kvcache/window_block_manager.h"

namespace kvcache {

void WindowBlockManager::AttachTier(std::int32_t num_disk, std::shared_ptr<SecondaryTier> tier) {
  KVC_CHECK(num_disk_ == 0 && num_disk >= 0, "disk tier attached twice");
  num_disk_ = num_disk;
  tier_ = std::move(tier);
  const auto total = static_cast<std::size_t>(num_blocks());
  state_.resize(total);
  more_releasers_.resize(total);
  disk_stamp_.assign(static_cast<std::size_t>(num_disk), 0);
  disk_hash_.assign(static_cast<std::size_t>(num_disk), 0);
  disk_in_free_.assign(static_cast<std::size_t>(num_disk), false);
  // Handed out lowest id first.
  for (BlockId d = num_blocks() - 1; d >= num_primary_ + num_secondary_; --d) DiskQueue(d);
}

TierKey WindowBlockManager::KeyOf(BlockId d) const {
  TierKey key;
  key.window = window_;
  key.slot = d - num_primary_ - num_secondary_;
  // The hash the content was stored under: a claimed slot keeps its bytes even when a drop
  // unlinked its node meanwhile (the sequence that claimed it still reads them).
  key.hash = disk_hash_[static_cast<std::size_t>(key.slot)];
  return key;
}

void WindowBlockManager::DiskQueue(BlockId d) {
  const auto i = static_cast<std::size_t>(d - num_primary_ - num_secondary_);
  if (state_[d].node != kNoNode) {
    disk_stamp_[i] = ++disk_clock_;
    disk_lru_.emplace(disk_stamp_[i], d);
  } else {
    disk_in_free_[i] = true;
    disk_free_.push_back(d);
  }
}

void WindowBlockManager::DiskUnqueue(BlockId d) {
  const auto i = static_cast<std::size_t>(d - num_primary_ - num_secondary_);
  if (disk_stamp_[i] != 0) {
    disk_lru_.erase({disk_stamp_[i], d});
    disk_stamp_[i] = 0;
  } else if (disk_in_free_[i]) {
    // Free slots leave the list only from its back (SpillToDisk) or here, rarely.
    for (auto it = disk_free_.end(); it != disk_free_.begin();) {
      --it;
      if (*it == d) {
        disk_free_.erase(it);
        break;
      }
    }
    disk_in_free_[i] = false;
  }
}

bool WindowBlockManager::SpillToDisk(BlockId s) {
  if (num_disk_ == 0 || state_[s].priority < options_.secondary_offload_min_priority) return false;
  if (disk_free_.empty()) {
    if (disk_lru_.empty()) return false;  // every slot is claimed
    Drop(disk_lru_.begin()->second);      // the least recently used disk content goes
  }
  if (state_[s].node == kNoNode) return true;  // that drop cascaded to `s`: nothing to keep
  KVC_CHECK(!disk_free_.empty(), "dropping a disk slot freed nothing");
  const BlockId d = disk_free_.back();
  DiskUnqueue(d);
  const NodeId n = state_[s].node;
  if (tier_ != nullptr && backend_->HasMemory()) {
    backend_->Synchronize();  // `s` may still be receiving an offload
    std::vector<TierSegment> segments;
    for (std::size_t p = 0; p < pools_.size(); ++p) segments.push_back({Address(s, p), pools_[p].BlockBytes()});
    TierKey key;
    key.window = window_;
    key.slot = d - num_primary_ - num_secondary_;
    key.hash = tree_->Hash(n);
    if (!tier_->Put(key, segments)) {
      DiskQueue(d);
      return false;
    }
  }
  disk_hash_[static_cast<std::size_t>(d - num_primary_ - num_secondary_)] = tree_->Hash(n);
  tree_->SetBlock(n, index_, d);
  state_[d].node = n;
  state_[s].node = kNoNode;
  state_[d].priority = state_[s].priority;
  state_[d].expiry_ms = 0;
  state_[d].hit = false;  // the disk tier is plain LRU; an onboard marks the hit again
  state_[s].hit = false;
  DiskQueue(d);
  EmitUpdated(d, std::make_pair(1, 2), std::nullopt);
  return true;
}

std::vector<TierSegment> WindowBlockManager::ReadDisk(BlockId d, std::vector<unsigned char>* buffer) {
  std::size_t total = 0;
  for (const PoolLayout& pool : pools_) total += pool.BlockBytes();
  buffer->resize(total);
  std::vector<TierSegment> segments;
  std::size_t offset = 0;
  for (const PoolLayout& pool : pools_) {
    segments.push_back({buffer->data() + offset, pool.BlockBytes()});
    offset += pool.BlockBytes();
  }
  if (!tier_->Get(KeyOf(d), segments)) {
    throw DiskReadError(index_, d, detail::Concat("window ", window_, ": disk block ", d,
                                                  " cannot be read back intact"));
  }
  return segments;
}

void WindowBlockManager::DropUnreadable(BlockId d) {
  KVC_CHECK(IsDisk(d) && state_[d].ref_count == 0,
            detail::Concat("window ", window_, ": unreadable block ", d, " is not an unreferenced disk slot"));
  ++disk_read_failures_;
  // A drop may have unlinked it while it was claimed: then it is a free slot already.
  if (state_[d].node != kNoNode) Drop(d);
}

void WindowBlockManager::CheckDiskSlot(BlockId d) const {
  const auto i = static_cast<std::size_t>(d - num_primary_ - num_secondary_);
  const bool in_lru = disk_stamp_[i] != 0 && disk_lru_.count({disk_stamp_[i], d}) == 1;
  const bool cached = state_[d].node != kNoNode;
  if (state_[d].ref_count > 0) {
    KVC_CHECK(!in_lru && !disk_in_free_[i],
              detail::Concat("window ", window_, ": claimed disk block ", d, " sits in a disk queue"));
    return;
  }
  KVC_CHECK(in_lru == cached && disk_in_free_[i] == !cached,
            detail::Concat("window ", window_, ": unreferenced disk block ", d,
                           cached ? " caches content but is not in the disk LRU"
                                  : " holds nothing but is not in the free list"));
}

}  // namespace kvcache
