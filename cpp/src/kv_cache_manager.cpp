// The manager façade: construction, the one doors of blocks (Attach, AttachFresh, Detach) and
// of invalidation, the per-step calls (Prefill, AddTokens, Rewind, RemoveSequence) and queries.
// Admission: kv_cache_manager_admission.cpp; reuse: kv_cache_manager_reuse.cpp; estimates:
// kv_cache_manager_estimates.cpp; pools: pool_layout.cpp, block_offsets.cpp; checks:
// kv_cache_manager_invariants.cpp; slab lending: slab_lender.cpp.
#include "kvcache/kv_cache_manager.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <set>
#include <string>

#include "kvcache/errors.h"

namespace kvcache {
namespace {

std::int32_t CeilDiv(std::int64_t a, std::int64_t b) { return static_cast<std::int32_t>((a + b - 1) / b); }

void ValidateModel(const ModelSpec& model) {
  if (model.num_layers <= 0) ThrowInvalid("num_layers must be positive, got ", model.num_layers);
  if (model.head_dims.empty() && model.head_dim <= 0) ThrowInvalid("head_dim must be positive, got ", model.head_dim);
  if (model.kv_factor != 1 && model.kv_factor != 2) {
    ThrowInvalid("kv_factor must be 1 or 2, got ", model.kv_factor);
  }
  const auto n = model.num_kv_heads.size();
  if (n != 1 && n != static_cast<std::size_t>(model.num_layers)) {
    ThrowInvalid("num_kv_heads must have 1 or num_layers (", model.num_layers, ") entries, got ", n);
  }
  for (auto h : model.num_kv_heads) {
    if (h <= 0) ThrowInvalid("num_kv_heads entries must be positive, got ", h);
  }
  if (!model.head_dims.empty() && model.head_dims.size() != static_cast<std::size_t>(model.num_layers)) {
    ThrowInvalid("head_dims must be empty or have num_layers (", model.num_layers, ") entries, got ",
                 model.head_dims.size());
  }
  for (std::size_t l = 0; l < model.head_dims.size(); ++l) {
    if (model.head_dims[l] <= 0) ThrowInvalid("head_dims[", l, "] must be positive, got ", model.head_dims[l]);
  }
  if (!model.dtypes.empty() && model.dtypes.size() != static_cast<std::size_t>(model.num_layers)) {
    ThrowInvalid("dtypes must be empty or have num_layers (", model.num_layers, ") entries, got ",
                 model.dtypes.size());
  }
}

/// blocks_per_window must name exactly `windows`, with valid block counts, and
/// disk_blocks_per_window only windows with a host tier.
void ValidateBlockCounts(const ManagerConfig& config, const std::vector<WindowSize>& windows) {
  std::vector<WindowSize> given;
  for (const auto& kv : config.blocks_per_window) given.push_back(kv.first);
  if (given != windows) {
    std::string want;
    std::string got;
    for (auto w : windows) want += (want.empty() ? "" : ", ") + std::to_string(w);
    for (auto w : given) got += (got.empty() ? "" : ", ") + std::to_string(w);
    ThrowInvalid("blocks_per_window keys must be the window sizes [", want, "], got [", got, "]");
  }
  for (const auto& [w, counts] : config.blocks_per_window) {
    if (counts.primary <= 0) ThrowInvalid("window ", w, " needs at least one primary block, got ", counts.primary);
    if (counts.secondary < 0) ThrowInvalid("window ", w, " has a negative secondary block count");
  }
  for (const auto& [w, disk] : config.disk_blocks_per_window) {
    const auto counts = config.blocks_per_window.find(w);
    if (counts == config.blocks_per_window.end()) ThrowInvalid("disk_blocks_per_window: ", w, " is not a window size");
    if (disk < 0) ThrowInvalid("window ", w, " has a negative disk block count");
    if (disk > 0 && counts->second.secondary == 0) {
      ThrowInvalid("window ", w, " has disk blocks but no secondary blocks: blocks reach the disk tier from host "
                   "memory, so a disk cache needs a host cache");
    }
    if (static_cast<std::int64_t>(disk) + counts->second.primary + counts->second.secondary > std::numeric_limits<std::int32_t>::max()) {
      ThrowInvalid("window ", w, ": primary, secondary and disk blocks exceed 2**31 - 1 block ids");
    }
  }
}

}  // namespace

KVCacheManager::KVCacheManager(const ModelSpec& model, const ManagerConfig& config)
    : tpb_(config.tokens_per_block),
      max_seq_len_(config.max_seq_len),
      max_batch_size_(config.max_batch_size),
      max_draft_tokens_(config.max_draft_tokens),
      max_blocks_per_seq_(0),
      kv_factor_(model.kv_factor) {
  ValidateModel(model);
  if (tpb_ <= 0) ThrowInvalid("tokens_per_block must be positive, got ", tpb_);
  if (max_seq_len_ <= 0) ThrowInvalid("max_seq_len is required and must be positive, got ", max_seq_len_);
  if (max_batch_size_ < 0) ThrowInvalid("max_batch_size must be >= 0, got ", max_batch_size_);
  if (max_draft_tokens_ < 0) ThrowInvalid("max_draft_tokens must be >= 0, got ", max_draft_tokens_);
  max_blocks_per_seq_ = CeilDiv(max_seq_len_, tpb_);

  // Window of every layer: the pattern repeats over the layers; full attention = max_seq_len.
  std::vector<WindowSize> layer_window(static_cast<std::size_t>(model.num_layers), max_seq_len_);
  const auto& pattern = config.max_attention_window;
  for (std::int32_t l = 0; l < model.num_layers && !pattern.empty(); ++l) {
    const std::int32_t w = pattern[static_cast<std::size_t>(l) % pattern.size()];
    layer_window[l] = EffectiveWindow(w, max_seq_len_);
  }
  const std::set<WindowSize> distinct(layer_window.begin(), layer_window.end());
  window_sizes_.assign(distinct.begin(), distinct.end());
  for (const WindowSize w : window_sizes_) kinds_.push_back(MakeAttentionKind(w, max_seq_len_));
  ValidateBlockCounts(config, window_sizes_);

  reuse_ = config.enable_block_reuse;
  partial_reuse_ = config.enable_partial_reuse;
  copy_on_partial_ = config.copy_on_partial_reuse;
  swa_policy_ = config.swa_reuse_policy;
  if (config.secondary_offload_min_priority < kMinPriority || config.secondary_offload_min_priority > kMaxPriority) {
    ThrowInvalid("secondary_offload_min_priority must be in 0..100, got ", config.secondary_offload_min_priority);
  }
  if (!(config.protected_fraction >= 0.0 && config.protected_fraction <= 1.0)) {
    ThrowInvalid("protected_fraction must be in [0, 1], got ", config.protected_fraction);
  }
  if (config.event_buffer_max_size > 0) events_ = std::make_unique<EventLog>(config.event_buffer_max_size);
  std::vector<StateGroupLayout> state_groups = PlanStateGroups(model.recurrent_layers);
  tree_ = std::make_unique<ReuseTree>(static_cast<std::int32_t>(window_sizes_.size() + state_groups.size()));
  backend_ = MakeBackend(config.backend);
  std::vector<std::vector<PoolLayout>> pools = PlanPools(model, layer_window);
  MakeSharedTier(config, pools);
  MakeWindows(config, std::move(pools));
  MakeStatePools(config, std::move(state_groups));
  check_need_.assign(window_sizes_.size(), 0);
  admit_fresh_.assign(window_sizes_.size(), 0);
  check_available_.assign(window_sizes_.size(), 0);
  batch_counted_.assign(window_sizes_.size(), 0);
  counters_.assign(windows_.size(), WindowCounters{});
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    window_blocks_.push_back(CeilDiv(window_sizes_[w], tpb_));
    keep_.push_back(kinds_[w]->Keep(max_draft_tokens_, max_seq_len_));
    release_base_.push_back(kinds_[w]->ReleaseBase(tpb_, max_draft_tokens_));
  }
  bool tiers = false;  // a host tier in some window (a disk tier needs one)
  for (const auto& wm : windows_) tiers = tiers || wm->num_secondary() > 0;
  // A shared tier makes add_sequence wait on the store too (a lookup, then copies).
  may_copy_ = backend_->HasMemory() && (tiers || shared_ != nullptr || (reuse_ && partial_reuse_ && copy_on_partial_));
}

