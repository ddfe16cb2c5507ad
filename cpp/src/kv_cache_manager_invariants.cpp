// KVCacheManager, invariant checks (tests and debugging): sequences' block lists, reference
// counts, the windows and the tree, slab ownership, release records and cached prefixes.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvcache/block_key.h"
#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"

namespace kvcache {
namespace {

std::int32_t CeilDiv(std::int64_t a, std::int64_t b) { return static_cast<std::int32_t>((a + b - 1) / b); }

}  // namespace

void KVCacheManager::CheckInvariants() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::vector<std::int32_t>> refs(windows_.size());
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    refs[w] = pins_[w];  // pins hold references too
  }
  for (const auto& [id, seq] : sequences_) CheckSequence(id, seq, &refs);
  tree_->CheckInvariants();
  for (std::size_t w = 0; w < windows_.size(); ++w) windows_[w]->CheckInvariants(refs[w]);
  lender_->CheckInvariants();
  CheckOwnership();
  CheckStateInvariants();
}

void KVCacheManager::CheckSequence(SeqId id, const Sequence& seq, std::vector<std::vector<std::int32_t>>* refs) const {
  KVC_CHECK(seq.id == id, "sequence id mismatch");
  KVC_CHECK(static_cast<std::int32_t>(seq.TokenCount()) == std::max(seq.num_tokens, seq.prompt_len),
            detail::Concat("request ", id, ": token count ", seq.TokenCount(), " for ", seq.num_tokens,
                           " tokens with blocks and a prompt of ", seq.prompt_len));
  KVC_CHECK(seq.num_tokens >= 1 && seq.num_tokens <= max_seq_len_, detail::Concat("request ", id, ": bad length"));
  const auto positions = static_cast<std::size_t>(CeilDiv(seq.num_tokens, tpb_));
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    const SequenceWindow& sw = seq.windows[w];
    KVC_CHECK(sw.blocks.size() == positions,
              detail::Concat("request ", id, ", window ", window_sizes_[w], ": ", sw.blocks.size(),
                             " block positions for ", seq.num_tokens, " tokens"));
    const std::int64_t limit = kinds_[w]->ReleasesBlocks() ? seq.num_tokens - window_sizes_[w] : 0;
    KVC_CHECK(static_cast<std::int32_t>(sw.released.size()) == sw.front_null,
              detail::Concat("request ", id, ": released list does not match the released front"));
    KVC_CHECK(sw.front_null == 0 || static_cast<std::int64_t>(sw.front_null) * tpb_ <= limit,
              detail::Concat("request ", id, ", window ", window_sizes_[w], ": ", sw.front_null,
                             " released blocks reach into the window"));
    for (std::size_t j = 0; j < positions; ++j) {
      const BlockId b = sw.blocks[j];
      if (static_cast<std::int32_t>(j) < sw.front_null) {
        KVC_CHECK(b == kNullBlock, detail::Concat("request ", id, ": released position ", j, " holds a block"));
        continue;
      }
      KVC_CHECK(b >= 0 && b < windows_[w]->num_primary() && windows_[w]->Owns(b),
                detail::Concat("request ", id, ", window ", window_sizes_[w], ": position ", j,
                               " holds invalid block ", b));
      ++(*refs)[w][static_cast<std::size_t>(b)];
    }
  }
}

void KVCacheManager::CheckOwnership() const {
  for (std::size_t w = 0; w < windows_.size(); ++w) CheckReleaseRecords(w);
  for (const auto& [id, seq] : sequences_) CheckCachedPrefixes(id, seq);
}

void KVCacheManager::CheckReleaseRecords(std::size_t w) const {
  // Every release record whose block was not handed out again names its sequence among the
  // block's releasers, and the releaser lists hold nothing else.
  const WindowBlockManager& wm = *windows_[w];
  std::vector<std::vector<SeqId>> expected(static_cast<std::size_t>(wm.num_blocks()));
  for (const auto& [id, seq] : sequences_) {
    for (const auto& [b, generation] : seq.windows[w].released) {
      if (b == kNullBlock) continue;
      KVC_CHECK(generation <= wm.Generation(b), detail::Concat("request ", id, ": release record of block ", b,
                                                               " is newer than the block"));
      if (wm.Generation(b) == generation) expected[static_cast<std::size_t>(b)].push_back(id);
    }
  }
  for (std::size_t b = 0; b < expected.size(); ++b) {
    std::vector<SeqId> got = wm.Releasers(static_cast<BlockId>(b));
    std::sort(got.begin(), got.end());
    std::sort(expected[b].begin(), expected[b].end());
    KVC_CHECK(got == expected[b], detail::Concat("window ", window_sizes_[w], ": block ", b, " has ", got.size(),
                                                 " releasers but ", expected[b].size(), " current release records"));
  }
}

void KVCacheManager::CheckCachedPrefixes(SeqId id, const Sequence& seq) const {
  // A cached block that the sequence holds, or still owns through a current release record, sits
  // at the tree node of the sequence's own prefix at that position: same depth, a key that is a
  // prefix of the block's tokens (a partial node keys only the first ones) and the same chained
  // hash. (A block cached under another prefix would serve that prefix stale KV.)
  const std::int32_t num_blocks = CeilDiv(seq.num_tokens, tpb_);
  std::vector<std::uint64_t> chain(static_cast<std::size_t>(num_blocks) + 1, 0);  // chain[j]: before block j
  for (std::int32_t d = 0; d < seq.num_tokens / tpb_; ++d) {  // full blocks: every block but maybe the last
    chain[static_cast<std::size_t>(d) + 1] =
        ChainHash(chain[static_cast<std::size_t>(d)], seq.TokenData() + static_cast<std::ptrdiff_t>(d) * tpb_, tpb_,
                  BlockExtrasDigest(seq.extras, d, d * tpb_, tpb_));
  }
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    const WindowBlockManager& wm = *windows_[w];
    const SequenceWindow& sw = seq.windows[w];
    auto check = [&](BlockId b, std::int32_t j) {
      const NodeId node = wm.NodeOf(b);
      if (node == kNoNode) return;
      const std::int32_t start = j * tpb_;
      const std::int32_t len = tree_->NumTokens(node);
      const TokenId* own = seq.TokenData() + start;
      const bool same = tree_->Depth(node) == j + 1 && len >= 1 && start + len <= seq.num_tokens &&
                        std::equal(own, own + len, tree_->Tokens(node)) &&
                        tree_->Hash(node) == ChainHash(chain[static_cast<std::size_t>(j)], own, len,
                                                       BlockExtrasDigest(seq.extras, j, start, len));
      KVC_CHECK(same, detail::Concat("request ", id, ", window ", window_sizes_[w], ": block ", b, " at position ", j,
                                     " is cached under a different prefix (tree node ", node, ", depth ",
                                     tree_->Depth(node), ", ", len, " tokens)"));
    };
    for (std::int32_t j = 0; j < sw.front_null; ++j) {
      const auto [b, generation] = sw.released[static_cast<std::size_t>(j)];
      if (b != kNullBlock && wm.Generation(b) == generation) check(b, j);
    }
    for (auto j = sw.front_null; j < static_cast<std::int32_t>(sw.blocks.size()); ++j) {
      check(sw.blocks[static_cast<std::size_t>(j)], j);
    }
  }
}

}  // namespace kvcache
