// KVCacheManager, reuse half: planning a prefix hit, storing chains, pins, events, priorities.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"

namespace kvcache {
namespace {

std::int32_t CommonPrefix(const TokenId* a, const TokenId* b, std::int32_t n) {
  std::int32_t i = 0;
  for (; i + 2 <= n; i += 2) {  // two tokens a step while they match
    std::uint64_t x = 0;
    std::uint64_t y = 0;
    std::memcpy(&x, a + i, sizeof x);
    std::memcpy(&y, b + i, sizeof y);
    if (x != y) break;
  }
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

constexpr std::size_t kMaxWindowsOnStack = 16;

}  // namespace

const KVCacheManager::ReusePlan& KVCacheManager::PlanReuse(const TokenId* tokens, std::size_t n,
                                                           const ReuseExtras& extras,
                                                           const PreparedPrompt* prepared) const {
  ReusePlan& plan = plan_;  // reused: its vectors keep their capacity between calls
  const std::size_t nw = windows_.size();
  plan.path.clear();
  plan.full_blocks = 0;
  plan.partial = kNoNode;
  plan.partial_tokens = 0;
  plan.reused_tokens = 0;
  plan.shared_blocks = 0;
  plan.attention_blocks = 0;
  plan.full_attention_blocks = 0;
  plan.restore.assign(states_.size(), kNoSlot);
  plan.partial_src.assign(nw, kNullBlock);
  plan.partial_takeover.assign(nw, 0);
  if (!reuse_) return plan;
  // The last prompt token is never part of a key: its KV is computed again for the logits.
  const auto key_len = static_cast<std::int32_t>(n) - 1;
  if (key_len <= 0) return plan;
  MatchFullBlocks(tokens, key_len / tpb_, extras, prepared, &plan.path);
  plan.full_blocks = ServedPrefix(plan.path, &plan.full_attention_blocks);
  plan.attention_blocks = plan.full_blocks;
  if (!states_.empty()) {
    // Every state group must resume exactly at a block boundary: no partial block.
    plan.full_blocks = StateServed(plan.path, plan.full_blocks, &plan);
    plan.reused_tokens = plan.full_blocks * tpb_;
    return plan;
  }
  plan.reused_tokens = plan.full_blocks * tpb_;
  if (!partial_reuse_) return plan;
  if (MatchPartialBlock(tokens, key_len, extras, &plan)) {
    KVC_CHECK(plan.reused_tokens < static_cast<std::int32_t>(n), "reuse plan covers the last prompt token");
  }
  return plan;
}

void KVCacheManager::MatchFullBlocks(const TokenId* tokens, std::int32_t num_full, const ReuseExtras& extras,
                                     const PreparedPrompt* prepared, std::vector<NodeId>* path) const {
  NodeId node = ReuseTree::kRoot;
  std::uint64_t hash = 0;
  path->reserve(static_cast<std::size_t>(num_full));
  for (std::int32_t d = 0; d < num_full; ++d) {
    const TokenId* t = tokens + static_cast<std::ptrdiff_t>(d) * tpb_;
    const auto i = static_cast<std::size_t>(d);
    const std::uint64_t digest = prepared != nullptr ? prepared->digests[i] : BlockExtrasDigest(extras, d, d * tpb_, tpb_);
    const std::uint64_t h = prepared != nullptr ? prepared->hashes[i] : ChainHash(hash, t, tpb_, digest);
    const NodeId child = tree_->FindChild(node, h, t, tpb_, digest);
    if (child == kNoNode) break;
    path->push_back(child);
    node = child;
    hash = h;
  }
}

std::int32_t KVCacheManager::ServedPrefix(const std::vector<NodeId>& path, std::int32_t* full_cut) const {
  // The longest block-aligned prefix every window can serve: a full-attention window needs every
  // block before it, a sliding window only those covering its last `window` tokens. The first
  // pass cuts at a full-attention gap and looks for sliding-window gaps; only with one (blocks
  // released and reclaimed) does the second pass run.
  auto full = static_cast<std::int32_t>(path.size());
  bool swa_gap = false;  // some sliding window lacks a block on the path (else it serves every prefix)
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    const bool swa = kinds_[w]->ReleasesBlocks();
    const auto wi = static_cast<std::int32_t>(w);
    for (std::int32_t i = 0; i < full; ++i) {
      if (tree_->Block(path[static_cast<std::size_t>(i)], wi) == kNullBlock) {
        if (swa) {
          swa_gap = true;
        } else {
          full = i;
        }
        break;
      }
    }
  }
  if (full_cut != nullptr) *full_cut = full;
  return swa_gap && full > 0 ? ServedBySlidingWindows(path, full) : full;
}

std::int32_t KVCacheManager::ServedBySlidingWindows(const std::vector<NodeId>& path, std::int32_t full) const {
  // last_gap[w] is the last position below p that window w lacks, and prefix p is served when
  // every sliding window's gap lies before the first block it needs at p.
  const std::size_t nw = windows_.size();
  std::array<std::int32_t, kMaxWindowsOnStack> gaps_on_stack;
  std::vector<std::int32_t> gaps_on_heap;
  std::int32_t* last_gap = gaps_on_stack.data();
  if (nw > kMaxWindowsOnStack) {
    gaps_on_heap.resize(nw);
    last_gap = gaps_on_heap.data();
  }
  std::fill(last_gap, last_gap + nw, -1);
  std::int32_t best = 0;
  for (std::int32_t i = 0; i < full; ++i) {
    const NodeId nd = path[static_cast<std::size_t>(i)];
    bool served = true;
    for (std::size_t w = 0; w < nw; ++w) {
      if (!kinds_[w]->ReleasesBlocks()) continue;
      if (tree_->Block(nd, static_cast<std::int32_t>(w)) == kNullBlock) last_gap[w] = i;
      // max(0, (i + 1) * tpb - window) / tpb without a division per block and window.
      const std::int32_t first_needed = std::max(0, i + 1 - window_blocks_[w]);
      if (last_gap[w] >= first_needed) served = false;
    }
    if (served) best = i + 1;
  }
  return best;
}

bool KVCacheManager::MatchPartialBlock(const TokenId* tokens, std::int32_t key_len, const ReuseExtras& extras,
                                       ReusePlan* plan) const {
  const std::size_t nw = windows_.size();
  const std::int32_t full = plan->full_blocks;
  const std::int32_t start = full * tpb_;
  const std::int32_t query = std::min(tpb_, key_len - start);
  if (query <= 0 || HasMultimodal(extras, start, query)) return false;
  const NodeId parent = full == 0 ? ReuseTree::kRoot : plan->path[static_cast<std::size_t>(full - 1)];
  const std::uint64_t digest = BlockExtrasDigest(extras, full, start, query);
  NodeId best = kNoNode;
  std::int32_t best_tokens = 0;
  tree_->ForEachChild(parent, [&](NodeId c) {
    // A child whose first token differs shares nothing: skipped before its tokens are read.
    if (tree_->FirstToken(c) != tokens[start] || tree_->HasMultimodal(c) || tree_->Extras(c) != digest) return;
    const std::int32_t common = CommonPrefix(tree_->Tokens(c), tokens + start, std::min(tree_->NumTokens(c), query));
    if (common <= best_tokens) return;
    for (std::size_t w = 0; w < nw; ++w) {
      const BlockId b = tree_->Block(c, static_cast<std::int32_t>(w));
      if (b == kNullBlock) return;
      const bool takeover = windows_[w]->RefCount(b) == 0 && windows_[w]->IsPrimary(b) && tree_->IsLeaf(c);
      if (!copy_on_partial_ && !takeover) return;
    }
    best = c;
    best_tokens = common;
  });
  if (best == kNoNode) return false;
  plan->partial = best;
  plan->partial_tokens = best_tokens;
  plan->reused_tokens += best_tokens;
  for (std::size_t w = 0; w < nw; ++w) {
    const BlockId b = tree_->Block(best, static_cast<std::int32_t>(w));
    plan->partial_src[w] = b;
    plan->partial_takeover[w] =
        windows_[w]->RefCount(b) == 0 && windows_[w]->IsPrimary(b) && tree_->IsLeaf(best) ? 1 : 0;
  }
  return true;
}

/// The stored events of one StoreChain walk: per window and lane (the pools, the shared tier),
/// one event per run of consecutive positions that it linked (or queued for the shared tier).
class KVCacheManager::StoredEvents {
 public:
  StoredEvents(EventLog* log, std::size_t num_windows)
      : log_(log),
        num_windows_(num_windows),
        stored_(log != nullptr ? 2 * num_windows : 0),
        last_(log != nullptr ? 2 * num_windows : 0, -2) {}
  bool on() const { return log_ != nullptr; }
  /// `block`, linked at position `d` of window `w` (size `window`) below `parent`; `shared`: the
  /// block was queued for the shared tier (its own run of events).
  void Add(std::size_t w, WindowSize window, std::int32_t d, const ChainNode& parent, StoredBlock block,
           bool shared = false) {
    if (shared) w += num_windows_;
    if (last_[w] != d - 1) {
      Flush(w);
      stored_[w].kind = EventKind::kStored;
      stored_[w].window_size = window;
      if (parent.node != ReuseTree::kRoot) stored_[w].parent_hash = parent.hash;
    }
    stored_[w].blocks.push_back(std::move(block));
    last_[w] = d;
  }
  void FlushAll() {
    for (std::size_t w = 0; w < stored_.size(); ++w) Flush(w);
  }