void KVCacheManager::MakeWindows(const ManagerConfig& config, std::vector<std::vector<PoolLayout>> window_pools) {
  lender_ = SlabLender::Make(config, window_sizes_, window_pools, backend_.get(), windows_);
  std::shared_ptr<SecondaryTier> disk_tier;  // shared by the windows that have disk blocks
  for (std::size_t w = 0; w < window_sizes_.size(); ++w) {
    const WindowSize window = window_sizes_[w];
    const WindowBlocks counts = config.blocks_per_window.at(window);
    const AttentionKind& kind = *kinds_[w];
    const bool swa = kind.ReleasesBlocks();
    WindowReuseOptions options;
    options.cascade_on_evict = kind.CascadesOnEvict(swa_policy_ == SwaReusePolicy::kInvalidate);
    options.onboard_blocks = config.onboard_blocks;
    options.secondary_offload_min_priority = config.secondary_offload_min_priority;
    options.protect_hit_blocks = config.protect_hit_blocks;
    options.protected_fraction = config.protected_fraction;
    const WindowPrimary primary = lender_->Primary(w, counts.primary);
    windows_.push_back(std::make_unique<WindowBlockManager>(window, swa, static_cast<std::int32_t>(w),
                                                            std::move(window_pools[w]), primary.num_primary,
                                                            counts.secondary, backend_.get(), tree_.get(), options,
                                                            events_.get(), primary.shared));
    const auto disk = config.disk_blocks_per_window.find(window);
    if (disk != config.disk_blocks_per_window.end() && disk->second > 0) {
      if (disk_tier == nullptr && backend_->HasMemory()) disk_tier = MakeDiskTier(config.disk_cache_dir);
      windows_.back()->AttachTier(disk->second, disk_tier);
    }
    pins_.emplace_back(static_cast<std::size_t>(windows_.back()->num_blocks()), 0);
    if (events_) {
      KVCacheEvent e;
      e.kind = EventKind::kCreated;
      e.window_size = window;
      e.num_primary_blocks = windows_.back()->NumOwnedPrimary();
      e.num_secondary_blocks = counts.secondary;
      events_->Push(std::move(e));
    }
  }
  lender_->Start();
}

