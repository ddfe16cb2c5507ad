// KVCacheManager's estimates for a scheduler: block counts of a step, of a sequence's rest and of
// a prompt's registration, from the real state (block lists, released fronts, reference counts)
// and block_math.h's rules.
#include <algorithm>

#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"

namespace kvcache {

namespace bm = block_math;

std::int32_t KVCacheManager::SharedReleases(const Sequence& seq, std::size_t w, std::int32_t target) const {
  const SequenceWindow& sw = seq.windows[w];
  const WindowBlockManager& wm = *windows_[w];
  const std::int32_t end = std::min(target, static_cast<std::int32_t>(sw.blocks.size()));
  std::int32_t shared = 0;
  for (std::int32_t j = sw.front_null; j < end; ++j) {
    if (wm.RefCount(sw.blocks[static_cast<std::size_t>(j)]) > 1) ++shared;
  }
  return shared;
}

std::int32_t KVCacheManager::CopyNeed(const Sequence& seq, std::size_t w) const {
  if (!forked_ || seq.num_tokens % tpb_ == 0) return 0;  // the next token starts a block
  return IsPrivate(seq, w, seq.num_tokens / tpb_) ? 0 : 1;
}

std::int64_t KVCacheManager::DecodeDelta(const Sequence& seq, std::size_t w, std::int64_t m) const {
  const std::int32_t front = seq.windows[w].front_null;
  const std::int32_t target = bm::Released(m, keep_[w], tpb_);
  const std::int64_t freed = target > front ? target - front - SharedReleases(seq, w, target) : 0;
  return bm::CeilDiv(m, tpb_) - bm::CeilDiv(seq.num_tokens, tpb_) + CopyNeed(seq, w) - freed;
}

std::int64_t KVCacheManager::ChunkNeed(const Sequence& seq, std::size_t w, std::int32_t size, bool credit) const {
  const std::int64_t n = seq.num_tokens;
  const std::int64_t fresh = bm::CeilDiv(n + size, tpb_) - bm::CeilDiv(n, tpb_) + CopyNeed(seq, w);
  if (!credit) return fresh;
  const std::int32_t front = seq.windows[w].front_null;
  const std::int32_t target = bm::Released(n + 1, keep_[w], tpb_);
  const std::int64_t freed = target > front ? target - front - SharedReleases(seq, w, target) : 0;
  return std::max<std::int64_t>(0, fresh - freed);
}

namespace {

/// Checks a chunk of `size` tokens (<= 0: the rest) of `seq`; returns its size.
std::int32_t ChunkOf(const Sequence& seq, std::int32_t size, const char* who) {
  const std::int32_t rest = seq.prompt_len - seq.num_tokens;
  if (rest <= 0) ThrowInvalid(who, ": request ", seq.id, " has no prompt tokens left to prefill");
  if (size > rest) ThrowInvalid(who, ": request ", seq.id, " has ", rest, " prompt tokens left, not ", size);
  return size <= 0 ? rest : size;
}

}  // namespace

std::vector<std::int64_t> KVCacheManager::GetStepNeeds(const SeqId* gen_ids, const std::int32_t* gen_tokens,
                                                       std::size_t num_gen, const SeqId* chunk_ids,
                                                       const std::int32_t* chunk_tokens, std::size_t num_chunks) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::int32_t calls = 0;  // AddTokens calls: one per token position
  // Each sequence is looked up once; the windows' passes below reuse what was found.
  std::vector<const Sequence*>& seqs = step_seqs_;
  seqs.resize(num_gen + num_chunks);
  for (std::size_t i = 0; i < num_gen; ++i) {
    const Sequence& seq = Find(gen_ids[i]);
    if (seq.InPrefill()) ThrowInvalid("step needs: request ", seq.id, " is still in prefill");
    if (gen_tokens[i] < 1) ThrowInvalid("step needs: request ", seq.id, " needs >= 1 generation token");
    calls = std::max(calls, gen_tokens[i]);
    seqs[i] = &seq;
  }
  for (std::size_t i = 0; i < num_chunks; ++i) {
    const Sequence& seq = Find(chunk_ids[i]);
    if (chunk_tokens[i] < 1) ThrowInvalid("step needs: request ", seq.id, " needs a chunk of >= 1 tokens");
    ChunkOf(seq, chunk_tokens[i], "step needs");
    seqs[num_gen + i] = &seq;
  }
  std::vector<std::int64_t> out(windows_.size(), 0);
  std::vector<std::int64_t>& total = step_total_;
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    total.assign(static_cast<std::size_t>(calls), 0);
    for (std::size_t i = 0; i < num_gen; ++i) {
      const Sequence& seq = *seqs[i];
      std::int64_t last = 0;
      for (std::int32_t j = 0; j < calls; ++j) {  // after its last token it holds still
        if (j < gen_tokens[i]) last = DecodeDelta(seq, w, static_cast<std::int64_t>(seq.num_tokens) + 1 + j);
        total[static_cast<std::size_t>(j)] += last;
      }
    }
    // The first call's copies of shared partial blocks: the last writer of one keeps it.
    if (calls > 0) {
      const std::int64_t kept = KeptCopies(gen_ids, num_gen, w);
      for (std::int64_t& t : total) t -= kept;
    }
    std::int64_t prefill = 0;
    for (std::size_t i = 0; i < num_chunks; ++i) prefill += ChunkNeed(*seqs[num_gen + i], w, chunk_tokens[i], true);
    std::int64_t worst = calls > 0 ? total.back() + prefill : prefill;
    for (const std::int64_t t : total) worst = std::max(worst, t);
    out[w] = std::max<std::int64_t>(0, worst);
  }
  return out;
}

