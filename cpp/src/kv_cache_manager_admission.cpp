// KVCacheManager, admission: validating and keying prompts, the blocks a registration takes,
// and AddSequence step by step (validate; plan and check blocks; register; claim the reused
// blocks; move slabs; hand out takeovers, partial copies, onboards and fresh blocks; count).
#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "kvcache/errors.h"
#include "kvcache/kv_cache_manager.h"

namespace kvcache {

namespace {

std::int32_t CeilDiv(std::int64_t a, std::int64_t b) { return static_cast<std::int32_t>((a + b - 1) / b); }

}  // namespace

void KVCacheManager::PromptBlocksNeeded(const ReusePlan& plan, std::int32_t num_blocks) const {
  std::vector<std::int32_t>& need = prompt_need_;
  std::vector<std::int32_t>& front = prompt_front_;
  need.assign(windows_.size(), 0);
  front.assign(windows_.size(), 0);
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    const WindowBlockManager& wm = *windows_[w];
    std::int32_t& f = front[w];
    if (kinds_[w]->ReleasesBlocks()) f = std::max(0, plan.reused_tokens - window_sizes_[w]) / tpb_;
    KVC_CHECK(f <= plan.full_blocks + plan.shared_blocks, "reuse plan: released front past the matched blocks");
    // The partial block (taken over or copied), blocks filled from the shared tier, fresh ones.
    need[w] = num_blocks - std::max(f, plan.full_blocks);
    for (std::int32_t i = f; i < plan.full_blocks; ++i) {
      const BlockId b = tree_->Block(plan.path[static_cast<std::size_t>(i)], static_cast<std::int32_t>(w));
      if (!wm.IsPrimary(b) || wm.RefCount(b) == 0) ++need[w];  // onboard, or a cached free block
    }
  }
}

void KVCacheManager::ValidatePrompt(const TokenId* tokens, std::size_t n, const char* who, SeqId id) const {
  auto fail = [&](auto&&... what) {
    if (id >= 0) ThrowInvalid("request ", id, ": ", what...);
    ThrowInvalid(who, ": ", what...);
  };
  if (n == 0) fail("the prompt is empty");
  if (n > static_cast<std::size_t>(max_seq_len_)) fail("prompt of ", n, " tokens exceeds max_seq_len ", max_seq_len_);
  TokenId any = 0;  // one branch-free pass; the bad token is looked for only on failure
  for (std::size_t i = 0; i < n; ++i) any |= tokens[i];
  if (any >= 0) return;
  for (std::size_t i = 0; i < n; ++i) {
    if (tokens[i] < 0) fail("token ", i, " is negative (", tokens[i], ")");
  }
}

void KVCacheManager::ValidateMultimodal(const ReuseExtras& extras, const char* who, SeqId id) const {
  for (const MultimodalItem& item : extras.multimodal) {
    if (item.start >= 0 && item.length >= 0) continue;
    if (id >= 0) {
      ThrowInvalid("request ", id, ": multimodal item (start ", item.start, ", length ", item.length, ") is invalid");
    }
    ThrowInvalid(who, ": multimodal item (start ", item.start, ", length ", item.length, ") is invalid");
  }
}

void KVCacheManager::ValidatePrefill(std::optional<std::int32_t> prefill, const char* who, SeqId id) const {
  if (!prefill.has_value() || *prefill >= 1) return;
  if (id >= 0) ThrowInvalid("request ", id, ": prefill must be >= 1 (or None for the whole prompt), got ", *prefill);
  ThrowInvalid(who, ": prefill must be >= 1 (or None for the whole prompt), got ", *prefill);
}

void KVCacheManager::CheckPrepared(const PreparedPrompt& prompt) const {
  if (prompt.tokens_per_block != tpb_) {
    ThrowInvalid("the prepared prompt was keyed for tokens_per_block ", prompt.tokens_per_block, ", this manager uses ",
                 tpb_);
  }
  if (prompt.tokens.size() > static_cast<std::size_t>(max_seq_len_)) {
    ThrowInvalid("the prepared prompt has ", prompt.tokens.size(), " tokens, more than max_seq_len ", max_seq_len_);
  }
}

PreparedPrompt KVCacheManager::Prepare(const TokenId* tokens, std::size_t n, const ReuseExtras& extras) const {
  return Prepare(std::vector<TokenId>(tokens, tokens + n), extras);
}