KVCacheManager::~KVCacheManager() {
  if (zeros_ptr_ != nullptr) backend_->Free(CacheLevel::kSecondary, zeros_ptr_);
}

std::map<WindowSize, WindowBlocks> KVCacheManager::blocks_per_window() const {
  std::map<WindowSize, WindowBlocks> out;
  for (const auto& w : windows_) out[w->window()] = WindowBlocks{w->NumOwnedPrimary(), w->num_secondary()};
  return out;
}

Sequence& KVCacheManager::Find(SeqId id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) throw UnknownSequenceError(id);
  return it->second;
}

const Sequence& KVCacheManager::Find(SeqId id) const {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) throw UnknownSequenceError(id);
  return it->second;
}

std::size_t KVCacheManager::WindowIndex(WindowSize window) const {
  auto it = std::lower_bound(window_sizes_.begin(), window_sizes_.end(), window);
  if (it == window_sizes_.end() || *it != window) {
    std::string known;
    for (auto w : window_sizes_) known += (known.empty() ? "" : ", ") + std::to_string(w);
    ThrowInvalid("window_size ", window, " is not one of this manager's windows [", known, "]");
  }
  return static_cast<std::size_t>(it - window_sizes_.begin());
}

void KVCacheManager::ReleaseFrontFrom(Sequence& seq, std::size_t w, std::int32_t num_tokens) {
  Detach(seq, w, seq.windows[w].front_null, ReleaseTarget(w, num_tokens), Leave::kOutOfWindow);
}

