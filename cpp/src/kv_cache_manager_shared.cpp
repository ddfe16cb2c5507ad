// KVCacheManager, the shared tier: a Redis store that several managers (engines) read and write.
// Admission looks up the prompt's blocks past the local hit (FetchShared, ApplyShared) and
// fills fresh primary blocks with them (FillShared); StoreChain queues newly stored blocks for
// the store (WriteShared). A lookup that fails is a miss; nothing here throws for the store.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"

namespace kvcache {
namespace {

constexpr std::size_t kSharedFetchBatchBytes = std::size_t{4} << 20;

std::int64_t SteadyMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void KVCacheManager::MakeSharedTier(const ManagerConfig& config, const std::vector<std::vector<PoolLayout>>& pools) {
  if (config.shared_cache_url.empty()) {
    if (!config.shared_cache_namespace.empty()) ThrowInvalid("shared_cache_namespace needs shared_cache_url");
    return;
  }
  const RedisAddress address = ResolveRedisUrl(config.shared_cache_url);
  if (!config.enable_block_reuse) {
    ThrowInvalid("shared_cache_url needs enable_block_reuse: the shared tier holds blocks stored for reuse");
  }
  if (!backend_->HasMemory()) {
    ThrowInvalid("shared_cache_url needs a backend with memory (host or cuda): the virtual backend has no KV bytes "
                 "to share");
  }
  if (config.shared_cache_timeout_ms < 1) {
    ThrowInvalid("shared_cache_timeout_ms must be >= 1, got ", config.shared_cache_timeout_ms);
  }
  for (const auto& kind : kinds_) shared_label_.push_back(kind->KeyLabel());
  std::string ns = config.shared_cache_namespace.empty() ? SharedFingerprint(pools) : config.shared_cache_namespace;
  shared_timeout_ms_ = config.shared_cache_timeout_ms;
  shared_ = std::make_unique<SharedTier>(address, std::move(ns), config.shared_cache_queue_bytes);
}

std::string KVCacheManager::SharedFingerprint(const std::vector<std::vector<PoolLayout>>& pools) const {
  // Blocks are interchangeable when the chained keys mean the same tokens (tokens_per_block)
  // and every window's blocks hold the same layers in the same layout. A full-attention
  // window is labelled 0, so max_seq_len does not split the namespace.
  std::vector<std::int64_t> words{1, tpb_, kv_factor_, static_cast<std::int64_t>(pools.size())};
  for (std::size_t w = 0; w < pools.size(); ++w) {
    words.push_back(kinds_[w]->KeyLabel());
    words.push_back(static_cast<std::int64_t>(pools[w].size()));
    for (const PoolLayout& pool : pools[w]) {
      words.insert(words.end(), {pool.num_kv_heads, pool.kv_factor, pool.head_dim, pool.elem_bytes,
                                 static_cast<std::int64_t>(pool.dtype), static_cast<std::int64_t>(pool.layers.size())});
      words.insert(words.end(), pool.layers.begin(), pool.layers.end());
    }
  }
  const std::uint64_t h = HashBytes(0, words.data(), words.size() * sizeof(std::int64_t));
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h));
  return detail::Concat("kvcache:", text);
}

bool KVCacheManager::FlushSharedCache(std::int32_t timeout_ms) {
  if (timeout_ms < 0) ThrowInvalid("flush_shared_cache: timeout must be >= 0, got ", timeout_ms);
  return shared_ == nullptr || shared_->Flush(timeout_ms);  // without mu_: the writer needs none
}

std::vector<std::uint64_t> KVCacheManager::PromptHashes(const TokenId* tokens, const ReuseExtras& extras,
                                                        const PreparedPrompt* prepared, std::int32_t num_full) const {
  const auto n = static_cast<std::size_t>(num_full);
  if (prepared != nullptr && prepared->hashes.size() >= n) {
    return std::vector<std::uint64_t>(prepared->hashes.begin(), prepared->hashes.begin() + num_full);
  }
  std::vector<std::uint64_t> hashes(n);
  std::uint64_t hash = 0;
  for (std::int32_t d = 0; d < num_full; ++d) {
    const std::uint64_t digest = BlockExtrasDigest(extras, d, d * tpb_, tpb_);
    hash = ChainHash(hash, tokens + static_cast<std::ptrdiff_t>(d) * tpb_, tpb_, digest);
    hashes[static_cast<std::size_t>(d)] = hash;
  }
  return hashes;
}