std::vector<std::int64_t> KVCacheManager::GetSequenceStepNeeds(SeqId id, std::int32_t num_tokens,
                                                               bool credit_releases) const {
  std::lock_guard<std::mutex> lock(mu_);
  const Sequence& seq = Find(id);
  std::vector<std::int64_t> out(windows_.size(), 0);
  if (seq.InPrefill()) {
    const std::int32_t size = ChunkOf(seq, num_tokens, "step needs");
    for (std::size_t w = 0; w < windows_.size(); ++w) out[w] = ChunkNeed(seq, w, size, credit_releases);
    return out;
  }
  if (num_tokens < 1) ThrowInvalid("step needs: request ", id, " needs >= 1 generation token");
  const std::int64_t kv = seq.num_tokens;
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    const std::int64_t copy = CopyNeed(seq, w);
    const std::int64_t fresh = bm::CeilDiv(kv + num_tokens, tpb_) - bm::CeilDiv(kv, tpb_) + copy;
    if (!credit_releases) {
      out[w] = fresh;
      continue;
    }
    const std::int32_t front = seq.windows[w].front_null;
    const std::int64_t live = bm::CeilDiv(kv, tpb_) - front;
    std::int64_t need =
        std::max<std::int64_t>(0, bm::PeakLiveBlocks(kv + 1, kv + num_tokens, keep_[w], tpb_, front) - live) + copy;
    // Releasing a block that another holder keeps frees nothing: no credit for it.
    const std::int32_t shared = SharedReleases(seq, w, bm::Released(kv + num_tokens, keep_[w], tpb_));
    if (shared > 0) need = std::min(fresh, need + shared);
    out[w] = need;
  }
  return out;
}

std::vector<std::int64_t> KVCacheManager::GetRemainingBlocks(const SeqId* ids, const std::int32_t* final_tokens,
                                                             std::size_t n, std::int32_t chunk,
                                                             bool prefill_only) const {
  return GetRemainingBlocksImpl(ids, final_tokens, n, chunk, prefill_only, nullptr, nullptr);
}

