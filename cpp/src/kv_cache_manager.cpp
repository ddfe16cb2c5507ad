#include "kvcache/kv_cache_manager.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <set>
#include <string>
#include <tuple>

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

/// The pool key of a layer: layers of one window with equal keys share a pool. Ordered, so a
/// window's pools are sorted by KV-head count, then head size, then dtype.
using PoolKey = std::tuple<std::int32_t, std::int32_t, DType>;

PoolKey LayerPoolKey(const ModelSpec& model, std::int32_t l) {
  const auto i = static_cast<std::size_t>(l);
  const std::int32_t heads = model.num_kv_heads.size() == 1 ? model.num_kv_heads[0] : model.num_kv_heads[i];
  const std::int32_t head_dim = model.head_dims.empty() ? model.head_dim : model.head_dims[i];
  const DType dtype = model.dtypes.empty() ? model.dtype : model.dtypes[i];
  return {heads, head_dim, dtype};
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
    layer_window[l] = (w <= 0 || w >= max_seq_len_) ? max_seq_len_ : w;
  }
  const std::set<WindowSize> distinct(layer_window.begin(), layer_window.end());
  window_sizes_.assign(distinct.begin(), distinct.end());
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
  tree_ = std::make_unique<ReuseTree>(static_cast<std::int32_t>(window_sizes_.size()));
  backend_ = MakeBackend(config.backend);
  MakeWindows(config, PlanPools(model, layer_window));
  check_need_.assign(window_sizes_.size(), 0);
  check_available_.assign(window_sizes_.size(), 0);
  batch_counted_.assign(window_sizes_.size(), 0);
  counters_.assign(windows_.size(), WindowCounters{});
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    window_blocks_.push_back(CeilDiv(window_sizes_[w], tpb_));
    keep_.push_back(windows_[w]->is_swa() ? block_math::Keep(window_sizes_[w], max_draft_tokens_, max_seq_len_)
                                          : block_math::kKeepAll);
    // Full attention never releases: a base no sequence length reaches.
    release_base_.push_back(windows_[w]->is_swa() ? static_cast<std::int64_t>(window_sizes_[w]) + max_draft_tokens_ + tpb_
                                                  : std::numeric_limits<std::int64_t>::max() / 2);
  }
  bool tiers = false;  // a host tier in some window (a disk tier needs one)
  for (const auto& wm : windows_) tiers = tiers || wm->num_secondary() > 0;
  may_copy_ = backend_->HasMemory() && (tiers || (reuse_ && partial_reuse_ && copy_on_partial_));
}

std::vector<std::vector<PoolLayout>> KVCacheManager::PlanPools(const ModelSpec& model,
                                                               const std::vector<WindowSize>& layer_window) {
  layer_to_pool_.assign(static_cast<std::size_t>(model.num_layers), {-1, -1});
  std::int32_t global_pool = 0;
  std::vector<std::vector<PoolLayout>> window_pools(window_sizes_.size());
  for (std::size_t w = 0; w < window_sizes_.size(); ++w) {
    const WindowSize window = window_sizes_[w];
    std::map<PoolKey, PoolLayout> by_shape;  // ascending (heads, head size, dtype)
    for (std::int32_t l = 0; l < model.num_layers; ++l) {
      if (layer_window[l] != window) continue;
      const PoolKey key = LayerPoolKey(model, l);
      PoolLayout& pool = by_shape[key];
      pool.num_kv_heads = std::get<0>(key);
      pool.layers.push_back(l);
      pool.kv_factor = model.kv_factor;
      pool.tokens_per_block = tpb_;
      pool.head_dim = std::get<1>(key);
      pool.dtype = std::get<2>(key);
      pool.elem_bytes = DTypeBytes(pool.dtype);
    }
    for (auto& kv : by_shape) {
      const auto pool_in_window = window_pools[w].size();
      for (std::size_t i = 0; i < kv.second.layers.size(); ++i) {
        layer_to_pool_[kv.second.layers[i]] = {global_pool, static_cast<std::int32_t>(i)};
      }
      pool_index_.emplace_back(w, pool_in_window);
      ++global_pool;
      window_pools[w].push_back(std::move(kv.second));
    }
  }
  return window_pools;
}