std::int32_t KVCacheManager::FrontAt(std::size_t w, std::int32_t h) const {
  // PromptBlocksNeeded's front for a reused prefix of h blocks.
  return kinds_[w]->FirstNeededBlock(h, tpb_);
}

std::int32_t KVCacheManager::SharedServed(const std::vector<std::vector<char>>& avail, std::int32_t base,
                                          std::int32_t end) const {
  // Prefix h is served when no window lacks a position it holds at h: full attention every
  // position past the local hit, a sliding window those from its front on.
  std::vector<std::int32_t> last_gap(windows_.size(), base - 1);
  std::int32_t best = base;
  for (std::int32_t h = base + 1; h <= end; ++h) {
    bool served = true;
    for (std::size_t w = 0; w < windows_.size(); ++w) {
      if (avail[w][static_cast<std::size_t>(h - 1 - base)] == 0) last_gap[w] = h - 1;
      if (last_gap[w] >= std::max(base, FrontAt(w, h))) served = false;
    }
    if (served) best = h;
  }
  return best;
}

bool KVCacheManager::SharedAvailable(const std::vector<std::uint64_t>& hashes, std::int32_t base, std::int32_t end,
                                     std::int64_t deadline, std::vector<std::vector<char>>* avail) const {
  // One pipelined round trip: EXISTS of every window's key at every position in [base, end).
  const std::size_t nw = windows_.size();
  const auto span = static_cast<std::size_t>(end - base);
  std::vector<std::string> keys;
  keys.reserve(nw * span);
  for (std::size_t w = 0; w < nw; ++w) {
    for (std::int32_t d = base; d < end; ++d) {
      keys.push_back(shared_->Key(shared_label_[w], hashes[static_cast<std::size_t>(d)]));
    }
  }
  std::vector<char> found;
  if (!shared_->Exists(keys, &found, deadline)) return false;
  avail->assign(nw, {});
  for (std::size_t w = 0; w < nw; ++w) {
    const auto first = found.begin() + static_cast<std::ptrdiff_t>(w * span);
    (*avail)[w].assign(first, first + static_cast<std::ptrdiff_t>(span));
  }
  return true;
}

std::int32_t KVCacheManager::ProbeShared(const TokenId* tokens, std::size_t n, const ReuseExtras& extras,
                                         const PreparedPrompt* prepared, std::int32_t base) const {
  // FetchShared's first round, on the same clock: the prefix the store's blocks serve.
  const std::int32_t end = (static_cast<std::int32_t>(n) - 1) / tpb_;
  if (end <= base) return base;
  const std::int64_t deadline = SteadyMs() + shared_timeout_ms_;
  const std::vector<std::uint64_t> hashes = PromptHashes(tokens, extras, prepared, end);
  std::vector<std::vector<char>> avail;
  if (!SharedAvailable(hashes, base, end, deadline, &avail)) return base;
  return SharedServed(avail, base, end);
}

std::int32_t KVCacheManager::ReusableWithShared(const TokenId* tokens, std::size_t n, const ReuseExtras& extras,
                                                const PreparedPrompt* prepared) const {
  const ReusePlan& plan = PlanReuse(tokens, n, extras, prepared);
  if (shared_ == nullptr) return plan.reused_tokens;
  const std::int32_t h = ProbeShared(tokens, n, extras, prepared, plan.full_blocks);
  // As ApplyShared: the store's blocks continue the full-block hit and replace a partial match.
  return h > plan.full_blocks ? h * tpb_ : plan.reused_tokens;
}