std::vector<std::int64_t> KVCacheManager::GetRemainingBlocks(const SeqId* ids, const std::int32_t* final_tokens,
                                                             std::size_t n, std::int32_t chunk,
                                                             std::int32_t* num_tokens, std::int32_t* prompt_len) const {
  return GetRemainingBlocksImpl(ids, final_tokens, n, chunk, false, num_tokens, prompt_len);
}

std::vector<std::int64_t> KVCacheManager::GetRemainingBlocksImpl(const SeqId* ids, const std::int32_t* final_tokens,
                                                                 std::size_t n, std::int32_t chunk, bool prefill_only,
                                                                 std::int32_t* num_tokens,
                                                                 std::int32_t* prompt_len) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::int64_t> out(windows_.size(), 0);
  for (std::size_t i = 0; i < n; ++i) {
    const Sequence& seq = Find(ids[i]);
    if (num_tokens != nullptr) {
      num_tokens[i] = seq.num_tokens;
      prompt_len[i] = seq.prompt_len;
    }
    const std::int64_t own = seq.final_tokens > 0 ? seq.final_tokens : max_seq_len_;
    const std::int64_t final = prefill_only ? seq.prompt_len : final_tokens != nullptr ? final_tokens[i] : own;
    for (std::size_t w = 0; w < windows_.size(); ++w) {
      out[w] += bm::RemainingBlocks(seq.num_tokens, seq.prompt_len, final, chunk, seq.windows[w].front_null, keep_[w],
                                    tpb_);
      if (final > seq.num_tokens) out[w] += CopyNeed(seq, w);  // its next write copies a shared block
    }
  }
  return out;
}

void KVCacheManager::PromptRegistration(const PreparedPrompt& prompt, std::int64_t size,
                                        std::vector<bm::Registration>* out) const {
  const std::size_t n = prompt.tokens.size();
  const std::optional<std::int32_t> prefill =
      size >= static_cast<std::int64_t>(n) ? std::nullopt : std::optional<std::int32_t>(static_cast<std::int32_t>(size));
  const std::int32_t first = PlanPromptBlocks(prompt.tokens.data(), n, prompt.extras, &prompt, prefill);
  out->resize(windows_.size());
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    (*out)[w] = bm::Registration{plan_.reused_tokens, first, prompt_front_[w], prompt_need_[w]};
  }
}

std::vector<std::int64_t> KVCacheManager::GetPromptRemainingBlocks(const PreparedPrompt& prompt,
                                                                   std::int32_t final_tokens, std::int32_t chunk,
                                                                   bool use_reuse, bool prefill_only,
                                                                   std::int32_t* reusable) const {
  std::lock_guard<std::mutex> lock(mu_);
  CheckPrepared(prompt);
  const auto n = static_cast<std::int64_t>(prompt.tokens.size());
  const std::int64_t final = prefill_only ? n : std::max<std::int64_t>(final_tokens, n);
  const std::int64_t size = chunk <= 0 ? n : std::min<std::int64_t>(chunk, n);
  const bool bound = reuse_ && !use_reuse;
  if (!bound) {
    PromptRegistration(prompt, size, &registration_);
    if (reusable != nullptr) *reusable = plan_.reused_tokens;
  } else if (reusable != nullptr) {
    *reusable = PlanReuse(prompt.tokens.data(), prompt.tokens.size(), prompt.extras, &prompt).reused_tokens;
  }
  std::vector<std::int64_t> out(windows_.size(), 0);
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    out[w] = bm::PeakNew(n, size, final, bound ? nullptr : &registration_[w], window_sizes_[w], keep_[w], tpb_);
  }
  return out;
}