std::int64_t KVCacheManager::NowMs() const {
  if (fake_now_ms_ >= 0) return fake_now_ms_;
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void KVCacheManager::SetFakeTimeMs(std::int64_t now_ms) {
  std::lock_guard<std::mutex> lock(mu_);
  fake_now_ms_ = now_ms;
}

KVCacheManager::BlockPriorityRun KVCacheManager::BlockPriority(const Sequence& seq, std::int32_t j,
                                                               std::int32_t last) const {
  const std::int64_t first = static_cast<std::int64_t>(j) * tpb_;
  std::int64_t duration = 0;
  int priority = seq.priority;
  std::int32_t end = last;
  if (first < seq.prompt_len) {
    // Prompt blocks: one run to the end of the prompt without ranges, else block by block.
    end = seq.priority_ranges.empty() ? std::min(last, CeilDiv(seq.prompt_len, tpb_)) : j + 1;
    for (const PriorityRange& r : seq.priority_ranges) {
      if (first >= r.start && (r.end < 0 || first < r.end)) {
        priority = r.priority;
        duration = r.duration_ms;
        break;
      }
    }
  } else if (seq.decode_priority.has_value()) {
    priority = *seq.decode_priority;
    duration = seq.decode_duration_ms;
  }
  return {priority, duration > 0 ? NowMs() + duration : 0, end};
}

BlockId KVCacheManager::Attach(Sequence& seq, std::size_t w, std::int32_t j, Handout how, BlockId b) {
  WindowBlockManager& wm = *windows_[w];
  BlockId& slot = seq.windows[w].blocks[static_cast<std::size_t>(j)];
  const BlockPriorityRun p = BlockPriority(seq, j, j + 1);
  displaced_.clear();
  switch (how) {
    case Handout::kShare:
      KVC_DCHECK(slot == kNullBlock, "shared block for an occupied position");
      wm.Claim(b);
      wm.MarkHit(b);
      if (seq.explicit_priority && wm.IsPrimary(b)) wm.SetPriority(b, p.priority, p.expiry_ms);
      slot = b;
      break;
    case Handout::kTakeOver:
      KVC_DCHECK(slot == kNullBlock, "takeover for an occupied position");
      slot = wm.Grant(b, p.priority, p.expiry_ms, /*offload=*/false, &displaced_);
      break;
    case Handout::kOnboard:
      KVC_DCHECK(!wm.IsPrimary(slot), "onboard of a position that holds no secondary block");
      slot = wm.Onboard(slot, p.priority, p.expiry_ms, &displaced_);
      break;
  }
  if (!displaced_.empty()) InvalidateReleasers(displaced_, seq.id, "granted");
  return slot;
}

void KVCacheManager::AttachFresh(Sequence& seq, std::size_t w, std::int32_t first, std::int32_t last) {
  WindowBlockManager& wm = *windows_[w];
  BlockId* slots = seq.windows[w].blocks.data();
  displaced_.clear();
  for (std::int32_t j = first; j < last;) {
    const BlockPriorityRun p = BlockPriority(seq, j, last);
    for (std::int32_t i = j; i < p.end; ++i) KVC_DCHECK(slots[i] == kNullBlock, "fresh block for an occupied position");
    wm.AcquireN(p.end - j, p.priority, p.expiry_ms, slots + j, &displaced_);
    j = p.end;
  }
  if (!displaced_.empty()) InvalidateReleasers(displaced_, seq.id, "granted");
}

void KVCacheManager::InvalidateReleasers(const std::vector<SeqId>& releasers, SeqId except, const char* what) {
  // Releaser lists name live sequences only (ForgetReleases runs when a sequence ends). A
  // sequence reclaiming its own released block (`except`) is not invalidated: its record is
  // merely stale (the generation changed), so StoreChain skips that position.
  for (const SeqId displaced : releasers) {
    if (displaced == except) continue;
    auto it = sequences_.find(displaced);
    KVC_CHECK(it != sequences_.end(), detail::Concat("releaser ", displaced, " of a ", what, " block is not live"));
    it->second.valid_for_reuse = false;
  }
}

void KVCacheManager::MoveSlabs() {
  // A sequence that released a lent block out of window lost that content, as if another
  // sequence had reclaimed it (its own included: the bytes now belong to another window).
  InvalidateReleasers(lender_->MoveSlabs(), /*except=*/-1, "lent");
}

void KVCacheManager::Detach(Sequence& seq, std::size_t w, std::int32_t first, std::int32_t last, Leave why) {
  WindowBlockManager& wm = *windows_[w];
  SequenceWindow& sw = seq.windows[w];
  BlockId* slots = sw.blocks.data();
  for (std::int32_t j = first; j < last; ++j) KVC_DCHECK(slots[j] != kNullBlock, "detach of an empty position");
  switch (why) {
    case Leave::kOutOfWindow:
      KVC_DCHECK(first == sw.front_null, "out-of-window release must be at the front");
      if (sw.released.capacity() < static_cast<std::size_t>(last)) {  // one growth, still geometric
        sw.released.reserve(std::max(static_cast<std::size_t>(last), 2 * sw.released.capacity()));
      }
      for (std::int32_t j = first; j < last; ++j) sw.released.emplace_back(slots[j], wm.Generation(slots[j]));
      wm.ReleaseN(slots + first, last - first, /*reverse=*/false, /*to_front=*/false, /*released_by=*/seq.id);
      sw.front_null = last;
      break;
    case Leave::kRewind:
      wm.ReleaseN(slots + first, last - first, /*reverse=*/true, /*to_front=*/true);
      break;
    case Leave::kEnd:
      wm.ReleaseN(slots + first, last - first, /*reverse=*/true);
      break;
  }
  std::fill(slots + first, slots + last, kNullBlock);
}

void KVCacheManager::ForgetReleases(const Sequence& seq) {
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    for (const auto& [b, generation] : seq.windows[w].released) {
      if (b != kNullBlock && windows_[w]->Generation(b) == generation) windows_[w]->ForgetRelease(b, seq.id);
    }
  }
}

bool KVCacheManager::IsPrivate(const Sequence& seq, std::size_t w, std::int32_t j) const {
  const WindowBlockManager& wm = *windows_[w];
  const BlockId b = seq.windows[w].blocks[static_cast<std::size_t>(j)];
  return wm.RefCount(b) == 1 && wm.NodeOf(b) == kNoNode && !wm.HasReleasers(b);
}

void KVCacheManager::Prefill(SeqId id, std::int32_t num_tokens) { Prefill(&id, &num_tokens, 1); }