 private:
  void Flush(std::size_t w) {
    if (!stored_[w].blocks.empty()) {
      log_->Push(std::move(stored_[w]));
      stored_[w] = KVCacheEvent{};
    }
  }
  EventLog* log_;
  std::size_t num_windows_;
  std::vector<KVCacheEvent> stored_;  // [lane * num_windows + w]
  std::vector<std::int32_t> last_;  // per window: the position of its last stored block
};

BlockId KVCacheManager::OwnBlock(const Sequence& seq, std::size_t w, std::int32_t d) const {
  const SequenceWindow& sw = seq.windows[w];
  if (d >= sw.front_null) return sw.blocks[static_cast<std::size_t>(d)];
  const auto [released, generation] = sw.released[static_cast<std::size_t>(d)];
  // A released block still holds this sequence's KV unless it was handed out again.
  return released != kNullBlock && windows_[w]->Generation(released) == generation ? released : kNullBlock;
}

bool KVCacheManager::Settled(std::size_t w, NodeId node, BlockId b) const {
  // Position d (node `node`) is *settled* in window w when no later walk can store anything
  // there: the node holds the sequence's block b, or the sequence has no block there and the
  // window never drops a chain below an evicted block (a sliding window under "placeholder").
  // Why nothing can store there later: a live b is never unlinked while the sequence holds it
  // (the positions before it are settled too, so no eviction above it can drop it); a released
  // b leaves the node only when it is handed out again, which makes the sequence's record of it
  // stale, and only a sliding window releases blocks. That holds only where sliding windows drop
  // no chains: under "invalidate" a sequence that reclaims its own released block stays valid,
  // and a block another sequence links there later could drop the sequence's blocks below when
  // it is evicted. So under "invalidate" with a sliding window every walk starts at the root
  // (StoreResumable).
  if (b != kNullBlock) return tree_->Block(node, static_cast<std::int32_t>(w)) == b;
  return kinds_[w]->ReleasesBlocks() && swa_policy_ == SwaReusePolicy::kPlaceholder;
}

bool KVCacheManager::StoreResumable() const {
  return swa_policy_ == SwaReusePolicy::kPlaceholder ||
         std::none_of(kinds_.begin(), kinds_.end(), [](const auto& k) { return k->ReleasesBlocks(); });
}

std::uint64_t KVCacheManager::ChainKey(const Sequence& seq, std::int32_t key_len, std::int32_t d,
                                       std::uint64_t parent_hash, std::int32_t* len, std::uint64_t* digest) const {
  const std::int32_t start = d * tpb_;
  *len = std::min(tpb_, key_len - start);
  // A prepared prompt's full blocks were keyed once; the rest is keyed here.
  const bool keyed =
      *len == tpb_ && d < static_cast<std::int32_t>(seq.NumKeyedBlocks()) && start + *len <= seq.prompt_len;
  const auto i = static_cast<std::size_t>(d);
  *digest = keyed ? seq.prompt->digests[i] : BlockExtrasDigest(seq.extras, d, start, *len);
  return keyed ? seq.prompt->hashes[i] : ChainHash(parent_hash, seq.TokenData() + start, *len, *digest);
}

std::pair<BlockId, std::uint32_t> KVCacheManager::ReleaseRecord(const Sequence& seq, std::size_t w,
                                                                std::int32_t d) const {
  const SequenceWindow& sw = seq.windows[w];
  if (d < sw.front_null) return sw.released[static_cast<std::size_t>(d)];
  const BlockId b = sw.blocks[static_cast<std::size_t>(d)];
  return {b, windows_[w]->Generation(b)};
}

KVCacheManager::ChainNode KVCacheManager::ResumeStore(const Sequence& seq, std::int32_t key_len) const {
  // Resume where the last walk found every position before it settled (chunked prefill stores
  // after every chunk: without this each store walks the whole prompt again). Trusted only if
  // that walk's last node is still the same node, still settled in every window, and the
  // tokens before it are unchanged: a rewind below it gave the guard window a new block there
  // (handed out again or a copy: the old one was linked, so not private). Every position before
  // the resume point must be a full block of this walk too: a store during chunked prefill keys
  // one token more than the store at the end.
  const Sequence::StoreResume& resume = seq.store_resume;
  if (resume.depth <= 0 || resume.depth > key_len / tpb_ || !tree_->Alive(resume.node) ||
      tree_->Hash(resume.node) != resume.hash || tree_->Depth(resume.node) != resume.depth) {
    return ChainNode{};
  }
  const std::int32_t d = resume.depth - 1;
  bool ok = resume.guard_window < 0 || ReleaseRecord(seq, static_cast<std::size_t>(resume.guard_window), d) ==
                                           std::make_pair(resume.guard_block, resume.guard_generation);
  for (std::size_t w = 0; w < windows_.size() && ok; ++w) ok = Settled(w, resume.node, OwnBlock(seq, w, d));
  return ok ? ChainNode{resume.depth, resume.node, resume.hash} : ChainNode{};
}

void KVCacheManager::CheckStoreResume(const Sequence& seq, std::int32_t key_len, const ChainNode& start) const {
  NodeId node_check = ReuseTree::kRoot;
  std::uint64_t parent_hash_check = 0;
  // From the root, every skipped position is settled.
  for (std::int32_t d = 0, len = 0; d < start.depth; ++d) {
    std::uint64_t digest = 0;
    const std::uint64_t h = ChainKey(seq, key_len, d, parent_hash_check, &len, &digest);
    node_check = tree_->FindChild(node_check, h, seq.TokenData() + static_cast<std::ptrdiff_t>(d) * tpb_, len, digest);
    KVC_CHECK(node_check != kNoNode, detail::Concat("request ", seq.id, ": store resumes past a missing node"));
    for (std::size_t w = 0; w < windows_.size(); ++w) {
      KVC_CHECK(Settled(w, node_check, OwnBlock(seq, w, d)),
                detail::Concat("request ", seq.id, ": store resumes past unsettled position ", d, " of window ",
                               window_sizes_[w]));
    }
    parent_hash_check = h;
  }
  KVC_CHECK(start.depth == 0 || node_check == start.node, "store resume node is not the chain's node");
}

std::int32_t KVCacheManager::StoreChain(const Sequence& seq, std::int32_t key_len, bool full_only,
                                       std::vector<std::vector<BlockId>>* pinned) {
  // Only positions the sequence still has, whose KV it has written, may be stored.
  // During chunked prefill every position with a block has been computed once its chunk ran;
  // afterwards the last token's KV is computed only by the step that consumes it.
  KVC_CHECK(key_len < seq.num_tokens || (seq.InPrefill() && key_len == seq.num_tokens),
            detail::Concat("request ", seq.id, ": storing ", key_len, " of ", seq.num_tokens, " tokens"));
  if (key_len <= 0) return 0;
  const std::int32_t num_blocks = full_only ? key_len / tpb_ : (key_len + tpb_ - 1) / tpb_;
  const bool resumable = StoreResumable();
  // Pins are taken at every position, so pin walks start at the root.
  ChainNode parent = resumable && pinned == nullptr ? ResumeStore(seq, key_len) : ChainNode{};
#ifdef KVCACHE_ENABLE_DCHECK
  CheckStoreResume(seq, key_len, parent);  // debug builds verify the claim
#endif
  if (parent.depth == 0) seq.store_resume = Sequence::StoreResume{};
  bool all_settled = true;  // every position walked so far is settled (and a full block)
  StoredEvents events(events_.get(), windows_.size());
  NodeId last = parent.node;
  std::int32_t newly = 0;
  for (std::int32_t d = parent.depth; d < num_blocks; ++d) {
    const std::int32_t start = d * tpb_;
    std::int32_t len = 0;
    std::uint64_t digest = 0;
    const std::uint64_t h = ChainKey(seq, key_len, d, parent.hash, &len, &digest);
    const TokenId* t = seq.TokenData() + start;
    const NodeId node = tree_->GetOrCreateChild(parent.node, h, t, len, digest, HasMultimodal(seq.extras, start, len));
    if (node == kNoNode) break;  // a 64-bit hash collision with another key: stop storing
    const ChainNode here{d + 1, node, h};
    const StoredPosition stored = StorePosition(seq, here, len, parent, pinned, &events);
    all_settled = all_settled && resumable && len == tpb_ && stored.settled;
    if (all_settled) MarkStoreResume(seq, here);
    newly += stored.any ? 1 : 0;
    parent = here;
    last = node;
  }
  events.FlushAll();
  tree_->PruneUp(last);  // nodes created without any block
  return newly;
}

KVCacheManager::StoredPosition KVCacheManager::StorePosition(const Sequence& seq, const ChainNode& here,
                                                             std::int32_t len, const ChainNode& parent,
                                                             std::vector<std::vector<BlockId>>* pinned,
                                                             StoredEvents* events) {
  const std::int32_t d = here.depth - 1;
  StoredPosition out;
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    WindowBlockManager& wm = *windows_[w];
    const auto wi = static_cast<std::int32_t>(w);
    const BlockId b = OwnBlock(seq, w, d);
    // A partial block that a fork also holds is not stored: the fork's KV there goes on (it
    // would write the block only after copying it, but a later store of its longer key could
    // then not link the block, and full attention's chain would have a hole there).
    const bool shared_partial = len < tpb_ && b != kNullBlock && wm.RefCount(b) > 1;
    if (b != kNullBlock && !shared_partial && tree_->Block(here.node, wi) == kNullBlock && wm.NodeOf(b) == kNoNode) {
      wm.Link(b, here.node);
      out.any = true;
      // To the shared tier too, unless the block came from a hit (it is there or cached).
      const bool to_shared =
          shared_ != nullptr && len == tpb_ && d >= seq.reused_tokens / tpb_ && WriteShared(w, here.hash, b);
      if (events->on()) {
        const TokenId* t = seq.TokenData() + d * tpb_;
        StoredBlock block;
        block.hash = here.hash;
        block.tokens.assign(t, t + len);
        block.lora_task_id = seq.extras.lora_task_id;
        block.cache_level = static_cast<int>(wm.LevelOf(b));
        block.priority = wm.Priority(b);
        if (to_shared) {  // the same block, announced in the shared tier too
          StoredBlock in_store = block;
          in_store.cache_level = kSharedStorageLevel;
          events->Add(w, window_sizes_[w], d, parent, std::move(in_store), true);
        }
        events->Add(w, window_sizes_[w], d, parent, std::move(block));
      }
    }
    if (pinned != nullptr && tree_->Block(here.node, wi) != kNullBlock) {
      Pin(w, tree_->Block(here.node, wi));
      (*pinned)[w].push_back(tree_->Block(here.node, wi));
    }
    out.settled = out.settled && Settled(w, here.node, b);
  }
  return out;
}