PreparedPrompt KVCacheManager::Prepare(std::vector<TokenId>&& tokens_in, const ReuseExtras& extras) const {
  ValidatePrompt(tokens_in.data(), tokens_in.size(), "prepare", -1);
  ValidateMultimodal(extras, "prepare", -1);
  PreparedPrompt p;
  p.tokens = std::move(tokens_in);
  const TokenId* tokens = p.tokens.data();
  const std::size_t n = p.tokens.size();
  p.extras = extras;
  p.tokens_per_block = tpb_;
  const auto full = static_cast<std::int32_t>(n / static_cast<std::size_t>(tpb_));
  p.digests.resize(static_cast<std::size_t>(full));
  p.hashes.resize(static_cast<std::size_t>(full));
  std::uint64_t hash = 0;
  for (std::int32_t d = 0; d < full; ++d) {
    const auto i = static_cast<std::size_t>(d);
    p.digests[i] = BlockExtrasDigest(extras, d, d * tpb_, tpb_);
    hash = ChainHash(hash, tokens + static_cast<std::ptrdiff_t>(d) * tpb_, tpb_, p.digests[i]);
    p.hashes[i] = hash;
  }
  return p;
}

std::int32_t KVCacheManager::FirstChunkEnd(std::size_t n, std::int32_t reused, std::optional<std::int32_t> prefill) const {
  if (!prefill.has_value()) return static_cast<std::int32_t>(n);
  return static_cast<std::int32_t>(std::min<std::int64_t>(static_cast<std::int64_t>(n),
                                                          static_cast<std::int64_t>(reused) + *prefill));
}

std::map<WindowSize, std::int32_t> KVCacheManager::BlocksToAllocateLocked(const TokenId* tokens, std::size_t n,
                                                                          const ReuseExtras& extras,
                                                                          std::optional<std::int32_t> prefill,
                                                                          const PreparedPrompt* prepared) const {
  ValidatePrefill(prefill, "get_num_blocks_to_allocate", -1);
  PlanPromptBlocks(tokens, n, extras, prepared, prefill);
  std::map<WindowSize, std::int32_t> out;
  for (std::size_t w = 0; w < windows_.size(); ++w) out.emplace_hint(out.end(), window_sizes_[w], prompt_need_[w]);
  return out;
}

std::int32_t KVCacheManager::PlanPromptBlocks(const TokenId* tokens, std::size_t n, const ReuseExtras& extras,
                                              const PreparedPrompt* prepared,
                                              std::optional<std::int32_t> prefill) const {
  const ReusePlan& plan = PlanReuse(tokens, n, extras, prepared);
  const std::int32_t first = FirstChunkEnd(n, plan.reused_tokens, prefill);
  PromptBlocksNeeded(plan, CeilDiv(first, tpb_));
  return first;
}

std::map<WindowSize, std::int32_t> KVCacheManager::GetNumBlocksToAllocate(const TokenId* tokens, std::size_t n,
                                                                          const ReuseExtras& extras,
                                                                          std::optional<std::int32_t> prefill) const {
  std::lock_guard<std::mutex> lock(mu_);
  ValidatePrompt(tokens, n, "get_num_blocks_to_allocate", -1);
  return BlocksToAllocateLocked(tokens, n, extras, prefill, nullptr);
}

std::map<WindowSize, std::int32_t> KVCacheManager::GetNumBlocksToAllocate(const PreparedPrompt& prompt,
                                                                          std::optional<std::int32_t> prefill) const {
  std::lock_guard<std::mutex> lock(mu_);
  CheckPrepared(prompt);
  return BlocksToAllocateLocked(prompt.tokens.data(), prompt.tokens.size(), prompt.extras, prefill, &prompt);
}

std::int32_t KVCacheManager::AddSequence(SeqId id, const TokenId* tokens, std::size_t n,
                                         const SequenceOptions& options, std::optional<std::int32_t> prefill) {
  std::lock_guard<std::mutex> lock(mu_);
  return AddSequenceLocked(id, tokens, n, options, prefill, nullptr);
}

std::int32_t KVCacheManager::AddSequence(SeqId id, const PreparedPrompt& prompt, const SequenceOptions& options,
                                         std::optional<std::int32_t> prefill) {
  // The sequence keeps the prompt: a copy, since the caller keeps this one.
  return AddSequence(id, std::make_shared<const PreparedPrompt>(prompt), options, prefill);
}