void KVCacheManager::MakeWindows(const ManagerConfig& config, std::vector<std::vector<PoolLayout>> window_pools) {
  lender_ = SlabLender::Make(config, window_sizes_, window_pools, backend_.get(), windows_);
  std::shared_ptr<SecondaryTier> disk_tier;  // shared by the windows that have disk blocks
  for (std::size_t w = 0; w < window_sizes_.size(); ++w) {
    const WindowSize window = window_sizes_[w];
    const WindowBlocks counts = config.blocks_per_window.at(window);
    const bool swa = window < max_seq_len_;
    WindowReuseOptions options;
    options.cascade_on_evict = !swa || swa_policy_ == SwaReusePolicy::kInvalidate;
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

KVCacheManager::~KVCacheManager() = default;

std::map<WindowSize, WindowBlocks> KVCacheManager::blocks_per_window() const {
  std::map<WindowSize, WindowBlocks> out;
  for (const auto& w : windows_) out[w->window()] = WindowBlocks{w->NumOwnedPrimary(), w->num_secondary()};
  return out;
}

std::vector<PoolInfo> KVCacheManager::pools() const {
  std::vector<PoolInfo> out;
  for (const auto& [w, p] : pool_index_) {
    const WindowBlockManager& wm = *windows_[w];
    const PoolLayout& layout = wm.pools()[p];
    PoolInfo info;
    info.window = wm.window();
    info.num_kv_heads = layout.num_kv_heads;
    info.layers = layout.layers;
    info.kv_factor = layout.kv_factor;
    info.head_dim = layout.head_dim;
    info.dtype = layout.dtype;
    info.block_bytes = layout.BlockBytes();
    info.block_stride = wm.primary_stride(p);
    info.num_primary = wm.num_primary();
    info.num_secondary = wm.num_secondary();
    info.primary_ptr = reinterpret_cast<std::uintptr_t>(wm.primary_base(p));
    info.secondary_ptr = reinterpret_cast<std::uintptr_t>(wm.secondary_base(p));
    out.push_back(std::move(info));
  }
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

void KVCacheManager::PromptBlocksNeeded(const ReusePlan& plan, std::int32_t num_blocks) const {
  std::vector<std::int32_t>& need = prompt_need_;
  std::vector<std::int32_t>& front = prompt_front_;
  need.assign(windows_.size(), 0);
  front.assign(windows_.size(), 0);
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    const WindowBlockManager& wm = *windows_[w];
    std::int32_t& f = front[w];
    if (wm.is_swa()) f = std::max(0, plan.reused_tokens - window_sizes_[w]) / tpb_;
    KVC_CHECK(f <= plan.full_blocks, "reuse plan: released front past the matched blocks");
    need[w] = num_blocks - plan.full_blocks;  // the partial block (taken over or copied) and fresh ones
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
  const ReusePlan& plan = PlanReuse(tokens, n, extras, prepared);
  const std::int32_t first = FirstChunkEnd(n, plan.reused_tokens, prefill);
  PromptBlocksNeeded(plan, CeilDiv(first, tpb_));
  std::map<WindowSize, std::int32_t> out;
  for (std::size_t w = 0; w < windows_.size(); ++w) out.emplace_hint(out.end(), window_sizes_[w], prompt_need_[w]);
  return out;
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
  if (id < 0) ThrowInvalid("request_id must be >= 0, got ", id);
  if (sequences_.count(id) != 0) ThrowInvalid("request id ", id, " is already registered");
  if (prepared == nullptr) ValidatePrompt(tokens, n, "add_sequence", id);  // a prepared one was checked
  const ReuseExtras& extras = prepared != nullptr ? prepared->extras : options.extras;
  auto check_priority = [id](const char* what, int p) {
    if (p < kMinPriority || p > kMaxPriority) ThrowInvalid("request ", id, ": ", what, " must be in 0..100, got ", p);
  };
  const int priority = options.priority.value_or(kDefaultPriority);
  check_priority("priority", priority);
  if (options.decode_priority.has_value()) check_priority("decode_priority", *options.decode_priority);
  if (options.decode_duration_ms < 0) ThrowInvalid("request ", id, ": decode_duration_ms must be >= 0");
  for (const PriorityRange& r : options.priority_ranges) {
    check_priority("a priority range's priority", r.priority);
    if (r.start < 0 || (r.end >= 0 && r.end <= r.start) || r.duration_ms < 0) {
      ThrowInvalid("request ", id, ": bad priority range [", r.start, ", ", r.end, ")");
    }
  }
  ValidateMultimodal(extras, "add_sequence", id);
  if (max_batch_size_ > 0 && sequences_.size() >= static_cast<std::size_t>(max_batch_size_)) {
    throw KVCacheError(detail::Concat("request ", id, ": max_batch_size (", max_batch_size_,
                                      ") sequences are already registered"));
  }
  ValidatePrefill(prefill, "add_sequence", id);
  const ReusePlan& plan = PlanReuse(tokens, n, extras, prepared.get());
  const std::int32_t reused = plan.reused_tokens;
  // Blocks now for the reused prefix and the first chunk; the rest of the prompt comes by Prefill.
  const std::int32_t first = FirstChunkEnd(n, reused, prefill);
  const std::int32_t num_blocks = CeilDiv(first, tpb_);
  const std::int32_t prompt_blocks = CeilDiv(static_cast<std::int64_t>(n), tpb_);
  const std::int32_t full = plan.full_blocks;
  const std::int32_t has_partial = plan.partial_tokens > 0 ? 1 : 0;
  PromptBlocksNeeded(plan, num_blocks);
  const std::vector<std::int32_t>& need = prompt_need_;
  const std::vector<std::int32_t>& front = prompt_front_;
  {
    std::vector<std::int64_t>& available = check_available_;
    for (std::size_t w = 0; w < windows_.size(); ++w) {
      check_need_[w] = need[w];
      available[w] = windows_[w]->NumFreePrimary();
    }
    // What this call claims or copies from is not lent.
    const KeptBlocks kept{tree_.get(), plan.path.data(), full, front.data(),
                          has_partial ? plan.partial_src.data() : nullptr};
    const std::int64_t short_w = lender_->PlanBlocks(check_need_, available, &kept);
    if (short_w >= 0) {
      const auto w = static_cast<std::size_t>(short_w);
      throw OutOfBlocksError(detail::Concat("request ", id, ": window ", window_sizes_[w], " needs ", need[w],
                                            " blocks for a ", n, "-token prompt (", reused,
                                            " tokens reused) but has ", available[w], " free", lender_->LendNote(w)));
    }
  }
  Sequence& seq = sequences_[id];
  seq.id = id;
  seq.num_tokens = first;
  seq.prompt_len = static_cast<std::int32_t>(n);
  seq.priority = priority;
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
  // Claim everything the plan reuses before taking any free block, so that no eviction can
  // pick a block this sequence is about to use.
  std::vector<char> src_held(windows_.size(), 0);
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    WindowBlockManager& wm = *windows_[w];
    SequenceWindow& sw = seq.windows[w];
    sw.blocks.reserve(static_cast<std::size_t>(prompt_blocks));  // later chunks grow it in place
    sw.blocks.assign(static_cast<std::size_t>(num_blocks), kNullBlock);
    sw.front_null = front[w];
    sw.released.assign(static_cast<std::size_t>(front[w]), {kNullBlock, 0});
    for (std::int32_t i = front[w]; i < full; ++i) {
      Attach(seq, w, i, Handout::kShare, tree_->Block(plan.path[static_cast<std::size_t>(i)], static_cast<std::int32_t>(w)));
    }
    if (has_partial && !plan.partial_takeover[w]) {
      // A source that is copied is held only while the copy is issued. A free primary source is
      // not held (that would cost a free block): the copy happens first (below), and if that
      // block is itself the next victim it is taken over instead.
      const BlockId src = plan.partial_src[w];
      src_held[w] = !wm.IsPrimary(src) || wm.RefCount(src) > 0;
      if (src_held[w]) wm.Claim(src);
    }
  }
  // Slabs move once the reused blocks are held: a lent block's eviction (and an offload's
  // drop of the oldest host block) cannot reach them then. Free partial sources are kept.
  MoveSlabs();
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    if (has_partial && plan.partial_takeover[w]) Attach(seq, w, full, Handout::kTakeOver, plan.partial_src[w]);
  }
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    WindowBlockManager& wm = *windows_[w];
    SequenceWindow& sw = seq.windows[w];
    std::int64_t fresh = 0;
    if (has_partial && !plan.partial_takeover[w]) {  // first: before any other block of this window is taken
      const BlockId src = plan.partial_src[w];
      if (!src_held[w] && wm.policy().Peek(CacheLevel::kPrimary) == src) {
        Attach(seq, w, full, Handout::kTakeOver, src);  // the free source is the next victim anyway
      } else {
        // A free source that this acquisition's eviction unlinks keeps its bytes until it is
        // handed out, which cannot happen before the copy below.
        AttachFresh(seq, w, full, full + 1);
        wm.CopyTokens(sw.blocks[static_cast<std::size_t>(full)], src, plan.partial_tokens);
        if (src_held[w]) wm.Release(src);
        ++fresh;
      }
    }
    for (std::int32_t i = front[w]; i < full; ++i) {
      if (!wm.IsPrimary(sw.blocks[static_cast<std::size_t>(i)])) {
        Attach(seq, w, i, Handout::kOnboard);
        ++fresh;
      }
    }
    AttachFresh(seq, w, full + has_partial, num_blocks);
    fresh += num_blocks - (full + has_partial);
    const std::int64_t reused_w = reuse_ ? full + has_partial : 0;
    const std::int64_t missed_w = reuse_ ? prompt_blocks - reused_w : 0;  // the lookup covers the whole prompt
    counters_[w].alloc_total += num_blocks - front[w];
    counters_[w].alloc_new += fresh;
    counters_[w].reused += reused_w;
    counters_[w].missed += missed_w;
    seq.reused_blocks += reused_w;
    seq.missed_blocks += missed_w;
    seq.new_blocks += fresh;
  }
  // Onboards, partial copies and offloads must land before the engine reads or overwrites
  // these blocks: the call returns with every copy complete.
  backend_->Synchronize();
  return reused;
}