void KVCacheManager::MarkStoreResume(const Sequence& seq, const ChainNode& here) const {
  const std::int32_t d = here.depth - 1;
  Sequence::StoreResume& resume = seq.store_resume;
  resume = Sequence::StoreResume{here.depth, here.node, here.hash};
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    if (d < seq.windows[w].front_null) continue;
    resume.guard_window = static_cast<std::int32_t>(w);
    std::tie(resume.guard_block, resume.guard_generation) = ReleaseRecord(seq, w, d);
    break;
  }
}

void KVCacheManager::Pin(std::size_t w, BlockId b) {
  windows_[w]->Claim(b);
  ++pins_[w][static_cast<std::size_t>(b)];
}

void KVCacheManager::Unpin(std::size_t w, BlockId b) {
  KVC_CHECK(pins_[w][static_cast<std::size_t>(b)] > 0, "unpin of an unpinned block");
  --pins_[w][static_cast<std::size_t>(b)];
  windows_[w]->Release(b);
}

std::int32_t KVCacheManager::StoreContextBlocks(SeqId id) {
  std::lock_guard<std::mutex> lock(mu_);
  return StoreContext(Find(id));
}

std::int64_t KVCacheManager::StoreContextBlocks(const SeqId* ids, std::size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  BeginBatch(n);
  for (std::size_t i = 0; i < n; ++i) BatchMember(i, ids[i], "store_context_blocks");
  std::int64_t newly = 0;
  for (Sequence* seq : batch_) newly += StoreContext(*seq);
  return newly;
}