std::int32_t KVCacheManager::AddSequence(SeqId id, std::shared_ptr<const PreparedPrompt> prompt,
                                         const SequenceOptions& options, std::optional<std::int32_t> prefill) {
  if (prompt == nullptr) ThrowInvalid("add_sequence: null prepared prompt");
  std::lock_guard<std::mutex> lock(mu_);
  CheckPrepared(*prompt);
  const PreparedPrompt& p = *prompt;
  return AddSequenceLocked(id, p.tokens.data(), p.tokens.size(), options, prefill, std::move(prompt));
}

std::int32_t KVCacheManager::AddSequenceLocked(SeqId id, const TokenId* tokens, std::size_t n,
                                               const SequenceOptions& options, std::optional<std::int32_t> prefill,
                                               std::shared_ptr<const PreparedPrompt> prepared) {
  // `prepared` (the caller's tokens, if prepared) stays alive here while a round is undone.
  const ReuseExtras& extras = prepared != nullptr ? prepared->extras : options.extras;
  ValidateAdmission(id, tokens, n, options, extras, prefill, prepared != nullptr);
  std::vector<char> src_held(windows_.size(), 0);
  // A disk block that cannot be read back intact ends the round: the round is undone, the block
  // dropped (with what cascades below it) and the prompt planned again, so the hit stops before
  // it (a miss from there on). Each round takes a disk block off the prompt's path and none
  // joins it (spills move other content: the path's blocks are claimed), so the loop ends.
  // The shared tier is looked up once; its blocks extend a plan whose local hit ends where the
  // lookup started, and are left out if they would make the admission short of blocks.
  bool looked_up = false;
  bool use_shared = shared_ != nullptr;
  for (;;) {
    const ReusePlan& plan = PlanReuse(tokens, n, extras, prepared.get());
    if (use_shared && !looked_up) FetchShared(tokens, n, extras, prepared.get());
    looked_up = true;
    if (use_shared) ApplyShared();
    const Admission a = PlanAdmission(plan, n, prefill);
    try {
      CheckAdmissionBlocks(id, n, plan, a);
    } catch (const OutOfBlocksError&) {
      if (a.shared == 0) throw;
      use_shared = false;
      continue;
    }
    Sequence& seq = RegisterSequence(id, tokens, n, options, extras, prepared, a, plan.reused_tokens);
    std::fill(src_held.begin(), src_held.end(), 0);
    try {
      Admit(seq, plan, a, &src_held);
      shared_fetch_ = SharedFetch{};  // its bytes are in the blocks now
      AdmitState(seq, plan, a.first);
      CountLostHits(plan);
      return plan.reused_tokens;
    } catch (const DiskReadError& e) {
      UndoAdmission(seq, plan, src_held);
      windows_[static_cast<std::size_t>(e.window_index())]->DropUnreadable(e.block());
    }
  }
}

void KVCacheManager::Admit(Sequence& seq, const ReusePlan& plan, const Admission& a, std::vector<char>* src_held) {
  ClaimReused(seq, plan, a, src_held);
  // Slabs move once the reused blocks are held: a lent block's eviction (and an offload's
  // drop of the oldest host block) cannot reach them then. Free partial sources are kept.
  MoveSlabs();
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    if (a.has_partial && plan.partial_takeover[w]) Attach(seq, w, a.full, Handout::kTakeOver, plan.partial_src[w]);
  }
  std::vector<std::int64_t>& fresh = admit_fresh_;
  for (std::size_t w = 0; w < windows_.size(); ++w) fresh[w] = HandOutPrompt(seq, w, plan, a, &(*src_held)[w]);
  // Counted once every window has its blocks: a round undone counts nothing.
  for (std::size_t w = 0; w < windows_.size(); ++w) CountAdmission(seq, w, a, fresh[w]);
  // Onboards, partial copies and offloads must land before the engine reads or overwrites
  // these blocks: the call returns with every copy complete.
  backend_->Synchronize();
}

void KVCacheManager::UndoAdmission(Sequence& seq, const ReusePlan& plan, const std::vector<char>& src_held) {
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    WindowBlockManager& wm = *windows_[w];
    if (src_held[w] != 0) wm.Release(plan.partial_src[w]);
    const std::vector<BlockId>& blocks = seq.windows[w].blocks;
    // Newest first, like a sequence's end; positions not reached yet hold nothing.
    for (std::size_t j = blocks.size(); j-- > 0;) {
      if (blocks[j] != kNullBlock) wm.Release(blocks[j]);
    }
  }
  sequences_.erase(seq.id);
}