void KVCacheManager::Prefill(const SeqId* ids, const std::int32_t* num_tokens, std::size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  // 1. Validate every argument before touching anything.
  BeginBatch(n);
  std::int64_t need = 0;  // new blocks of the whole batch (the same in every window)
  bool writes = false;    // some chunk starts inside a block the sequence holds
  for (std::size_t i = 0; i < n; ++i) {
    Sequence& seq = BatchMember(i, ids[i], "prefill");
    if (num_tokens[i] < 1) ThrowInvalid("prefill: num_tokens must be >= 1, got ", num_tokens[i]);
    const std::int32_t remaining = seq.prompt_len - seq.num_tokens;
    if (num_tokens[i] > remaining) {
      ThrowInvalid("prefill: request ", ids[i], " has ", std::max(remaining, 0), " prompt tokens left, cannot prefill ",
                   num_tokens[i]);
    }
    need += CeilDiv(seq.num_tokens + num_tokens[i], tpb_) - static_cast<std::int32_t>(seq.windows[0].blocks.size());
    batch_kept_[i] = seq.num_tokens % tpb_;
    batch_write_[i] = batch_kept_[i] == 0 ? -1 : seq.num_tokens / tpb_;
    writes = writes || batch_kept_[i] != 0;
  }
  // 2. Check. A chunk's first query, at position num_tokens, attends nothing before what a
  //    sequence of num_tokens + 1 tokens keeps: the decode step's release rule, so what the
  //    releases free counts as in AddTokens.
  std::fill(check_need_.begin(), check_need_.end(), need);
  const std::int64_t copies = writes && forked_ ? CountBatchCopies() : 0;
  const std::int64_t short_w = need > 0 || copies > 0 ? ShortWindowForBatch() : -1;
  if (short_w >= 0) {
    const auto w = static_cast<std::size_t>(short_w);
    const std::int64_t available = check_available_[w];
    if (n == 1) {
      throw OutOfBlocksError(detail::Concat("prefill: request ", ids[0], " needs ", check_need_[w],
                                            " new blocks in window ", window_sizes_[w], " for ", num_tokens[0],
                                            " tokens but only ", available, " can be freed or are free",
                                            lender_->LendNote(w)));
    }
    throw OutOfBlocksError(detail::Concat("prefill needs ", check_need_[w], " new blocks in window ", window_sizes_[w],
                                          " for ", n, " requests but only ", available, " can be freed or are free",
                                          lender_->LendNote(w)));
  }
  MoveSlabs();
  // 3. Mutate: every sequence releases first (the check credited those blocks), copies the shared
  //    blocks its chunk writes into, then hands out.
  for (Sequence* seq : batch_) {
    for (std::size_t w = 0; w < windows_.size(); ++w) ReleaseFront(*seq, w, seq->num_tokens + 1);
  }
  if (copies > 0) CopyBatchWrites();
  for (std::size_t i = 0; i < n; ++i) {
    Sequence& seq = *batch_[i];
    const std::int32_t new_len = seq.num_tokens + num_tokens[i];
    const auto positions = static_cast<std::int32_t>(seq.windows[0].blocks.size());
    const std::int32_t grow = CeilDiv(new_len, tpb_) - positions;
    if (grow > 0) {
      for (std::size_t w = 0; w < windows_.size(); ++w) {
        seq.windows[w].blocks.resize(static_cast<std::size_t>(positions + grow), kNullBlock);
        AttachFresh(seq, w, positions, positions + grow);
      }
      seq.new_blocks += static_cast<std::int64_t>(grow) * static_cast<std::int64_t>(windows_.size());
    }
    const std::int32_t old_len = seq.num_tokens;
    seq.num_tokens = new_len;
    AdvanceState(seq, old_len, new_len);
  }
  for (auto& c : counters_) {
    c.alloc_total += need;
    c.alloc_new += need;
  }
  backend_->Synchronize();  // offloads of evicted blocks and copies finish before they are overwritten
}

std::int32_t KVCacheManager::PromptLength(SeqId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Find(id).prompt_len;
}

void KVCacheManager::BeginBatch(std::size_t n) {
  ++stamp_;
  batch_.resize(n);  // sized once and written by index (BatchMember)
  batch_write_.resize(n);
  batch_kept_.resize(n);
}

void KVCacheManager::ThrowRepeated(SeqId id, const char* call) {
  ThrowInvalid("request id ", id, " appears twice in one ", call, " call");
}

std::int64_t KVCacheManager::ShortWindowForBatch() {
  // Releases are counted only where they matter: in a window short of free blocks and, once one
  // is, in every window, since a lender may borrow what the others keep beyond their need.
  // (Without lending the call fails then anyway: the other windows' counts change no answer.)
  bool short_of_blocks = false;
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    std::int64_t& available = check_available_[w];
    available = windows_[w]->NumFreePrimary();
    batch_counted_[w] = 0;
    if (available >= check_need_[w]) continue;
    available += FreedByBatchReleases(w);
    batch_counted_[w] = 1;
    short_of_blocks = short_of_blocks || available < check_need_[w];
  }
  if (!short_of_blocks) return -1;
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    if (!batch_counted_[w]) check_available_[w] += FreedByBatchReleases(w);
  }
  return lender_->PlanBlocks(check_need_, check_available_);
}

std::int64_t KVCacheManager::FreedByBatchReleases(std::size_t w) {
  const WindowBlockManager& wm = *windows_[w];
  std::int64_t freed = 0;
  shared_release_.clear();
  for (const Sequence* seq : batch_) {
    const SequenceWindow& sw = seq->windows[w];
    const std::int32_t target = ReleaseTarget(w, seq->num_tokens + 1);
    for (std::int32_t j = sw.front_null; j < target; ++j) {
      const BlockId b = sw.blocks[static_cast<std::size_t>(j)];
      if (wm.RefCount(b) == 1) {
        ++freed;
      } else {
        shared_release_.push_back(b);
      }
    }
  }
  // A block shared by several sequences of the batch is freed if all its holders release it.
  std::sort(shared_release_.begin(), shared_release_.end());
  for (std::size_t i = 0; i < shared_release_.size();) {
    std::size_t j = i;
    while (j < shared_release_.size() && shared_release_[j] == shared_release_[i]) ++j;
    if (static_cast<std::int32_t>(j - i) == wm.RefCount(shared_release_[i])) ++freed;
    i = j;
  }
  return freed;
}