void KVCacheManager::Prefill(SeqId id, std::int32_t num_tokens) { Prefill(&id, &num_tokens, 1); }

void KVCacheManager::Prefill(const SeqId* ids, const std::int32_t* num_tokens, std::size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  // 1. Validate every argument before touching anything.
  BeginBatch(n);
  std::int64_t need = 0;  // new blocks of the whole batch (the same in every window)
  for (std::size_t i = 0; i < n; ++i) {
    Sequence& seq = BatchMember(i, ids[i], "prefill");
    if (num_tokens[i] < 1) ThrowInvalid("prefill: num_tokens must be >= 1, got ", num_tokens[i]);
    const std::int32_t remaining = seq.prompt_len - seq.num_tokens;
    if (num_tokens[i] > remaining) {
      ThrowInvalid("prefill: request ", ids[i], " has ", std::max(remaining, 0), " prompt tokens left, cannot prefill ",
                   num_tokens[i]);
    }
    need += CeilDiv(seq.num_tokens + num_tokens[i], tpb_) - static_cast<std::int32_t>(seq.windows[0].blocks.size());
  }
  // 2. Check. A chunk's first query, at position num_tokens, attends nothing before what a
  //    sequence of num_tokens + 1 tokens keeps: the decode step's release rule, so what the
  //    releases free counts as in AddTokens.
  const std::int64_t short_w = need > 0 ? ShortWindowForBatch(need) : -1;
  if (short_w >= 0) {
    const auto w = static_cast<std::size_t>(short_w);
    const std::int64_t available = check_available_[w];
    if (n == 1) {
      throw OutOfBlocksError(detail::Concat("prefill: request ", ids[0], " needs ", need, " new blocks in window ",
                                            window_sizes_[w], " for ", num_tokens[0], " tokens but only ", available,
                                            " can be freed or are free", lender_->LendNote(w)));
    }
    throw OutOfBlocksError(detail::Concat("prefill needs ", need, " new blocks in window ", window_sizes_[w], " for ", n,
                                          " requests but only ", available, " can be freed or are free",
                                          lender_->LendNote(w)));
  }
  MoveSlabs();
  // 3. Mutate: every sequence releases first (the check credited those blocks), then hands out.
  for (Sequence* seq : batch_) {
    for (std::size_t w = 0; w < windows_.size(); ++w) ReleaseFront(*seq, w, seq->num_tokens + 1);
  }
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
    seq.num_tokens = new_len;
  }
  for (auto& c : counters_) {
    c.alloc_total += need;
    c.alloc_new += need;
  }
  backend_->Synchronize();  // offloads of evicted blocks finish before they are overwritten
}