std::int32_t KVCacheManager::StoreContext(Sequence& seq) {
  if (!reuse_) return 0;
  if (!seq.valid_for_reuse && swa_policy_ == SwaReusePolicy::kInvalidate) return 0;
  // The prompt's last token is never a key; during chunked prefill, the chunks that ran so far.
  const std::int32_t key_len = std::min(seq.prompt_len - 1, seq.num_tokens);
  const std::int32_t stored = StoreChain(seq, key_len, /*full_only=*/true, nullptr);
  StoreCheckpoints(seq, key_len, /*all=*/false);
  return stored;
}

std::map<WindowSize, std::vector<BlockId>> KVCacheManager::PinnedByWindow(
    std::vector<std::vector<BlockId>> pinned) const {
  std::map<WindowSize, std::vector<BlockId>> out;
  for (std::size_t w = 0; w < windows_.size(); ++w) out[window_sizes_[w]] = std::move(pinned[w]);
  return out;
}

std::map<WindowSize, std::vector<BlockId>> KVCacheManager::PinBlocks(SeqId id) {
  std::lock_guard<std::mutex> lock(mu_);
  const Sequence& seq = Find(id);
  if (!reuse_) throw KVCacheError("pin_blocks needs block reuse (enable_block_reuse)");
  std::vector<std::vector<BlockId>> pinned(windows_.size());
  if (seq.valid_for_reuse || swa_policy_ == SwaReusePolicy::kPlaceholder) {
    StoreChain(seq, seq.num_tokens - 1, /*full_only=*/true, &pinned);
  }
  return PinnedByWindow(std::move(pinned));
}