void KVCacheManager::ValidateAdmission(SeqId id, const TokenId* tokens, std::size_t n, const SequenceOptions& options,
                                       const ReuseExtras& extras, std::optional<std::int32_t> prefill,
                                       bool prepared) const {
  if (id < 0) ThrowInvalid("request_id must be >= 0, got ", id);
  if (sequences_.count(id) != 0) ThrowInvalid("request id ", id, " is already registered");
  if (!prepared) ValidatePrompt(tokens, n, "add_sequence", id);  // a prepared one was checked
  ValidatePriorities(id, options);
  ValidateMultimodal(extras, "add_sequence", id);
  if (max_batch_size_ > 0 && sequences_.size() >= static_cast<std::size_t>(max_batch_size_)) {
    throw KVCacheError(detail::Concat("request ", id, ": max_batch_size (", max_batch_size_,
                                      ") sequences are already registered"));
  }
  ValidatePrefill(prefill, "add_sequence", id);
}

void KVCacheManager::ValidatePriorities(SeqId id, const SequenceOptions& options) {
  auto check_priority = [id](const char* what, int p) {
    if (p < kMinPriority || p > kMaxPriority) ThrowInvalid("request ", id, ": ", what, " must be in 0..100, got ", p);
  };
  check_priority("priority", options.priority.value_or(kDefaultPriority));
  if (options.decode_priority.has_value()) check_priority("decode_priority", *options.decode_priority);
  if (options.decode_duration_ms < 0) ThrowInvalid("request ", id, ": decode_duration_ms must be >= 0");
  for (const PriorityRange& r : options.priority_ranges) {
    check_priority("a priority range's priority", r.priority);
    if (r.start < 0 || (r.end >= 0 && r.end <= r.start) || r.duration_ms < 0) {
      ThrowInvalid("request ", id, ": bad priority range [", r.start, ", ", r.end, ")");
    }
  }
}

KVCacheManager::Admission KVCacheManager::PlanAdmission(const ReusePlan& plan, std::size_t n,
                                                        std::optional<std::int32_t> prefill) const {
  Admission a;
  // Blocks now for the reused prefix and the first chunk; the rest of the prompt comes by Prefill.
  a.first = FirstChunkEnd(n, plan.reused_tokens, prefill);
  a.num_blocks = CeilDiv(a.first, tpb_);
  a.prompt_blocks = CeilDiv(static_cast<std::int64_t>(n), tpb_);
  a.full = plan.full_blocks;
  a.has_partial = plan.partial_tokens > 0 ? 1 : 0;
  a.shared = plan.shared_blocks;
  return a;
}

void KVCacheManager::CheckAdmissionBlocks(SeqId id, std::size_t n, const ReusePlan& plan, const Admission& a) {
  PromptBlocksNeeded(plan, a.num_blocks);
  const std::vector<std::int32_t>& need = prompt_need_;
  std::vector<std::int64_t>& available = check_available_;
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    check_need_[w] = need[w];
    available[w] = windows_[w]->NumFreePrimary();
  }
  // What this call claims or copies from is not lent.
  const KeptBlocks kept{tree_.get(), plan.path.data(), a.full, prompt_front_.data(),
                        a.has_partial ? plan.partial_src.data() : nullptr};
  const std::int64_t short_w = lender_->PlanBlocks(check_need_, available, &kept);
  if (short_w >= 0) {
    const auto w = static_cast<std::size_t>(short_w);
    throw OutOfBlocksError(detail::Concat("request ", id, ": window ", window_sizes_[w], " needs ", need[w],
                                          " blocks for a ", n, "-token prompt (", plan.reused_tokens,
                                          " tokens reused) but has ", available[w], " free", lender_->LendNote(w)));
  }
}

Sequence& KVCacheManager::RegisterSequence(SeqId id, const TokenId* tokens, std::size_t n,
                                           const SequenceOptions& options, const ReuseExtras& extras,
                                           std::shared_ptr<const PreparedPrompt> prepared, const Admission& a,
                                           std::int32_t reused) {
  Sequence& seq = sequences_[id];
  seq.id = id;
  seq.num_tokens = a.first;
  seq.prompt_len = static_cast<std::int32_t>(n);
  seq.priority = options.priority.value_or(kDefaultPriority);
  seq.explicit_priority = options.priority.has_value() || !options.priority_ranges.empty();
  seq.priority_ranges = options.priority_ranges;
  seq.decode_priority = options.decode_priority;
  seq.decode_duration_ms = options.decode_duration_ms;
  seq.extras = extras;
  if (prepared == nullptr) {
    seq.tokens.assign(tokens, tokens + n);
  } else {
    seq.prompt = std::move(prepared);  // shared: its tokens and keys are not copied
  }
  seq.windows.resize(windows_.size());
  seq.reused_tokens = reused;
  return seq;
}