void KVCacheManager::AddToken(SeqId id, TokenId token) { AddTokens(&id, &token, 1); }

void KVCacheManager::AddTokens(const SeqId* ids, const TokenId* tokens, std::size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  BeginBatch(n);
  AddTokensLocked(ids, tokens, n, /*found=*/false);
}

std::int64_t KVCacheManager::AddTokensIfLengths(const SeqId* ids, const TokenId* tokens, const std::int32_t* lengths,
                                                std::size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  BeginBatch(n);
  for (std::size_t i = 0; i < n; ++i) {  // FirstLengthMismatch, keeping what it found
    const auto it = sequences_.find(ids[i]);
    if (it == sequences_.end() || it->second.num_tokens != lengths[i]) return static_cast<std::int64_t>(i);
    batch_[i] = &it->second;
  }
  AddTokensLocked(ids, tokens, n, /*found=*/true);
  return -1;
}

void KVCacheManager::AddTokensLocked(const SeqId* ids, const TokenId* tokens, std::size_t n, bool found) {
  // 1. Validate every argument before touching anything.
  batch_new_block_.resize(n);  // written by index, as batch_: no push_back per sequence
  std::int32_t need = 0;  // sequences that start a new block (the same in every window)
  bool writes = false;    // some sequence writes into a block it holds (copy-on-write after a fork)
  for (std::size_t i = 0; i < n; ++i) {
    Sequence& seq = found ? MarkMember(i, *batch_[i], "add_tokens") : BatchMember(i, ids[i], "add_tokens");
    if (seq.InPrefill()) {
      ThrowInvalid("request ", ids[i], " is still in prefill (", seq.num_tokens, " of ", seq.prompt_len,
                   " prompt tokens have blocks): call prefill first");
    }
    if (tokens[i] < 0) ThrowInvalid("request ", ids[i], ": token is negative (", tokens[i], ")");
    if (seq.num_tokens >= max_seq_len_) {
      ThrowInvalid("request ", ids[i], ": adding a token would exceed max_seq_len ", max_seq_len_);
    }
    const bool starts_block = seq.num_tokens % tpb_ == 0;
    need += starts_block ? 1 : 0;
    batch_new_block_[i] = starts_block ? 1 : 0;
    const std::int32_t kept = seq.num_tokens % tpb_;
    batch_write_[i] = starts_block ? -1 : seq.num_tokens / tpb_;
    batch_kept_[i] = kept;
    writes = writes || !starts_block;
  }
  // 2. Check that every window can serve the new blocks and the copies of shared blocks written
  //    into, counting the blocks that the sliding windows release in this same step (released
  //    before anything is allocated).
  std::fill(check_need_.begin(), check_need_.end(), need);
  const std::int64_t copies = writes && forked_ ? CountBatchCopies() : 0;
  const bool any_need = need > 0 || copies > 0;
  const std::int64_t short_w = any_need ? ShortWindowForBatch() : -1;
  if (short_w >= 0) {
    const auto w = static_cast<std::size_t>(short_w);
    throw OutOfBlocksError(detail::Concat("add_tokens needs ", check_need_[w], " new blocks in window ",
                                          window_sizes_[w], " but only ", check_available_[w],
                                          " can be freed or are free", lender_->LendNote(w)));
  }
  MoveSlabs();
  // 3. Mutate: append, release what left each sliding window, copy shared blocks written into,
  //    then allocate.
  for (std::size_t i = 0; i < n; ++i) {
    Sequence& seq = *batch_[i];
    seq.AppendToken(tokens[i]);
    ++seq.num_tokens;
    for (std::size_t w = 0; w < windows_.size(); ++w) ReleaseFront(seq, w, seq.num_tokens);
    if (!states_.empty()) AdvanceState(seq, seq.num_tokens - 1, seq.num_tokens);
  }
  if (!any_need) return;
  if (copies > 0) CopyBatchWrites();
  for (std::size_t i = 0; i < n; ++i) {
    if (!batch_new_block_[i]) continue;
    Sequence* seq = batch_[i];
    const auto position = static_cast<std::int32_t>(seq->windows[0].blocks.size());
    for (std::size_t w = 0; w < windows_.size(); ++w) {
      seq->windows[w].blocks.push_back(kNullBlock);
      AttachFresh(*seq, w, position, position + 1);
    }
    seq->new_blocks += static_cast<std::int64_t>(windows_.size());
  }
  for (auto& c : counters_) {
    c.alloc_total += need;
    c.alloc_new += need;
  }
  backend_->Synchronize();  // offloads of evicted blocks and copies finish before they are overwritten
}