void KVCacheManager::UnpinBlocks(const std::map<WindowSize, std::vector<BlockId>>& pinned) {
  std::lock_guard<std::mutex> lock(mu_);
  // Check first: every listed block needs as many pins as it is listed.
  std::vector<std::map<BlockId, std::int32_t>> count(windows_.size());
  for (const auto& [window, blocks] : pinned) {
    const std::size_t w = WindowIndex(window);
    const WindowBlockManager& wm = *windows_[w];
    for (const BlockId b : blocks) {
      if (b < 0 || b >= wm.num_blocks()) {
        ThrowInvalid("unpin_blocks_by_id: block ", b, " is not a block of window ", window);
      }
      if (++count[w][b] > pins_[w][static_cast<std::size_t>(b)]) {
        ThrowInvalid("unpin_blocks_by_id: block ", b, " of window ", window, " is listed ", count[w][b],
                     " times but has ", pins_[w][static_cast<std::size_t>(b)], " pins");
      }
    }
  }
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    for (const auto& [b, times] : count[w]) {
      for (std::int32_t i = 0; i < times; ++i) Unpin(w, b);
    }
  }
}

void KVCacheManager::UnpinBlocksById(const std::vector<BlockId>& blocks, std::optional<WindowSize> window) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::size_t lookup = window.has_value() ? WindowIndex(*window) : windows_.size() - 1;
  const WindowBlockManager& wm = *windows_[lookup];
  std::vector<NodeId> nodes;
  for (const BlockId b : blocks) {
    if (b < 0 || b >= wm.num_blocks() || wm.NodeOf(b) == kNoNode) {
      ThrowInvalid("unpin_blocks_by_id: block ", b, " of window ", wm.window(), " is not a stored block");
    }
    nodes.push_back(wm.NodeOf(b));
  }
  for (NodeId n : nodes) {
    for (; n != ReuseTree::kRoot; n = tree_->Parent(n)) {
      for (std::size_t w = 0; w < windows_.size(); ++w) {
        if (window.has_value() && w != lookup) continue;
        const BlockId x = tree_->Block(n, static_cast<std::int32_t>(w));
        if (x != kNullBlock && pins_[w][static_cast<std::size_t>(x)] > 0) Unpin(w, x);
      }
    }
  }
}

