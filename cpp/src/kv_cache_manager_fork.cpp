// KVCacheManager, forks (beam search, parallel sampling): ForkSequence shares every block of a
// parent with its children; the copy-on-write door (CopyOnWrite) gives a writer a private copy of
// a block that is not private, for AddTokens and Prefill (CountBatchCopies, CopyBatchWrites) and
// Rewind.
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "kvcache/block_math.h"

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
    ForkState(src, child);
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

std::int64_t KVCacheManager::KeptCopies(const SeqId* ids, std::size_t n, std::size_t w) const {
  if (!forked_) return 0;
  const WindowBlockManager& wm = *windows_[w];
  std::vector<BlockId> written;  // the shared partial blocks written, one per writer
  for (std::size_t i = 0; i < n; ++i) {
    const Sequence& seq = Find(ids[i]);
    if (seq.num_tokens % tpb_ == 0) continue;
    const std::int32_t j = seq.num_tokens / tpb_;
    if (!IsPrivate(seq, w, j)) written.push_back(seq.windows[w].blocks[static_cast<std::size_t>(j)]);
  }
  std::sort(written.begin(), written.end());
  std::int64_t kept = 0;
  for (std::size_t i = 0; i < written.size();) {
    std::size_t j = i;
    while (j < written.size() && written[j] == written[i]) ++j;
    const BlockId b = written[i];
    if (static_cast<std::int32_t>(j - i) == wm.RefCount(b) && wm.NodeOf(b) == kNoNode && !wm.HasReleasers(b)) ++kept;
    i = j;
  }
  return kept;
}

bool KVCacheManager::GetFamilyRemainingBlocks(const SeqId* ids, std::size_t n, std::int32_t final_tokens,
                                              std::vector<std::int64_t>* remaining,
                                              std::vector<std::int64_t>* family_refs) const {
  namespace bm = block_math;
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<const Sequence*> seqs(n);
  for (std::size_t i = 0; i < n; ++i) {
    seqs[i] = &Find(ids[i]);
    for (std::size_t k = 0; k < i; ++k) {
      if (ids[k] == ids[i]) ThrowInvalid("family remaining blocks: request id ", ids[i], " appears twice");
    }
  }
  if (n == 0) return false;
  const Sequence& first = *seqs[0];
  for (const Sequence* seq : seqs) {
    if (seq->InPrefill() || seq->num_tokens != first.num_tokens) return false;
    for (std::size_t w = 0; w < windows_.size(); ++w) {
      if (seq->windows[w].front_null != first.windows[w].front_null ||
          seq->windows[w].blocks.size() != first.windows[w].blocks.size()) {
        return false;
      }
    }
  }
  const std::int64_t cur = first.num_tokens;
  const std::int64_t final = std::max<std::int64_t>(final_tokens, cur);
  const auto k = static_cast<std::int64_t>(n);
  const std::int64_t tail = bm::CeilDiv(cur, tpb_);               // positions with blocks
  const std::int64_t part = cur % tpb_ != 0 ? cur / tpb_ : -1;    // the partial block's position
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    if (static_cast<std::int64_t>(first.windows[w].blocks.size()) != tail) return false;
  }
  remaining->assign(windows_.size(), 0);
  family_refs->assign(windows_.size(), 0);
  std::vector<std::pair<BlockId, std::int32_t>> held;  // (block, position), one per holder
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    const WindowBlockManager& wm = *windows_[w];
    const std::int32_t front = first.windows[w].front_null;
    held.clear();
    for (const Sequence* seq : seqs) {
      const std::vector<BlockId>& blocks = seq->windows[w].blocks;
      for (std::size_t j = static_cast<std::size_t>(front); j < blocks.size(); ++j) {
        held.emplace_back(blocks[j], static_cast<std::int32_t>(j));
      }
    }
    std::sort(held.begin(), held.end());
    // Per position: distinct blocks the family holds (`now`) and those someone else holds too
    // (`kept`: the family's release frees nothing).
    const auto span = static_cast<std::size_t>(std::max<std::int64_t>(0, tail - front));
    std::vector<std::int64_t> now(span, 0), kept(span, 0);
    for (std::size_t i = 0; i < held.size();) {
      std::size_t j = i;
      while (j < held.size() && held[j].first == held[i].first) ++j;
      const auto holders = static_cast<std::int32_t>(j - i);
      const auto p = static_cast<std::size_t>(held[i].second - front);
      ++now[p];
      if (wm.RefCount(held[i].first) > holders) ++kept[p];
      if (bm::Releases(keep_[w])) (*family_refs)[w] += holders - 1;
      i = j;
    }
    std::int64_t base = 0;
    for (const std::int64_t c : now) base += c;
    // Usage after m tokens: every position at or past the released front holds its distinct
    // blocks (the partial one: one private block per beam once written), released ones what
    // others keep, and each beam's new positions its own block.
    auto usage = [&](std::int64_t m) {
      const std::int64_t rel = std::max<std::int64_t>(front, bm::Released(m, keep_[w], tpb_));
      std::int64_t u = 0;
      for (std::int64_t p = front; p < tail; ++p) {
        const auto q = static_cast<std::size_t>(p - front);
        if (p < rel) {
          u += kept[q];
        } else {
          u += p == part ? k + kept[q] : now[q];
        }
      }
      return u + k * std::max<std::int64_t>(0, bm::CeilDiv(m, tpb_) - std::max(tail, rel));
    };
    std::int64_t peak = base;
    if (final > cur) {
      // Without releases usage only grows; with them it is periodic (period tpb) once every
      // held position was released, so the first block positions after that suffice.
      const std::int64_t last = bm::Releases(keep_[w]) ? std::min(final, keep_[w] + tpb_ * (tail + 2)) : cur + 1;
      for (std::int64_t m = cur + 1; m <= last; ++m) peak = std::max(peak, usage(m));
      peak = std::max(peak, usage(final));
    }
    (*remaining)[w] = std::max<std::int64_t>(0, peak - base);
  }
  return true;
}

}  // namespace kvcache