std::int32_t KVCacheManager::PromptLength(SeqId id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return Find(id).prompt_len;
}

void KVCacheManager::BeginBatch(std::size_t n) {
  ++stamp_;
  batch_.resize(n);  // sized once and written by index (BatchMember)
}

void KVCacheManager::ThrowRepeated(SeqId id, const char* call) {
  ThrowInvalid("request id ", id, " appears twice in one ", call, " call");
}

std::int64_t KVCacheManager::ShortWindowForBatch(std::int64_t need) {
  // Releases are counted only where they matter: in a window short of free blocks and, once one
  // is, in every window, since a lender may borrow what the others keep beyond their need.
  // (Without lending the call fails then anyway: the other windows' counts change no answer.)
  bool short_of_blocks = false;
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    std::int64_t& available = check_available_[w];
    available = windows_[w]->NumFreePrimary();
    batch_counted_[w] = 0;
    if (available >= need) continue;
    available += FreedByBatchReleases(w);
    batch_counted_[w] = 1;
    short_of_blocks = short_of_blocks || available < need;
  }
  if (!short_of_blocks) return -1;
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    if (!batch_counted_[w]) check_available_[w] += FreedByBatchReleases(w);
  }
  std::fill(check_need_.begin(), check_need_.end(), need);
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
  // 1. Validate every argument before touching anything.
  BeginBatch(n);
  batch_new_block_.resize(n);  // written by index, as batch_: no push_back per sequence
  std::int32_t need = 0;  // sequences that start a new block (the same in every window)
  for (std::size_t i = 0; i < n; ++i) {
    Sequence& seq = BatchMember(i, ids[i], "add_tokens");
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
  }
  // 2. Check that every window can serve the new blocks, counting the blocks that the
  //    sliding windows release in this same step (released before anything is allocated).
  const std::int64_t short_w = need > 0 ? ShortWindowForBatch(need) : -1;
  if (short_w >= 0) {
    const auto w = static_cast<std::size_t>(short_w);
    throw OutOfBlocksError(detail::Concat("add_tokens needs ", need, " new blocks in window ", window_sizes_[w],
                                          " but only ", check_available_[w], " can be freed or are free",
                                          lender_->LendNote(w)));
  }
  MoveSlabs();
  // 3. Mutate: append, release what left each sliding window, then allocate.
  for (std::size_t i = 0; i < n; ++i) {
    Sequence& seq = *batch_[i];
    seq.AppendToken(tokens[i]);
    ++seq.num_tokens;
    for (std::size_t w = 0; w < windows_.size(); ++w) ReleaseFront(seq, w, seq.num_tokens);
  }
  if (need == 0) return;
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
  backend_->Synchronize();  // offloads of evicted blocks finish before they are overwritten
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
  }
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
    if (copy[w]) {
      const auto last = static_cast<std::int32_t>(keep - 1);
      const BlockId shared = blocks[keep - 1];
      windows_[w]->Claim(shared);  // held while it is copied from
      Detach(seq, w, last, last + 1, Leave::kEnd);
      AttachFresh(seq, w, last, last + 1);
      windows_[w]->CopyTokens(blocks[keep - 1], shared, tail_tokens);
      windows_[w]->Release(shared);
    }
  }
  backend_->Synchronize();
  seq.OwnTokens();
  seq.tokens.resize(static_cast<std::size_t>(new_len));
  seq.num_tokens = new_len;
  // Rewound prompt tokens are prompt no longer: what store_context_blocks may store shrinks too.
  seq.prompt_len = std::min(seq.prompt_len, new_len);
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