void KVCacheManager::RefreshBlocks() {
  std::lock_guard<std::mutex> lock(mu_);
  const std::int64_t now = NowMs();
  for (auto& wm : windows_) wm->RefreshPriorities(now);
  InvalidateReleasers(lender_->Rebalance(), /*except=*/-1, "lent");
  backend_->Synchronize();  // offloads of lent cached blocks too
}

bool KVCacheManager::ResetPrefixCache() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!sequences_.empty()) return false;
  for (const std::vector<std::int32_t>& pins : pins_) {
    if (std::any_of(pins.begin(), pins.end(), [](std::int32_t p) { return p > 0; })) return false;
  }
  if (!reuse_) return true;
  // No sequence and no pin: every block is unreferenced, so every cached one is a free block in
  // its queue (or an unreferenced disk slot) and leaves the tree by the eviction's one door, Drop
  // (its cascade may unlink later ids first: each id is checked when reached).
  for (auto& pool : states_) pool->DropAll();
  for (auto& wm : windows_) {
    for (BlockId b = 0; b < wm->num_blocks(); ++b) {
      KVC_DCHECK(wm->RefCount(b) == 0, "a referenced block without sequences or pins");
      if (wm->NodeOf(b) != kNoNode) wm->Drop(b);
    }
  }
  KVC_CHECK(tree_->NumNodes() == 1,
            detail::Concat("reset_prefix_cache left ", tree_->NumNodes() - 1, " nodes in the reuse tree"));
  return true;
}

