// KVCacheManager, forks (beam search, parallel sampling): ForkSequence shares every block of a
// parent with its children; the copy-on-write door (CopyOnWrite) gives a writer a private copy of
// a block that is not private, for AddTokens and Prefill (CountBatchCopies, CopyBatchWrites) and
// Rewind.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"

namespace kvcache {

void KVCacheManager::ForkSequence(SeqId parent, const SeqId* children, std::size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  // 1. Validate everything first: the parent, then each child id, then the batch limit.
  const Sequence& src = Find(parent);
  for (std::size_t i = 0; i < n; ++i) {
    const SeqId c = children[i];
    if (c < 0) ThrowInvalid("fork_sequence: child request_id must be >= 0, got ", c);
    if (c == parent) ThrowInvalid("fork_sequence: cannot fork request ", parent, " into itself");
    if (sequences_.count(c) != 0) ThrowInvalid("fork_sequence: child request id ", c, " is already registered");
    for (std::size_t k = 0; k < i; ++k) {
      if (children[k] == c) ThrowInvalid("fork_sequence: child request id ", c, " appears twice");
    }
  }
  if (max_batch_size_ > 0 && sequences_.size() + n > static_cast<std::size_t>(max_batch_size_)) {
    throw KVCacheError(detail::Concat("fork_sequence: ", n, " children of request ", parent, " would exceed max_batch_size (",
                                      max_batch_size_, "); ", sequences_.size(), " sequences are registered"));
  }
  if (n == 0) return;
  // 2. Mutate. References into sequences_ stay valid while it grows (only iterators do not).
  sequences_.reserve(sequences_.size() + n);
  for (std::size_t i = 0; i < n; ++i) {
    Sequence& child = sequences_.emplace(children[i], src).first->second;
    child.id = children[i];
    child.batch_stamp = 0;
    child.reused_tokens = 0;
    child.reused_blocks = 0;
    child.missed_blocks = 0;
    child.new_blocks = 0;
    for (std::size_t w = 0; w < windows_.size(); ++w) {
      WindowBlockManager& wm = *windows_[w];
      const SequenceWindow& sw = child.windows[w];
      for (std::size_t j = static_cast<std::size_t>(sw.front_null); j < sw.blocks.size(); ++j) wm.Claim(sw.blocks[j]);
      counters_[w].forked += static_cast<std::int64_t>(sw.blocks.size()) - sw.front_null;
      // The parent's records of released blocks that still hold its content are the child's too.
      for (const auto& [b, generation] : sw.released) {
        if (b != kNullBlock && wm.Generation(b) == generation) wm.RecordRelease(b, child.id);
      }
    }
  }
  forked_ = true;
  if (backend_->HasMemory()) may_copy_.store(true, std::memory_order_relaxed);
}

std::int64_t KVCacheManager::CountBatchCopies() {
  std::int64_t total = 0;
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    const WindowBlockManager& wm = *windows_[w];
    std::int64_t copies = 0;
    shared_release_.clear();  // scratch: the written blocks that are not private
    for (std::size_t i = 0; i < batch_.size(); ++i) {
      if (batch_write_[i] < 0 || IsPrivate(*batch_[i], w, batch_write_[i])) continue;
      shared_release_.push_back(batch_[i]->windows[w].blocks[static_cast<std::size_t>(batch_write_[i])]);
    }
    if (!shared_release_.empty()) {
      std::sort(shared_release_.begin(), shared_release_.end());
      for (std::size_t i = 0; i < shared_release_.size();) {
        std::size_t j = i;
        const BlockId b = shared_release_[i];
        while (j < shared_release_.size() && shared_release_[j] == b) ++j;
        const auto writers = static_cast<std::int32_t>(j - i);
        const bool last_keeps = writers == wm.RefCount(b) && wm.NodeOf(b) == kNoNode && !wm.HasReleasers(b);
        copies += last_keeps ? writers - 1 : writers;
        i = j;
      }
    }
    check_need_[w] += copies;
    total += copies;
  }
  return total;
}

void KVCacheManager::CopyBatchWrites() {
  for (std::size_t i = 0; i < batch_.size(); ++i) {
    const std::int32_t j = batch_write_[i];
    if (j < 0) continue;
    Sequence& seq = *batch_[i];
    for (std::size_t w = 0; w < windows_.size(); ++w) {
      if (!IsPrivate(seq, w, j)) CopyOnWrite(seq, w, j, batch_kept_[i]);
    }
  }
}

void KVCacheManager::CopyOnWrite(Sequence& seq, std::size_t w, std::int32_t j, std::int32_t num_tokens) {
  WindowBlockManager& wm = *windows_[w];
  const BlockId shared = seq.windows[w].blocks[static_cast<std::size_t>(j)];
  wm.Claim(shared);  // held while it is copied from (a block with no other holder would be free)
  Detach(seq, w, j, j + 1, Leave::kEnd);
  AttachFresh(seq, w, j, j + 1);
  wm.CopyTokens(seq.windows[w].blocks[static_cast<std::size_t>(j)], shared, num_tokens);
  wm.Release(shared);
  ++counters_[w].copied;
  ++counters_[w].alloc_total;
  ++counters_[w].alloc_new;
  ++seq.new_blocks;
}

}  // namespace kvcache