std::int32_t KVCacheManager::CopyBlockOffsets(std::int32_t* out, std::int64_t rows, std::int64_t width,
                                              const SeqId* ids, std::size_t n, std::int64_t slot_offset) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (slot_offset < 0) ThrowInvalid("slot_offset must be >= 0, got ", slot_offset);
  if (rows < 0 || width < 0) ThrowInvalid("copy_block_offsets: negative output shape ", rows, " x ", width);
  // Compared without forming slot_offset + n, which can overflow.
  if (slot_offset > rows || static_cast<std::uint64_t>(n) > static_cast<std::uint64_t>(rows - slot_offset)) {
    ThrowInvalid("copy_block_offsets: ", n, " rows from slot_offset ", slot_offset, " do not fit an output with ", rows,
                 " rows");
  }
  std::int32_t widest = 0;
  std::vector<const Sequence*> seqs;
  seqs.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    seqs.push_back(&Find(ids[i]));
    widest = std::max(widest, static_cast<std::int32_t>(seqs.back()->windows[0].blocks.size()));
  }
  if (widest > width) {
    ThrowInvalid("copy_block_offsets: a sequence spans ", widest, " blocks but the output is ", width, " wide");
  }
  const std::int64_t kv = kv_factor_;
  for (std::size_t g = 0; g < pool_index_.size(); ++g) {
    const auto [w, p] = pool_index_[g];
    // Offsets count K/V slabs of the pool from its base; a block is `stride` of them.
    const std::int64_t stride =
        static_cast<std::int64_t>(windows_[w]->primary_stride(p) / windows_[w]->pools()[p].SlabBytes());
    for (std::size_t i = 0; i < n; ++i) {
      const auto& blocks = seqs[i]->windows[w].blocks;
      for (std::int64_t k = 0; k < kv; ++k) {
        std::int32_t* row = out + ((static_cast<std::int64_t>(g) * rows + slot_offset + static_cast<std::int64_t>(i)) * kv + k) * width;
        std::int32_t j = 0;
        for (; j < static_cast<std::int32_t>(blocks.size()); ++j) {
          const BlockId b = blocks[static_cast<std::size_t>(j)];
          row[j] = b == kNullBlock ? kOffsetSentinel : static_cast<std::int32_t>(b * stride + k);
        }
        for (; j < widest; ++j) row[j] = kOffsetSentinel;
      }
    }
  }
  return widest;
}