std::vector<std::int64_t> KVCacheManager::GetPromptStepNeeds(const PreparedPrompt& prompt, std::int32_t chunk,
                                                             bool credit_releases, bool use_reuse) const {
  std::lock_guard<std::mutex> lock(mu_);
  CheckPrepared(prompt);
  const auto n = static_cast<std::int64_t>(prompt.tokens.size());
  const std::int64_t size = chunk <= 0 ? n : chunk;
  std::vector<std::int64_t> out(windows_.size(), 0);
  if (reuse_ && !use_reuse) {
    for (std::size_t w = 0; w < windows_.size(); ++w) {
      out[w] = bm::FirstChunkBound(n, size, window_sizes_[w], keep_[w], tpb_);
    }
    return out;
  }
  PromptRegistration(prompt, size, &registration_);
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    const bm::Registration& reg = registration_[w];
    out[w] = reg.cost;
    if (credit_releases && bm::Releases(keep_[w])) {
      out[w] = std::max(reg.cost, bm::CeilDiv(reg.first_end, tpb_) - reg.front);
    }
  }
  return out;
}

std::vector<std::int64_t> KVCacheManager::GetBlocksToRunAlone(std::int32_t prompt_len, std::int32_t final_tokens,
                                                              std::int32_t chunk) const {
  if (prompt_len < 1) ThrowInvalid("blocks to run alone: the prompt length must be >= 1, got ", prompt_len);
  std::vector<std::int64_t> out(windows_.size(), 0);
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    out[w] = bm::BlocksToRunAlone(prompt_len, final_tokens, chunk, window_sizes_[w], keep_[w], tpb_);
  }
  return out;
}

std::vector<std::int64_t> KVCacheManager::GetForkedBeamBlocks(std::int32_t fork_tokens,
                                                              std::int32_t final_tokens) const {
  if (fork_tokens < 1) ThrowInvalid("forked beam blocks: fork_tokens must be >= 1, got ", fork_tokens);
  std::vector<std::int64_t> out(windows_.size(), 0);
  for (std::size_t w = 0; w < windows_.size(); ++w) out[w] = bm::ForkedBeamBlocks(fork_tokens, final_tokens, keep_[w], tpb_);
  return out;
}

std::int64_t KVCacheManager::GetNumSharedBlocks(WindowSize window) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::size_t w = WindowIndex(window);
  return bm::Releases(keep_[w]) ? windows_[w]->NumSharedRefs() : 0;
}

std::int32_t KVCacheManager::GetNumHeldBlocks(SeqId id, WindowSize window) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::size_t w = WindowIndex(window);
  const SequenceWindow& sw = Find(id).windows[w];
  return static_cast<std::int32_t>(sw.blocks.size()) - sw.front_null;
}

void KVCacheManager::GetProgress(const SeqId* ids, std::size_t n, std::int32_t* num_tokens,
                                 std::int32_t* prompt_len) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (std::size_t i = 0; i < n; ++i) {
    const Sequence& seq = Find(ids[i]);
    num_tokens[i] = seq.num_tokens;
    prompt_len[i] = seq.prompt_len;
  }
}

void KVCacheManager::SetFinalTokens(SeqId id, std::int32_t final_tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  Sequence& seq = Find(id);
  if (final_tokens < seq.num_tokens || final_tokens > max_seq_len_) {
    ThrowInvalid("request ", id, ": final_tokens must be in ", seq.num_tokens, "..", max_seq_len_, ", got ",
                 final_tokens);
  }
  seq.final_tokens = final_tokens;
}

std::vector<std::int64_t> KVCacheManager::ReachedFinalTokens(const SeqId* ids, std::size_t n) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::int64_t> out;
  for (std::size_t i = 0; i < n; ++i) {
    const Sequence& seq = Find(ids[i]);
    if (seq.final_tokens > 0 && seq.num_tokens >= seq.final_tokens) out.push_back(static_cast<std::int64_t>(i));
  }
  return out;
}

std::int64_t KVCacheManager::FirstLengthMismatch(const SeqId* ids, const std::int32_t* lengths,
                                                std::size_t n) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (std::size_t i = 0; i < n; ++i) {
    const auto it = sequences_.find(ids[i]);
    if (it == sequences_.end() || it->second.num_tokens != lengths[i]) return static_cast<std::int64_t>(i);
  }
  return -1;
}

}  // namespace kvcache