void KVCacheManager::FetchShared(const TokenId* tokens, std::size_t n, const ReuseExtras& extras,
                                 const PreparedPrompt* prepared) {
  SharedFetch& f = shared_fetch_;
  const std::size_t nw = windows_.size();
  f.base = plan_.full_blocks;
  f.blocks = 0;
  f.values.assign(nw, {});
  const std::int32_t base = f.base;
  const std::int32_t end = (static_cast<std::int32_t>(n) - 1) / tpb_;  // the last token is never a key
  if (end <= base) return;
  const std::int64_t deadline = SteadyMs() + shared_timeout_ms_;
  const std::vector<std::uint64_t> hashes = PromptHashes(tokens, extras, prepared, end);
  const auto span = static_cast<std::size_t>(end - base);
  for (std::size_t w = 0; w < nw; ++w) f.values[w].assign(span, std::string());
  // Round 1: which blocks the store has, in every window.
  std::vector<std::vector<char>> avail;
  if (!SharedAvailable(hashes, base, end, deadline, &avail)) return;
  std::vector<std::string> keys;
  // Then the bytes of what the longest served prefix needs. A block that is gone or does not
  // verify is unavailable: the prefix shrinks before it, and what the shorter prefix needs
  // besides (a sliding window's earlier blocks) is fetched next, until nothing is missing.
  std::int32_t h = SharedServed(avail, base, end);
  std::vector<std::pair<std::size_t, std::int32_t>> where;
  std::vector<std::string> values;
  // GETs of about kSharedFetchBatchBytes per round trip.
  std::size_t block_bytes = 1;
  for (const auto& wm : windows_) block_bytes = std::max(block_bytes, wm->BlockBytes());
  const std::size_t batch = std::max<std::size_t>(1, kSharedFetchBatchBytes / block_bytes);
  while (h > base) {
    keys.clear();
    where.clear();
    // Position by position, so that replies cut short by the deadline still serve a prefix.
    for (std::int32_t d = base; d < h; ++d) {
      for (std::size_t w = 0; w < nw; ++w) {
        if (d < FrontAt(w, h) || !f.values[w][static_cast<std::size_t>(d - base)].empty()) continue;
        keys.push_back(shared_->Key(shared_label_[w], hashes[static_cast<std::size_t>(d)]));
        where.emplace_back(w, d);
      }
    }
    if (keys.empty()) break;
    const bool complete = shared_->Fetch(keys, &values, deadline, batch);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const auto [w, d] = where[i];
      const auto j = static_cast<std::size_t>(d - base);
      if (DecodeSharedBlock(values[i], keys[i], windows_[w]->BlockBytes()) != nullptr) {
        f.values[w][j] = std::move(values[i]);
      } else {
        avail[w][j] = 0;
        // Present but not this key's intact bytes (an empty value or an error reply Fetch counted).
        if (!values[i].empty()) shared_->CountError();
      }
    }
    if (!complete) {
      // The store failed or the time ran out: what was verified is all there is.
      for (std::size_t w = 0; w < nw; ++w) {
        for (std::size_t j = 0; j < span; ++j) avail[w][j] = f.values[w][j].empty() ? 0 : 1;
      }
      h = SharedServed(avail, base, h);
      break;
    }
    h = SharedServed(avail, base, h);
  }
  f.blocks = h - base;
}

void KVCacheManager::ApplyShared() {
  ReusePlan& plan = plan_;
  const SharedFetch& f = shared_fetch_;
  if (f.base != plan.full_blocks || f.blocks == 0) return;
  // The store's blocks continue the full-block hit; a partial match of the next block is dropped.
  plan.shared_blocks = f.blocks;
  plan.partial = kNoNode;
  plan.partial_tokens = 0;
  std::fill(plan.partial_src.begin(), plan.partial_src.end(), kNullBlock);
  std::fill(plan.partial_takeover.begin(), plan.partial_takeover.end(), 0);
  plan.reused_tokens = (plan.full_blocks + plan.shared_blocks) * tpb_;
}

void KVCacheManager::FillShared(Sequence& seq, std::size_t w, std::int32_t first, std::int32_t last) {
  WindowBlockManager& wm = *windows_[w];
  const SharedFetch& f = shared_fetch_;
  for (std::int32_t d = first; d < last; ++d) {
    const std::string& value = f.values[w][static_cast<std::size_t>(d - f.base)];
    KVC_CHECK(value.size() == kSharedBlockHeader + wm.BlockBytes(),
              detail::Concat("window ", window_sizes_[w], ": shared block ", d, " was not fetched"));
    wm.CopyIn(seq.windows[w].blocks[static_cast<std::size_t>(d)],
              reinterpret_cast<const unsigned char*>(value.data()) + kSharedBlockHeader);
  }
}

bool KVCacheManager::WriteShared(std::size_t w, std::uint64_t hash, BlockId b) {
  const WindowBlockManager& wm = *windows_[w];
  if (!wm.IsPrimary(b)) return false;
  std::string key = shared_->Key(shared_label_[w], hash);
  const std::size_t bytes = wm.BlockBytes();
  if (!shared_->Reserve(key.size() + kSharedBlockHeader + bytes)) return false;  // behind: dropped, counted
  shared_buffer_.resize(bytes);
  wm.CopyOut(b, shared_buffer_.data());  // now: the block may be handed out right after this call
  std::string value = EncodeSharedBlock(key, shared_buffer_.data(), bytes);
  shared_->Push(std::move(key), std::move(value));
  return true;
}

}  // namespace kvcache