LayerView KVCacheManager::GetLayerView(std::int32_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (layer < 0 || layer >= static_cast<std::int32_t>(layer_to_pool_.size())) {
    ThrowInvalid("layer_idx ", layer, " is out of range [0, ", layer_to_pool_.size(), ")");
  }
  if (!backend_->HasMemory()) throw KVCacheError("the virtual backend has no KV memory to view");
  const auto [g, idx] = layer_to_pool_[static_cast<std::size_t>(layer)];
  const auto [w, p] = pool_index_[static_cast<std::size_t>(g)];
  const WindowBlockManager& wm = *windows_[w];
  const PoolLayout& pool = wm.pools()[p];
  const std::int64_t elem = pool.elem_bytes;
  const auto slab = static_cast<std::int64_t>(pool.SlabBytes());
  LayerView view;
  view.data = static_cast<unsigned char*>(wm.primary_base(p)) + static_cast<std::int64_t>(idx) * kv_factor_ * slab;
  view.dtype = pool.dtype;
  view.shape = {wm.num_primary(), kv_factor_, pool.num_kv_heads, tpb_, pool.head_dim};
  view.strides = {static_cast<std::int64_t>(wm.primary_stride(p)), slab,
                  static_cast<std::int64_t>(tpb_) * pool.head_dim * elem, pool.head_dim * elem, elem};
  view.backend = backend_->Kind();
  return view;
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
    s.offloaded_blocks += wm.offloaded_blocks();
    s.onboarded_blocks += wm.onboarded_blocks();
  }
  s.num_cached_nodes = static_cast<std::int64_t>(tree_->NumNodes()) - 1;
  s.lent_slabs = lender_->lent_slabs();
  s.allocated_bytes += backend_->HasMemory() ? static_cast<std::int64_t>(lender_->arena_bytes()) : 0;
  s.used_num_blocks = s.max_num_blocks - s.free_num_blocks;
  const auto lookups = s.reused_blocks + s.missed_blocks;
  s.cache_hit_rate = lookups == 0 ? 0.0 : static_cast<double>(s.reused_blocks) / static_cast<double>(lookups);
  return s;
}