void KVCacheManager::ClaimReused(Sequence& seq, const ReusePlan& plan, const Admission& a,
                                 std::vector<char>* src_held) {
  // Claim everything the plan reuses before taking any free block, so that no eviction can
  // pick a block this sequence is about to use.
  const std::vector<std::int32_t>& front = prompt_front_;
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    WindowBlockManager& wm = *windows_[w];
    SequenceWindow& sw = seq.windows[w];
    sw.blocks.reserve(static_cast<std::size_t>(a.prompt_blocks));  // later chunks grow it in place
    sw.blocks.assign(static_cast<std::size_t>(a.num_blocks), kNullBlock);
    sw.front_null = front[w];
    sw.released.assign(static_cast<std::size_t>(front[w]), {kNullBlock, 0});
    for (std::int32_t i = front[w]; i < a.full; ++i) {
      Attach(seq, w, i, Handout::kShare, tree_->Block(plan.path[static_cast<std::size_t>(i)], static_cast<std::int32_t>(w)));
    }
    if (a.has_partial && !plan.partial_takeover[w]) {
      // A source that is copied is held only while the copy is issued. A free primary source is
      // not held (that would cost a free block): the copy happens first (HandOutPrompt), and if
      // that block is itself the next victim it is taken over instead.
      const BlockId src = plan.partial_src[w];
      (*src_held)[w] = !wm.IsPrimary(src) || wm.RefCount(src) > 0;
      if ((*src_held)[w]) wm.Claim(src);
    }
  }
}

std::int64_t KVCacheManager::HandOutPrompt(Sequence& seq, std::size_t w, const ReusePlan& plan, const Admission& a,
                                           char* src_held) {
  WindowBlockManager& wm = *windows_[w];
  SequenceWindow& sw = seq.windows[w];
  const std::int32_t full = a.full;
  std::int64_t fresh = 0;
  if (a.has_partial && !plan.partial_takeover[w]) {  // first: before any other block of this window is taken
    const BlockId src = plan.partial_src[w];
    if (*src_held == 0 && wm.policy().Peek(CacheLevel::kPrimary) == src) {
      Attach(seq, w, full, Handout::kTakeOver, src);  // the free source is the next victim anyway
    } else {
      // A free source that this acquisition's eviction unlinks keeps its bytes until it is
      // handed out, which cannot happen before the copy below.
      AttachFresh(seq, w, full, full + 1);
      wm.CopyTokens(sw.blocks[static_cast<std::size_t>(full)], src, plan.partial_tokens);
      if (*src_held != 0) wm.Release(src);
      *src_held = 0;
      ++fresh;
    }
  }
  for (std::int32_t i = prompt_front_[w]; i < full; ++i) {
    if (!wm.IsPrimary(sw.blocks[static_cast<std::size_t>(i)])) {
      Attach(seq, w, i, Handout::kOnboard);
      ++fresh;
    }
  }
  // A sliding window's front may lie past the local hit when the shared tier extends it.
  const std::int32_t fresh_from = std::max(full + a.has_partial, prompt_front_[w]);
  AttachFresh(seq, w, fresh_from, a.num_blocks);
  if (a.shared > 0) FillShared(seq, w, fresh_from, full + a.shared);
  return fresh + (a.num_blocks - fresh_from);
}

void KVCacheManager::CountAdmission(Sequence& seq, std::size_t w, const Admission& a, std::int64_t fresh) {
  const std::int64_t reused_w = reuse_ ? a.full + a.has_partial + a.shared : 0;
  if (a.shared > 0) shared_->CountHits(a.full + a.shared - std::max(a.full, prompt_front_[w]));
  const std::int64_t missed_w = reuse_ ? a.prompt_blocks - reused_w : 0;  // the lookup covers the whole prompt
  counters_[w].alloc_total += a.num_blocks - prompt_front_[w];
  counters_[w].alloc_new += fresh;
  counters_[w].reused += reused_w;
  counters_[w].missed += missed_w;
  seq.reused_blocks += reused_w;
  seq.missed_blocks += missed_w;
  seq.new_blocks += fresh;
}

}  // namespace kvcache