std::map<WindowSize, std::vector<BlockId>> KVCacheManager::RemoveSequence(SeqId id, bool store_for_reuse, bool pin) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sequences_.find(id);
  if (it == sequences_.end()) throw UnknownSequenceError(id);
  if (pin && !reuse_) throw KVCacheError("remove_sequence(pin=True) needs block reuse (enable_block_reuse)");
  Sequence& seq = it->second;
  std::vector<std::vector<BlockId>> pinned(windows_.size());
  if (reuse_ && store_for_reuse && (seq.valid_for_reuse || swa_policy_ == SwaReusePolicy::kPlaceholder)) {
    StoreChain(seq, seq.num_tokens - 1, /*full_only=*/false, pin ? &pinned : nullptr);
    StoreCheckpoints(seq, seq.num_tokens - 1, /*all=*/true);
  }
  ReleaseState(seq);
  ForgetReleases(seq);
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    // Newest first: a sequence's tail is the least shareable part and is evicted first.
    Detach(seq, w, seq.windows[w].front_null, static_cast<std::int32_t>(seq.windows[w].blocks.size()), Leave::kEnd);
  }
  sequences_.erase(it);
  return PinnedByWindow(std::move(pinned));
}

void KVCacheManager::Rewind(SeqId id, std::int32_t num_tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  Sequence& seq = Find(id);
  if (num_tokens < 0) ThrowInvalid("rewind: num_tokens must be >= 0, got ", num_tokens);
  if (num_tokens >= seq.num_tokens) {
    ThrowInvalid("rewind: request ", id, " has ", seq.num_tokens, " tokens; cannot drop ", num_tokens);
  }
  if (seq.InPrefill()) ThrowInvalid("rewind: request ", id, " is still in prefill");
  const std::int32_t new_len = seq.num_tokens - num_tokens;
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    const std::int32_t front = seq.windows[w].front_null;
    if (front > 0 && static_cast<std::int64_t>(front) * tpb_ > static_cast<std::int64_t>(new_len) - window_sizes_[w]) {
      ThrowInvalid("rewind: request ", id, " would need tokens that window ", window_sizes_[w],
                   " already released; rewind at most max_draft_tokens (", max_draft_tokens_,
                   ") tokens past the last release");
    }
  }
  const std::int32_t restore = RewindCheckpoint(seq, new_len);  // throws without one
  const auto keep = static_cast<std::size_t>(CeilDiv(new_len, tpb_));
  const std::int32_t tail_tokens = new_len % tpb_;
  // The last kept block will be written again: unless it is private, it is copied first.
  std::vector<char> copy(windows_.size(), 0);
  std::vector<std::int64_t> need(windows_.size(), 0);
  std::vector<std::int64_t> available(windows_.size(), 0);
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    const WindowBlockManager& wm = *windows_[w];
    const auto& blocks = seq.windows[w].blocks;
    available[w] = wm.NumFreePrimary();
    if (tail_tokens == 0 || IsPrivate(seq, w, static_cast<std::int32_t>(keep - 1))) continue;
    copy[w] = 1;
    need[w] = 1;
    for (std::size_t j = keep; j < blocks.size(); ++j) available[w] += wm.RefCount(blocks[j]) == 1 ? 1 : 0;
  }
  const std::int64_t short_w = lender_->PlanBlocks(need, available);
  if (short_w >= 0) {
    throw OutOfBlocksError(detail::Concat("rewind: request ", id, " needs a private copy of a shared block in window ",
                                          window_sizes_[static_cast<std::size_t>(short_w)], " but no block is free",
                                          lender_->LendNote(static_cast<std::size_t>(short_w))));
  }
  MoveSlabs();
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    auto& blocks = seq.windows[w].blocks;
    Detach(seq, w, static_cast<std::int32_t>(keep), static_cast<std::int32_t>(blocks.size()), Leave::kRewind);
    blocks.resize(keep);
    if (copy[w]) CopyOnWrite(seq, w, static_cast<std::int32_t>(keep - 1), tail_tokens);
  }
  backend_->Synchronize();
  seq.OwnTokens();
  seq.tokens.resize(static_cast<std::size_t>(new_len));
  seq.num_tokens = new_len;
  // Rewound prompt tokens are prompt no longer: what store_context_blocks may store shrinks too.
  seq.prompt_len = std::min(seq.prompt_len, new_len);
  RewindState(seq, restore);
}

std::int32_t KVCacheManager::NumTokens(SeqId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Find(id).num_tokens;
}

bool KVCacheManager::HasSequence(SeqId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return sequences_.count(id) != 0;
}

std::size_t KVCacheManager::NumSequences() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sequences_.size();
}

std::vector<BlockId> KVCacheManager::GetCacheBlockIds(SeqId id, WindowSize window) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::size_t w = WindowIndex(window);
  return Find(id).windows[w].blocks;
}