std::int32_t KVCacheManager::GetReusablePrefixLength(const TokenId* tokens, std::size_t n,
                                                     const ReuseExtras& extras) const {
  std::lock_guard<std::mutex> lock(mu_);
  ValidatePrompt(tokens, n, "get_reusable_prefix_length", -1);
  return ReusableWithShared(tokens, n, extras, nullptr);
}

std::int32_t KVCacheManager::GetReusablePrefixLength(const PreparedPrompt& prompt) const {
  std::lock_guard<std::mutex> lock(mu_);
  CheckPrepared(prompt);
  return ReusableWithShared(prompt.tokens.data(), prompt.tokens.size(), prompt.extras, &prompt);
}

bool KVCacheManager::IsSequenceValidForReuse(SeqId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Find(id).valid_for_reuse;
}

RequestStats KVCacheManager::GetRequestStats(SeqId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Sequence& seq = Find(id);
  RequestStats r;
  r.reused_tokens = seq.reused_tokens;
  r.reused_blocks = seq.reused_blocks;
  r.missed_blocks = seq.missed_blocks;
  r.new_blocks = seq.new_blocks;
  return r;
}

std::vector<std::uint64_t> KVCacheManager::CachedBlockHashes(WindowSize window) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto w = static_cast<std::int32_t>(WindowIndex(window));
  std::vector<std::uint64_t> out;
  tree_->ForEachDescendant(ReuseTree::kRoot, [&](NodeId n) {
    if (tree_->Block(n, w) != kNullBlock) out.push_back(tree_->Hash(n));
  });
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<KVCacheEvent> KVCacheManager::GetLatestEvents(std::int64_t timeout_ms) {
  // No manager lock: waiting must not block the engine thread.
  if (!events_) return {};
  return events_->Take(timeout_ms);
}

}  // namespace kvcache