void KVCacheManager::CheckInvariants() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::vector<std::int32_t>> refs(windows_.size());
  for (std::size_t w = 0; w < windows_.size(); ++w) {
    refs[w] = pins_[w];  // pins hold references too
  }
  for (const auto& [id, seq] : sequences_) {
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
      const std::int64_t limit = windows_[w]->is_swa() ? seq.num_tokens - window_sizes_[w] : 0;
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
        ++refs[w][static_cast<std::size_t>(b)];
      }
    }
  }
  tree_->CheckInvariants();
  for (std::size_t w = 0; w < windows_.size(); ++w) windows_[w]->CheckInvariants(refs[w]);
  lender_->CheckInvariants();
  CheckOwnership();
}

void KVCacheManager::CheckOwnership() const {
  // 1. Every release record whose block was not handed out again names its sequence among the
  //    block's releasers, and the releaser lists hold nothing else.
  for (std::size_t w = 0; w < windows_.size(); ++w) {
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
  // 2. A cached block that a sequence holds, or still owns through a current release record,
  //    sits at the tree node of that sequence's own prefix at that position: same depth, a key
  //    that is a prefix of the block's tokens (a partial node keys only the first ones) and the
  //    same chained hash. (A block cached under another prefix would serve that prefix stale KV.)
  for (const auto& [id, seq] : sequences_) {
    const std::int32_t num_blocks = CeilDiv(seq.num_tokens, tpb_);
    std::vector<std::uint64_t> chain(static_cast<std::size_t>(num_blocks) + 1, 0);  // chain[j]: before block j
    for (std::int32_t d = 0; d < seq.num_tokens / tpb_; ++d) {  // full blocks: every block but maybe the last
      chain[static_cast<std::size_t>(d) + 1] =
          ChainHash(chain[static_cast<std::size_t>(d)], seq.TokenData() + static_cast<std::ptrdiff_t>(d) * tpb_,
                    tpb_, BlockExtrasDigest(seq.extras, d, d * tpb_, tpb_));
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
}

}  // namespace kvcache