std::int32_t KVCacheManager::GetNumFreeBlocks(WindowSize window) const {
  std::lock_guard<std::mutex> lock(mu_);
  return lender_->FreeBlocks(WindowIndex(window));
}

std::int32_t KVCacheManager::GetMinNumFreeBlocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::int32_t m = lender_->FreeBlocks(0);
  for (std::size_t w = 1; w < windows_.size(); ++w) m = std::min(m, lender_->FreeBlocks(w));
  return m;
}

bool KVCacheManager::CanAllocate(const std::map<WindowSize, std::int32_t>& need) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::int64_t> want(windows_.size(), 0);
  std::vector<std::int64_t> available(windows_.size(), 0);
  for (std::size_t w = 0; w < windows_.size(); ++w) available[w] = windows_[w]->NumFreePrimary();
  for (const auto& [window, n] : need) {
    const std::size_t w = WindowIndex(window);
    want[w] = std::max(n, 0);
    available[w] += std::max(-n, 0);  // a credit
  }
  return lender_->ServesStep(want, available);
}

bool KVCacheManager::FitsWhenEmpty(const std::map<WindowSize, std::int32_t>& need) const {
  std::lock_guard<std::mutex> lock(mu_);
  return lender_->FitsWhenEmpty(need, [this](WindowSize window) { return WindowIndex(window); });
}

std::int32_t KVCacheManager::GetNumUsedBlocks(WindowSize window) const {
  std::lock_guard<std::mutex> lock(mu_);
  const WindowBlockManager& wm = *windows_[WindowIndex(window)];
  return wm.NumOwnedPrimary() - wm.NumFreePrimary();
}

KvCacheStats KVCacheManager::GetStats() const {
  std::lock_guard<std::mutex> lock(mu_);
  KvCacheStats s;
  s.tokens_per_block = tpb_;
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    const auto& wm = *windows_[w];
    s.max_num_blocks += wm.NumOwnedPrimary();
    s.num_owned_blocks_per_window_size[wm.window()] = wm.NumOwnedPrimary();
    s.free_num_blocks += wm.NumFreePrimary();
    s.num_free_blocks_per_window_size[wm.window()] = wm.NumFreePrimary();
    s.allocated_bytes += static_cast<std::int64_t>(wm.allocated_bytes());
    s.alloc_total_blocks += counters_[w].alloc_total;
    s.alloc_new_blocks += counters_[w].alloc_new;
    s.reused_blocks += counters_[w].reused;
    s.missed_blocks += counters_[w].missed;
    s.reused_blocks_per_window_size[wm.window()] = counters_[w].reused;
    s.missed_blocks_per_window_size[wm.window()] = counters_[w].missed;
    s.forked_blocks += counters_[w].forked;
    s.copied_on_write_blocks += counters_[w].copied;
    s.offloaded_blocks += wm.offloaded_blocks();
    s.onboarded_blocks += wm.onboarded_blocks();
    s.disk_read_failures += wm.disk_read_failures();
  }
  if (shared_ != nullptr) {
    const SharedTierCounters c = shared_->Counters();
    s.shared_hits = c.hits;
    s.shared_writes = c.writes;
    s.shared_write_drops = c.write_drops;
    s.shared_errors = c.errors;
    s.shared_auth_failures = c.auth_failures;
  }
  s.num_cached_nodes = static_cast<std::int64_t>(tree_->NumNodes()) - 1;
  s.lent_slabs = lender_->lent_slabs();
  s.allocated_bytes += backend_->HasMemory() ? static_cast<std::int64_t>(lender_->arena_bytes()) : 0;
  s.used_num_blocks = s.max_num_blocks - s.free_num_blocks;
  for (const auto& pool : states_) {
    s.state_slots += pool->num_slots();
    s.working_state_slots += pool->NumWorking();
    s.pending_checkpoints += pool->NumPending();
    s.cached_checkpoints += pool->NumCached();
    s.free_state_slots += pool->NumFree();
    s.checkpoints_evicted += pool->evicted();
    s.checkpoints_offloaded += pool->offloaded();
    s.host_cached_checkpoints += pool->NumCachedSecondary();
  }
  s.checkpoints_onboarded = state_counters_.onboarded;
  s.checkpoints_stored = state_counters_.stored;
  s.checkpoints_restored = state_counters_.restored;
  s.checkpoints_skipped = state_counters_.skipped;
  s.lost_hit_tokens_attention = state_counters_.lost_attention;
  s.lost_hit_tokens_sliding_window = state_counters_.lost_sliding;
  s.lost_hit_tokens_no_checkpoint = state_counters_.lost_checkpoint;
  const auto lookups = s.reused_blocks + s.missed_blocks;
  s.cache_hit_rate = lookups == 0 ? 0.0 : static_cast<double>(s.reused_blocks) / static_cast<double>(lookups);
  return s;
}

}  // namespace kvcache
